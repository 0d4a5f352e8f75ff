"""The peak surface over (m, L): its arithmetic, that it predicts real peaks byte for byte, the probe
over lengths built on it, and the fall-back paths where it cannot be had."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from autotune.core.errors import TaskError
from autotune.core.surface import PeakSurface
from autotune.measure.meters import CpuMeter
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner, frozen_heap
from autotune.orchestrate.lengths import LengthsRun, check_lengths, estimate_lengths, probe_lengths, target_at_length
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.search.presearch import fake_surface, surface_points
from autotune.tasks.task import ProbeTask
from examples.gpt import GPTConfig, make_seq_task

MiB = 1 << 20
UNBOUNDED = 1 << 40
SMALL = GPTConfig(seq_len=4096, d_model=32, n_heads=2, n_layers=1)


def _poly(c: list[int], m: int, length: int) -> int:
    return c[0] + c[1] * m + c[2] * length + c[3] * m * length + c[4] * length**2 + c[5] * m * length**2


def test_six_traces_give_every_polynomial_point_exactly_and_pruning_keeps_the_answers() -> None:
    rng = random.Random(7)
    points = [[rng.randint(0, 10**6) for _ in range(6)] for _ in range(300)]
    traces = {(m, length): [_poly(c, m, length) for c in points] for m in (2, 3) for length in (16, 48, 96)}
    surface = PeakSurface.from_traces(traces)
    assert surface is not None and len(surface.pieces) == len(points)
    for m, length in [(1, 1), (9, 100), (200, 4000)]:
        truth = [_poly(c, m, length) for c in points]
        assert surface.peak_bytes(m, length) == max(truth)
        assert surface.predicts(m, length, truth)
        assert not surface.predicts(m, length, [t + 1 for t in truth])
    kept = surface.pruned(4096, range(16, 2049))
    assert len(kept.pieces) < 20
    for length in range(16, 2049, 37):
        limit = surface.peak_bytes(40, length)
        assert kept.max_fitting(limit, length, cap=4096) == surface.max_fitting(limit, length, cap=4096) == 40
    assert PeakSurface.from_dict(kept.as_dict()) == kept


def test_the_boundaries_in_m_and_in_l() -> None:
    # 1000 bytes fixed, 10 per token, 1 per token x length (materialized scores).
    traces = {(m, n): [1000, 1000 + 10 * m * n + m * n * n] for m in (2, 3) for n in (8, 16, 32)}
    surface = PeakSurface.from_traces(traces)
    assert surface is not None
    limit = 1000 + 10 * 5 * 64 + 5 * 64 * 64
    assert surface.max_fitting(limit, 64, cap=4096) == 5
    assert surface.max_fitting(limit, 64, cap=4096, multiple_of=2) == 4
    assert surface.max_fitting(limit, 64, cap=3) == 3
    assert surface.max_fitting(999, 64, cap=4096) == 0
    assert surface.longest_fitting(limit, 5, cap=1000) == 64
    assert surface.longest_fitting(limit, 5, cap=50) == 50
    assert surface.longest_fitting(999, 5, cap=1000) == 0


@pytest.mark.parametrize(
    "traces",
    [
        {(2, 8): [1], (3, 8): [1], (2, 16): [1], (3, 16): [1]},  # two lengths only
        {(m, n): [1] * (n // 8) for m in (2, 3) for n in (8, 16, 24)},  # traces of different lengths
    ],
)
def test_traces_that_do_not_line_up_give_no_surface(traces: dict) -> None:
    assert PeakSurface.from_traces(traces) is None


def test_the_traced_points_come_from_the_lengths_asked_for() -> None:
    assert surface_points([512, 128, 256, 1024], 1) == ((2, 3), (128, 512, 1024), (4, 256))
    assert surface_points([512], 2) == ((4, 6), (128, 256, 512), (8, 192))
    assert surface_points([64, 128], 1) == ((2, 3), (32, 64, 128), (4, 48))


def _real_peak(task: ProbeTask, m: int, strategy_name: str = "ddp", world: int = 1) -> int:
    strategy = make_strategy(strategy_name, world)
    with strategy.process_group(torch.device("cpu")), frozen_heap():
        runner = TrialRunner(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, strategy=strategy)
        try:
            return runner(m).peak_bytes
        finally:
            runner.close()


@pytest.mark.parametrize(
    ("attention", "strategy", "world"), [("sdpa", "ddp", 1), ("eager", "ddp", 1), ("sdpa", "fsdp", 2)]
)
def test_the_surface_predicts_the_real_cpu_peak_at_held_out_points_byte_for_byte(
    attention: str, strategy: str, world: int
) -> None:
    task = make_seq_task(GPTConfig(**{**SMALL.__dict__, "attention": attention}))
    chosen = make_strategy(strategy, world)
    with chosen.process_group(torch.device("cpu")), frozen_heap():
        # A limit of one byte: every traced trial is over it, and still traces whole (fake tensors take
        # no memory, so the surface's trials run without a budget).
        found = fake_surface(task, [32, 64, 128], limit_bytes=1, device_type="cpu", strategy=chosen, multiple_of=1)
    assert found.failed is None and found.surface is not None
    assert all(not t.fits and not t.oom for trials in found.trials.values() for t in trials)
    for m, length in [(5, 96), (2, 200)]:  # neither traced: other sizes, other lengths, one beyond them
        assert _real_peak(task.at_length(length), m, strategy, world) == found.surface.peak_bytes(m, length)


@pytest.fixture(scope="module")
def over_lengths() -> LengthsRun:
    """One real probe of the small sequence-aware GPT over three lengths at 8 MiB."""
    config = ProbeConfig(device="cpu", budget_bytes=8 * MiB, target_batch=64, throughput=False)
    return probe_lengths(make_seq_task(SMALL), config, [64, 128, 256])


def test_a_probe_over_lengths_is_exact_at_every_length_and_finds_the_longest(over_lengths: LengthsRun) -> None:
    task = make_seq_task(SMALL)
    run = over_lengths
    assert [p.seq_len for p in run.profiles] == [64, 128, 256]
    fingerprints = {p.fingerprint for p in run.profiles}
    assert len(fingerprints) == 1  # one setup, every length
    limit = run.profiles[0].limit_bytes
    for profile in run.profiles:
        assert profile.seq_len is not None
        # two real trials: m_max fits, m_max + 1 does not (exact), as a single-length probe finds
        real = [t for t in profile.trials if not t.fake]
        m_max = profile.max_micro_batch
        assert [(t.micro_batch, t.fits) for t in real] == [(m_max, True), (m_max + 1, False)]
    config = ProbeConfig(device="cpu", budget_bytes=8 * MiB, target_batch=64, throughput=False)
    alone = probe(task.at_length(128), config)
    assert alone.max_micro_batch == run.profiles[1].max_micro_batch and alone.fingerprint in fingerprints
    surface = run.surface
    assert surface is not None and surface.longest is not None
    longest = surface.longest.seq_len
    assert surface.covered == (64, longest) and surface.measured_lengths == [64, 128, 256]
    assert surface.longest.limited_by == "memory"
    assert _real_peak(task.at_length(longest), 1) <= limit < _real_peak(task.at_length(longest + 1), 1)


def test_an_estimate_over_lengths_equals_the_probe_on_the_cpu(over_lengths: LengthsRun) -> None:
    from autotune.orchestrate.estimate import EstimateConfig

    task = make_seq_task(SMALL)
    estimated = estimate_lengths(task, EstimateConfig.of(budget_bytes=8 * MiB, device_kind="cpu"), [64, 128, 256])
    measured = over_lengths
    assert [p.max_micro_batch for p in estimated.profiles] == [p.max_micro_batch for p in measured.profiles]
    assert all(p.source == "estimate" and all(t.fake for t in p.trials) for p in estimated.profiles)
    assert estimated.surface is not None and measured.surface is not None
    assert estimated.surface.longest is not None and measured.surface.longest is not None
    assert estimated.surface.longest.seq_len == measured.surface.longest.seq_len


class _Branchy(nn.Module):
    """Allocates a scratch tensor only past L = 100: traces at other lengths do not line up."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.out = nn.Linear(32, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        if ids.shape[1] > 100:
            x = x * torch.ones_like(x)
        return self.out(x)


class _Cubic(nn.Module):
    """Memory in L³ at each point: the six terms cannot hold it, and the held-out trace says so."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        cube = torch.ones(ids.shape[0], length, length, length).sum()
        return self.lin(torch.ones(ids.shape[0], length, 8)) + cube * 0


def _task(model: type[nn.Module], name: str) -> ProbeTask:
    def batch(m: int, seq_len: int) -> torch.Tensor:
        return torch.randint(0, 8, (m, seq_len))

    return ProbeTask(name=name, model=model, batch=batch)


@pytest.mark.parametrize(
    ("model", "why"), [(_Branchy, "do not line up"), (_Cubic, "does not predict the held-out trace")]
)
def test_where_the_surface_cannot_be_had_each_length_falls_back_to_its_own_pre_search(
    model: type[nn.Module], why: str
) -> None:
    task = _task(model, model.__name__)
    config = ProbeConfig(device="cpu", budget_bytes=4 * MiB, throughput=False)
    run = probe_lengths(task, config, [24, 64, 200])
    assert run.surface is None
    for profile in run.profiles:
        assert any("no surface over lengths" in w and why in w for w in profile.warnings), profile.warnings
    # Each length pre-searched on its own is what a single-length probe finds.
    longest = run.profiles[-1]
    assert longest.seq_len is not None
    assert longest.max_micro_batch == probe(task.at_length(longest.seq_len), config).max_micro_batch


def test_lengths_are_checked_in_one_line() -> None:
    seq_task = make_seq_task(SMALL)
    plain = ProbeTask(name="plain", model=lambda: nn.Linear(4, 4), batch=lambda m: torch.zeros(m, 4))
    with pytest.raises(TaskError, match=r"--seq-len 64: task 'plain' is not sequence-aware"):
        check_lengths(plain, [64])
    with pytest.raises(TaskError, match=r"sequence length 0 must be an integer"):
        check_lengths(seq_task, [64, 0])
    with pytest.raises(TaskError, match=r"sequence-aware: give the lengths"):
        check_lengths(seq_task, [])
    assert check_lengths(seq_task, [256, 64, 64]) == [64, 256]
    with pytest.raises(TaskError, match=r"--seq-len 8192: the model cannot take this length .*position table"):
        probe_lengths(seq_task, ProbeConfig(device="cpu", budget_bytes=64 * MiB, throughput=False), [64, 8192])


def test_a_token_target_is_planned_in_sequences_with_the_deviation_said() -> None:
    assert target_at_length(512, target_batch=None, target_tokens=65536, world_size=4) == (128, None)
    batch, note = target_at_length(1000, target_batch=None, target_tokens=65536, world_size=4)
    assert batch == 66 and note is not None and "65536 tokens is not a multiple of seq_len 1000" in note
    assert target_at_length(1000, target_batch=32, target_tokens=None, world_size=4) == (32, None)


def test_a_sequence_aware_fingerprint_leaves_the_length_out_and_the_client_agrees() -> None:
    from autotune.tasks.fingerprint import fingerprint_model, task_fingerprint

    task = make_seq_task(SMALL)
    assert task_fingerprint(task) == task_fingerprint(task.at_length(64)) == task_fingerprint(task.at_length(300))
    other = make_seq_task(GPTConfig(**{**SMALL.__dict__, "d_model": 64}))
    assert task_fingerprint(other) != task_fingerprint(task)
    # suggest(model, seq_len=L, example=...) computes this from the job's own batch:
    for length in (64, 300):
        example = task.batch(1, seq_len=length)
        job = fingerprint_model(task.model(), example, tags=task.tags, seq_len=length)
        assert job == task_fingerprint(task)


@pytest.mark.parametrize(("strategy", "world"), [("ddp", 1), ("fsdp", 2)])
def test_an_estimate_says_which_length_does_not_fit_and_diagnoses_a_run_where_none_does(
    strategy: str, world: int
) -> None:
    """The estimate runs on one fake model inside one held process group: a length where not even
    m = 1 fits is said in the others' profiles, and where no length fits the shortest one's
    diagnosis (fake trials of other setups, in groups of their own) still comes out."""
    from autotune.core.errors import CannotFitError
    from autotune.orchestrate.estimate import EstimateConfig

    task = make_seq_task(SMALL)
    config = EstimateConfig.of(budget_bytes=8 * MiB, device_kind="cpu", strategy=strategy, world_size=world)
    run = estimate_lengths(task, config, [64, 4096])
    assert [p.seq_len for p in run.profiles] == [64] and list(run.no_fit) == [4096]
    assert any("at seq_len 4096 not even micro-batch 1 fits" in w for w in run.profiles[0].warnings)
    if strategy == "fsdp":  # the diagnosis after a held fake process group (ddp holds none; 10 s)
        with pytest.raises(CannotFitError, match=r"^at seq_len 64: "):
            estimate_lengths(task, config.with_setup(budget_bytes=MiB // 8), [64, 128])


def test_a_probe_where_no_length_fits_gives_the_shortest_lengths_diagnosis() -> None:
    from autotune.core.errors import CannotFitError

    config = ProbeConfig(device="cpu", budget_bytes=MiB // 8, throughput=False)
    with pytest.raises(CannotFitError, match=r"^at seq_len 64: "):
        probe_lengths(make_seq_task(SMALL), config, [64, 128])
