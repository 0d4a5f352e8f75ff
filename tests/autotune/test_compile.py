"""Compiled jobs (issue 35): the probe's trials of a compiled model against the CPU allocator's own count of the
same model compiled the ordinary way (torch.compile, a training step written out here, torch.profiler's memory
events summed in order: no project code in the truth), and the refusals of what cannot be compiled or budgeted.

Compiling costs tens of seconds on this machine: one tiny model, the probe's compile and the truth's shared
through module-scoped fixtures.
"""

from __future__ import annotations

import gc
import math
import warnings
from contextlib import nullcontext
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

from autotune import ProbeTask
from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.core.policy_names import canonical_policy
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.tasks.fingerprint import task_fingerprint

with warnings.catch_warnings():  # inductor's first import touches torch.jit, which warns it is deprecated
    warnings.simplefilter("ignore", DeprecationWarning)
    import torch._inductor.compile_fx  # noqa: F401

VOCAB, SEQ, WIDTH = 128, 32, 32


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_new: a chain of Python ops whose intermediates eager autograd keeps for the
    backward and the compiled partitioner recomputes."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.proj = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(gelu_new(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batch(m: int, seq_len: int = SEQ) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (m, seq_len), generator=torch.Generator().manual_seed(m))
    return {"input_ids": ids, "labels": ids}


def fixed_batch(m: int) -> dict[str, torch.Tensor]:
    """batch at SEQ only (a task whose batch takes no seq_len is not sequence-aware)."""
    return batch(m)


def loss(model: nn.Module, b: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(b["input_ids"]).flatten(0, 1), b["labels"].flatten())


BUDGET = 1_450_000  # compiled, m = 8 peaks at about 1.39 MB; eager at about 2.2 MB


_PEAKS: dict[tuple[int, bool, float | None, int], int] = {}


def allocator_peak(m: int, *, compiled: bool, budget: float | None = None, seq_len: int = SEQ) -> int:
    """allocator_peak_once, each truth counted once a module (tests asking for the same run share its count)."""
    key = (m, compiled, budget, seq_len)
    if key not in _PEAKS:
        _PEAKS[key] = allocator_peak_once(m, compiled=compiled, budget=budget, seq_len=seq_len)[0]
    return _PEAKS[key]


class HostCopies:
    """What a user writes to offload a block's saved activations, with the host copies outside torch's allocator
    (numpy's memory, as a card's host memory is outside its device's allocator) so that the CPU allocator's count is
    the device's: pack copies to the host, unpack copies back through the allocator. Its own host count (live
    bytes, peak)."""

    def __init__(self) -> None:
        self.live_bytes = self.peak_bytes = 0

    def wrap(self, block: nn.Module) -> None:
        forward = block.forward

        def offloaded(*args: Any, **kwargs: Any) -> Any:
            # dynamo breaks its graph at the hooks and reads .grad of the block's input to guard on it: a warning,
            # which pytest's "error" filter would raise.
            with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
                warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
                return forward(*args, **kwargs)

        block.forward = offloaded  # type: ignore[method-assign]

    def pack(self, tensor: torch.Tensor) -> Any:
        copy = tensor.detach().numpy().copy()
        self.live_bytes += copy.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return _Packed(copy, self)

    def unpack(self, packed: Any) -> torch.Tensor:
        return torch.from_numpy(packed.array).clone()


class _Packed:
    def __init__(self, array: Any, host: HostCopies) -> None:
        self.array, self.host = array, host

    def __del__(self) -> None:
        self.host.live_bytes -= self.array.nbytes


def allocator_peak_once(
    m: int, *, compiled: bool, budget: float | None = None, seq_len: int = SEQ, offload: bool = False
) -> tuple[int, int]:
    """The CPU allocator's peak over what a user writes: build, torch.compile(model) (its first call compiles, at
    m, under the compiler's activation memory budget where one is given) and two accumulated AdamW steps at m:
    the memory events' running sum; and the host's peak, where ``offload`` runs each block's forward under
    HostCopies (else 0)."""
    import torch._functorch.config as functorch_config

    torch._dynamo.reset()  # a fresh process's compiler: nothing cached from another size or model
    gc.collect()
    host = HostCopies()
    ratio = functorch_config.patch(activation_memory_budget=budget) if budget is not None else nullcontext()
    with ratio, profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = TinyGPT()
        if offload:
            for block in model.blocks:
                host.wrap(block)
        run: nn.Module = torch.compile(model) if compiled else model  # type: ignore[assignment]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            for _ in range(2):
                b = batch(m, seq_len=seq_len)
                (loss(run, b) / 2).backward()
                del b
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, run, optimizer
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak, host.peak_bytes


def make_task(**changes: Any) -> ProbeTask:
    return ProbeTask(name="tiny-gpt-gelu-new", model=TinyGPT, batch=fixed_batch, loss=loss, **changes)


@pytest.fixture(scope="module")
def compiled_profile() -> Any:
    """The probe of the compiled task, its peaks broken down (the breakdown's marks ride in the profiler's stream:
    the trials' figures are still the allocator's, as the test below them checks)."""
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0, breakdown=True)
    return probe(make_task(compile="default"), config)


@pytest.mark.slow  # two compilations of the truth, one of the probe: minutes on two cores
def test_compiled_trials_equal_the_allocators_count_at_m_max_and_above(compiled_profile: Any) -> None:
    real = {t.micro_batch: t for t in compiled_profile.trials if not t.fake}
    m_max = compiled_profile.max_micro_batch
    assert m_max + 1 in real, "the search measured the size above m_max"
    for m in (m_max, m_max + 1):
        assert real[m].peak_bytes == allocator_peak(m, compiled=True), m
    assert real[m_max].fits and not real[m_max + 1].fits


def test_eager_and_compiled_differ_for_gelu_new(compiled_profile: Any) -> None:
    m_max = compiled_profile.max_micro_batch
    real = {t.micro_batch: t for t in compiled_profile.trials if not t.fake}
    eager = allocator_peak(m_max, compiled=False)
    assert eager > BUDGET >= real[m_max].peak_bytes  # eager, the compiled job's m_max would not fit
    assert eager > 1.2 * real[m_max].peak_bytes


def test_the_datasheet_says_compiled_and_the_compile_seconds_apart(compiled_profile: Any) -> None:
    assert compiled_profile.tags["compile"] == "default"
    assert compiled_profile.compile_seconds is not None and compiled_profile.compile_seconds > 0
    real_seconds = sum(t.seconds for t in compiled_profile.trials if not t.fake)
    assert compiled_profile.compile_seconds > max(t.seconds for t in compiled_profile.trials if not t.fake)
    assert real_seconds + compiled_profile.compile_seconds <= compiled_profile.seconds
    assert any("fake pre-search ran the eager model" in w for w in compiled_profile.warnings)


def test_a_compiled_peak_is_broken_down_and_its_parts_are_the_ordinary_counts(compiled_profile: Any) -> None:
    """Issue 42 for a compiled job: the parts of the compiled trials' peaks (read off the allocator's events, by the
    addresses of what the trial says its parameters, gradients and optimizer state are) against counts that share no
    code with the meter: the model built the ordinary way, and the state torch's AdamW holds after a real step."""
    real = {t.micro_batch: t for t in compiled_profile.trials if not t.fake}
    m_max = compiled_profile.max_micro_batch
    assert not any("not broken down" in w for w in compiled_profile.warnings), compiled_profile.warnings
    assert [(b.micro_batch, b.fits) for b in compiled_profile.breakdown] == [(m_max, True), (m_max + 1, False)]
    model = TinyGPT()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss(model, batch(2)).backward()
    optimizer.step()
    state = sum(t.untyped_storage().nbytes() for s in optimizer.state.values() for t in s.values())
    for part in compiled_profile.breakdown:
        assert part.peak_bytes == real[part.micro_batch].peak_bytes == sum(part.parts.values())
        assert part.parts["trainable_parameters"] == part.parts["gradients"] == weights, part.parts
        assert part.parts["optimizer_state"] == state, part.parts
        assert part.parts["activations"] > 0 and part.peak_where.startswith("compiled code in the"), part
    # More samples hold more activations; the weights, gradients and state do not move.
    low, high = compiled_profile.breakdown
    assert high.parts["activations"] > low.parts["activations"]


def test_compile_enters_the_fingerprint_and_eager_stays_as_it_was() -> None:
    eager = make_task()
    assert "compile" not in eager.tags
    assert task_fingerprint(make_task(compile="default")) != task_fingerprint(eager)
    assert task_fingerprint(make_task(compile="max-autotune")) != task_fingerprint(make_task(compile="default"))
    assert task_fingerprint(eager) == task_fingerprint(make_task(tags={}))


def test_an_unknown_mode_and_a_budget_without_compile_are_refused() -> None:
    with pytest.raises(TaskError, match="not a torch.compile mode"):
        make_task(compile="fastest")
    with pytest.raises(TaskError, match="give --compile"):
        make_task(activation_checkpointing="budget:0.5")
    assert make_task(compile="default", activation_checkpointing="budget:0.50").activation_checkpointing == (
        "budget:0.5"
    )
    with pytest.raises(ValueError, match="ratio from 0 to 1"):
        canonical_policy("budget:1.5")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--compile", "fastest"], "argument --compile: 'fastest' is not a torch.compile mode"),
        (["--ac", "budget:1.5"], "ratio from 0 to 1"),
        (["--ac", "budget:0.5"], "--ac budget:0.5 without --compile: the compiler's activation memory budget applies"),
    ],
)
def test_the_cli_refuses_in_one_line(flags: list[str], says: str, tmp_path: Any, capsys: Any) -> None:
    output = tmp_path / "profile.json"
    try:
        code = main(
            ["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "8MiB", "--output", str(output)] + flags
        )
    except SystemExit as exc:  # the parser's own refusal
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err, err
    assert not output.exists()


UNCOMPILABLE = """
import torch
from torch import nn
from autotune import ProbeTask


@torch.library.custom_op("autotune_test::no_fake", mutates_args=())
def no_fake(x: torch.Tensor) -> torch.Tensor:
    return x.clone()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return no_fake(self.linear(x))


task = ProbeTask(name="no-fake", model=Model, batch=lambda m: torch.randn(m, 8))
"""


def test_a_model_the_compiler_fails_on_is_one_line_naming_the_op(tmp_path: Any, capsys: Any) -> None:
    source = tmp_path / "uncompilable.py"
    source.write_text(UNCOMPILABLE)
    output = tmp_path / "profile.json"
    code = main(
        ["probe", f"{source}:task", "--device", "cpu", "--budget", "8MiB", "--compile", "--output", str(output)]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    errors = [line for line in err.splitlines() if line.startswith("autotune: error:")]  # after the progress line
    assert len(errors) == 1 and errors[0] == err.splitlines()[-1], err
    assert "cannot be compiled" in errors[0] and "autotune_test.no_fake" in errors[0], err
    assert not output.exists()


def test_suggest_passes_a_compiled_models_mode_on_and_warns_where_it_cannot() -> None:
    from autotune_client import job_fingerprint

    compiled: Any = torch.compile(TinyGPT(), mode="max-autotune")  # lazy: nothing compiles until it is called
    assert job_fingerprint(compiled, example=fixed_batch(1)) == task_fingerprint(make_task(compile="max-autotune"))
    assert job_fingerprint(TinyGPT(), example=batch(1)) == task_fingerprint(make_task())
    with pytest.warns(UserWarning, match="aot_eager backend: autotune compiles with inductor only"):
        aot_eager: Any = torch.compile(TinyGPT(), backend="aot_eager")
        other = job_fingerprint(aot_eager, example=batch(1))
    assert other == task_fingerprint(make_task())


# --- The static confirmation (autotune/search/static.py: confirm_static) ---------------------------------


def _trial(m: int, peak: int, limit: int) -> Any:
    from autotune.core.schemas import Trial

    return Trial(micro_batch=m, peak_bytes=peak, fits=peak <= limit, oom=peak > limit)


@pytest.mark.parametrize(
    ("static_peaks", "answer", "tried"),
    [
        ({7: 90, 8: 110}, 7, [7, 8]),  # the dynamic answer stands
        ({7: 101, 6: 99}, 6, [7, 6]),  # static m_max does not fit: one step down
        ({7: 95, 8: 99, 9: 100, 10: 130}, 9, [7, 8, 10, 9]),  # static fits above: up, doubling, then bisected
        ({7: 110, 6: 105, 4: 90, 5: 95}, 5, [7, 6, 4, 5]),  # and down
        ({m: 5 * m for m in range(7, 23)}, 20, [7, 8, 10, 14, 22, 18, 20, 21]),  # 8 compilations, not 15
    ],
)
def test_the_static_confirmation_decides(
    static_peaks: dict[int, int], answer: int, tried: list[int], monkeypatch: Any
) -> None:
    """The search's answer (7, dynamic trials at 7 fitting and 8 not) against static trials that read other peaks:
    the static ones decide and replace the dynamic trials at their sizes."""
    from autotune.search import static
    from autotune.search.boundary import SearchResult

    limit = 100
    ran: list[int] = []

    def static_trial(task: Any, meter: Any, strategy: Any, m: int, limit_bytes: int, host: Any, *more: Any) -> Any:
        ran.append(m)
        return _trial(m, static_peaks[m], limit_bytes)

    monkeypatch.setattr(static, "_static_trial", static_trial)
    monkeypatch.setattr(static, "compiles_on", lambda meter: True)
    dynamic = SearchResult(max_micro_batch=7, trials=[_trial(m, 12 * m, limit) for m in (4, 7, 8, 9)])
    notes: list[str] = []

    class Meter:
        compile_seconds = 3.0

    config = ProbeConfig(device="cpu", budget_bytes=1000, max_micro_batch=64)
    found = static.confirm_static(make_task(compile="default"), Meter(), config, None, limit, dynamic, notes)
    assert found.max_micro_batch == answer and ran == tried
    by_size = {t.micro_batch: t for t in found.trials}
    assert [t.micro_batch for t in found.trials].count(7) == 1 and by_size[7].peak_bytes == static_peaks[7]
    assert by_size[4].peak_bytes == (static_peaks[4] if 4 in ran else 48)  # one not confirmed keeps its dynamic trial
    assert by_size[answer].fits and not by_size[answer + 1].fits
    assert len(notes) == 1 and notes[0].startswith("static confirmation") and f"{len(tried)} compilations" in notes[0]
    assert ("-> " + str(answer)) in notes[0] if answer != 7 else "->" not in notes[0]


def test_an_eager_task_is_not_confirmed() -> None:
    from autotune.search import static
    from autotune.search.boundary import SearchResult

    result = SearchResult(max_micro_batch=3, trials=[])
    config = ProbeConfig(device="cpu", budget_bytes=1000)
    assert static.confirm_static(make_task(), object(), config, None, 100, result, []) is result


# --- The compiler's memory budget, end to end (--ac budget:R) ---------------------------------------------------------

BUDGETS = {"budget:1": 1.0, "budget:0.5": 0.5}


@pytest.fixture(scope="module")
def budget_profiles() -> dict[str, Any]:
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0)
    return {policy: probe(make_task(compile="default", activation_checkpointing=policy), config) for policy in BUDGETS}


@pytest.mark.slow  # two probes (three compilations each) and four compilations of the truth
def test_two_budgets_give_two_answers_each_equal_to_an_ordinary_compile_under_that_budget(
    budget_profiles: dict[str, Any],
) -> None:
    answers = {policy: found.max_micro_batch for policy, found in budget_profiles.items()}
    assert answers["budget:0.5"] > answers["budget:1"], answers  # the partitioner's ratio moves m_max
    for policy, found in budget_profiles.items():
        assert found.activation_checkpointing == policy
        real = {t.micro_batch: t for t in found.trials if not t.fake}
        m_max = found.max_micro_batch
        for m in (m_max, m_max + 1):
            assert real[m].peak_bytes == allocator_peak(m, compiled=True, budget=BUDGETS[policy]), (policy, m)
        assert real[m_max].fits and not real[m_max + 1].fits


# --- Timed runs, verify and lengths of a compiled task ----------------------------------------------------------------


@pytest.mark.slow  # a compilation (seconds with inductor's caches warm, a minute cold on a loaded machine)
def test_timed_runs_of_a_compiled_task_run_compiled_and_leave_the_meters_base() -> None:
    from torch._dynamo.utils import counters

    from autotune.measure.meters.compiled import CompiledCpuMeter
    from autotune.measure.strategies import Replicated
    from autotune.measure.throughput import time_sizes

    meter = CompiledCpuMeter(BUDGET)
    base = meter.live_bytes
    graphs = counters["stats"]["unique_graphs"]
    timings = time_sizes(make_task(compile="default"), meter, Replicated(1), [4], repeats=1, min_seconds=0.0)
    assert counters["stats"]["unique_graphs"] > graphs  # compiled, static at 4: what the job at m = 4 runs
    assert list(timings.per_size) == [4] and timings.repeats >= 1
    assert meter.live_bytes == base  # the timed model left the base of later trials
    graphs = counters["stats"]["unique_graphs"]
    time_sizes(make_task(), meter, Replicated(1), [4], repeats=1, min_seconds=0.0)
    assert counters["stats"]["unique_graphs"] == graphs  # an eager task compiles nothing


def test_verify_of_a_compiled_task_says_it_ran_eager() -> None:
    from autotune.loop.verify import verify_cli

    ok, line = verify_cli(make_task(compile="default"), 8, 2, None)
    assert ok and len(line.splitlines()) == 1
    assert "the task is compiled (default): verify ran the model eager" in line
    assert "compiled" not in verify_cli(make_task(), 8, 2, None)[1]


@pytest.mark.slow  # a compiled probe per length (three compilations each) and two of the truth
def test_lengths_of_a_compiled_task_run_compiled_and_equal_an_ordinary_compile() -> None:
    from autotune.orchestrate.lengths import probe_lengths

    task = ProbeTask(name="tiny-gpt-gelu-new-seq", model=TinyGPT, batch=batch, loss=loss, compile="default")
    run = probe_lengths(task, ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0), [16, 32], max_seq_len=64)
    assert [at.seq_len for at in run.profiles] == [16, 32]
    for at in run.profiles:
        assert at.compile_seconds is not None
        assert any(w.startswith("static confirmation") for w in at.warnings), at.warnings
        real = {t.micro_batch: t for t in at.trials if not t.fake}
        m_max = at.max_micro_batch
        assert real[m_max].peak_bytes == allocator_peak(m_max, compiled=True, seq_len=at.seq_len or SEQ)


@pytest.mark.slow  # a compiled probe (three compilations) and two of the truth
def test_offload_under_compile_equals_an_ordinary_compile_with_its_copies_on_the_host() -> None:
    """--offload activations under --compile: the compiled meter reads the CPU allocator, which would hold the
    offload's host copies too; the copies made in a host span are the host's, and the device's figure is then the
    allocator's count of an ordinary compile whose pack hooks copy to memory outside it (HostCopies), the host's its
    copies' peak. The breakdown's parts still sum to the device's peak."""
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0, breakdown=True)
    found = probe(make_task(compile="default", offload="activations"), config)
    real = {t.micro_batch: t for t in found.trials if not t.fake}
    m_max = found.max_micro_batch
    assert m_max > 8, m_max  # counted with its host copies, m_max was 7 at this budget
    for m in (m_max, m_max + 1):
        device, host = allocator_peak_once(m, compiled=True, offload=True)
        assert (real[m].peak_bytes, real[m].host_peak_bytes) == (device, host), m
    assert real[m_max].fits and not real[m_max + 1].fits
    assert found.host_peak_bytes == real[m_max].host_peak_bytes
    assert not any("not broken down" in w or "upper bound" in w for w in found.warnings), found.warnings
    for part in found.breakdown:
        assert part.peak_bytes == real[part.micro_batch].peak_bytes == sum(part.parts.values()), part
