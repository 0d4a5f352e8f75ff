"""--tp-plan: a tensor-parallel plan by name (autotune/tasks/tp_plan.py), torchtitan's resolved for a family's module
names, its setup carried to the processes that load the task, its fake trials equal to its real ones, and the bad
input refused in one line. The truth against real ranks is tests/autotune/test_tensor_parallel.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.core.mesh import Mesh
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.orchestrate.lengths import _longest
from autotune.search.presearch import surface_points
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.hf import hf_task
from autotune.tasks.load import load_task
from autotune.tasks.tp_plan import sequence_multiple, tp_plan_of
from tests.autotune._hf_configs import write_config, write_head_config
from tests.autotune._tp_trials import LIMIT_BYTES, tp_peaks

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


def _llama(tmp_path: Path) -> Path:
    return write_config(tmp_path, "llama", tie_word_embeddings=False)


def test_torchtitans_plan_names_the_llama_familys_modules(tmp_path: Path) -> None:
    task = dataclasses.replace(hf_task(_llama(tmp_path)), tp_plan="torchtitan")
    model = task.model()
    plan = tp_plan_of(model, task)
    assert plan is not None
    names = {name for name, _ in model.named_modules()}
    # Every pattern names a module of the model (a star for the block's index).
    for pattern in plan:
        assert pattern.replace("*", "0") in names, pattern
    assert plan["model.embed_tokens"] == "embedding_rowwise_sequence"
    assert plan["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert plan["model.layers.*.self_attn"] == "gather_sequence"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise_sequence"
    assert plan["lm_head"] == "colwise_loss_parallel"
    # hf: transformers' own plan (no sequence parallel), as with no name.
    assert tp_plan_of(model, dataclasses.replace(task, tp_plan="hf")) == tp_plan_of(model, hf_task(_llama(tmp_path)))


def test_a_family_it_has_no_names_for_is_one_line(tmp_path: Path) -> None:
    task = dataclasses.replace(hf_task(write_head_config(tmp_path, "bert-mlm")), tp_plan="torchtitan")
    with pytest.raises(TaskError, match=r"--tp-plan torchtitan: no module names of model type 'bert'"):
        tp_plan_of(task.model(), task)
    with pytest.raises(TaskError, match="not a plan's name"):
        dataclasses.replace(task, tp_plan="megatron")


def test_the_plans_name_enters_the_fingerprint_and_the_setup_a_worker_receives(tmp_path: Path) -> None:
    spec = f"hf:{_llama(tmp_path)}"
    task = load_task(spec).at_length(16)
    titan = dataclasses.replace(task, tp_plan="torchtitan")
    mesh = Mesh(tp=2)
    fingerprints = {
        task_fingerprint(task, world_size=2, mesh=mesh),
        task_fingerprint(titan, world_size=2, mesh=mesh),
        task_fingerprint(dataclasses.replace(task, tp_plan="hf"), world_size=2, mesh=mesh),
    }
    assert len(fingerprints) == 2  # hf is the default plan: the same setup as no name
    # What a worker or the emulated child receives (JobSetup) and applies to the task it loads from the spec.
    job = titan.job_setup(world_size=2, mesh=mesh)
    assert job.tp_plan_name == "torchtitan"
    loaded = load_task(spec).at_length(16).with_setup(job)
    assert loaded.tp_plan == "torchtitan" and loaded.tags["tp_plan"] == "torchtitan"
    assert task_fingerprint(loaded, world_size=2, mesh=mesh) == task_fingerprint(titan, world_size=2, mesh=mesh)


def test_a_client_naming_the_plan_finds_the_probes_fingerprint(tmp_path: Path) -> None:
    """suggest(..., mesh="tp=2", tp_plan="torchtitan") asks for the fingerprint the probe stored under --tp-plan
    torchtitan (without the name, transformers' plan's: another setup)."""
    from autotune_client import AutotuneClientError
    from autotune_client._suggest import job_fingerprint

    task = load_task(f"hf:{_llama(tmp_path)}").at_length(16)
    titan = dataclasses.replace(task, tp_plan="torchtitan")
    model = task.model()
    probed = task_fingerprint(titan, world_size=2, mesh=Mesh(tp=2))
    asked = {
        plan: job_fingerprint(
            model, example=task.batch, tags=task.tags, seq_len=16, world_size=2, mesh="tp=2", tp_plan=plan
        )
        for plan in ("torchtitan", None)
    }
    assert asked["torchtitan"] == probed
    assert asked[None] == task_fingerprint(task, world_size=2, mesh=Mesh(tp=2)) != probed
    with pytest.raises(AutotuneClientError, match="not a plan's name"):
        job_fingerprint(model, example=task.batch, world_size=2, mesh="tp=2", tp_plan="megatron")


def _mixtral(tmp_path: Path) -> Path:
    from tests.autotune.test_tp_moe import CONFIG

    where = tmp_path / "mixtral"
    where.mkdir()
    (where / "config.json").write_text(json.dumps({"model_type": "mixtral", **CONFIG}))
    return where


def test_gpt2s_plan_shards_its_conv1d_layers_and_keeps_the_head_tied(tmp_path: Path) -> None:
    """GPT-2 under torchtitan's plan (Conv1D styles of its own, autotune/measure/tensor_parallel.py): each rank holds
    the hand count of its parameters from the config alone, and the LM head is still the token embedding's weight."""
    from torch.distributed.tensor import DTensor

    from autotune.measure.strategies import TensorParallel

    task = dataclasses.replace(hf_task(write_config(tmp_path, "gpt2")).at_length(16), tp_plan="torchtitan")
    plan = tp_plan_of(task.model(), task)
    assert plan is not None and plan["transformer.h.*.attn.c_attn"] == "conv1d_packed_colwise"
    strategy = TensorParallel(2, Mesh(tp=2), inner="ddp")
    with strategy.process_group(torch.device("cpu")):
        model = strategy.wrap(task.model(), task, torch.device("cpu"))
        local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
        assert model.lm_head.weight is model.transformer.wte.weight
    c = model.config
    width, vocab, positions, blocks = c.n_embd, c.vocab_size, c.n_positions, c.n_layer
    # Per block: two norms whole, q/k/v packed column-wise (weight and bias halves), its c_proj row-wise (half the
    # weight, the bias whole), the MLP's c_fc column-wise and c_proj row-wise (4 x width inside).
    block = 2 * 2 * width
    block += width * 3 * width // 2 + 3 * width // 2 + width // 2 * width + width
    block += width * 4 * width // 2 + 4 * width // 2 + 4 * width // 2 * width + width
    assert local == vocab * width // 2 + positions * width // 2 + blocks * block + 2 * width  # + ln_f; head tied


@pytest.mark.parametrize(
    ("family", "inner", "world_size"),
    [("llama", "ddp", 2), ("llama", "fsdp", 4), ("mixtral", "ddp", 2), ("gpt2", "ddp", 2)],
)
# GPT-2's dropout on the DTensor residual stream: DTensor's RNG tracker has no CPU mesh (the job on a card has one).
@pytest.mark.filterwarnings("ignore:DTensor random operators may not have complete support on cpu")
def test_fake_trials_equal_the_real_ones_under_sequence_and_loss_parallel(
    tmp_path: Path, family: str, inner: str, world_size: int
) -> None:
    """An estimate's fake trials hold what the real trials hold (which test_tensor_parallel checks against real
    ranks): the loss's handlers counted in both, their global-shape derivation in neither, nor (Mixtral) the fake
    meter's rerun of the loss on its routing values; under fsdp the model is known fake by its DTensors' local
    shards (every parameter is a DTensor under this plan)."""
    where = {"llama": _llama, "mixtral": _mixtral}.get(family, lambda path: write_config(path, family))(tmp_path)
    task = dataclasses.replace(hf_task(where).at_length(16), tp_plan="torchtitan")
    real = tp_peaks(CpuMeter(LIMIT_BYTES), task, inner, world_size, (3, 4))
    fake = tp_peaks(FakeMeter(LIMIT_BYTES, device_type="cpu"), task, inner, world_size, (3, 4))
    print(f"torchtitan tp 2 {family} ({inner} x{world_size}): real {real}, fake {fake}")
    assert fake == real


def test_lengths_under_sequence_parallel_are_multiples_of_tp(tmp_path: Path) -> None:
    titan = dataclasses.replace(hf_task(_llama(tmp_path)), tp_plan="torchtitan")
    assert sequence_multiple(titan, 4) == 4 and sequence_multiple(titan, 1) == 1
    assert sequence_multiple(hf_task(_llama(tmp_path)), 4) == 1
    _, traced, (_, held) = surface_points([64], 1, length_step=8)
    assert all(length % 8 == 0 for length in (*traced, held)), (traced, held)

    tried: list[int] = []

    class Surface:  # a peak that grows with the length: 100 bytes a token
        def longest_fitting(self, limit: int, micro_batch: int, *, cap: int, shortest: int) -> int:
            return min(cap, limit // 100)

        def peak_bytes(self, micro_batch: int, seq_len: int) -> int:
            return 100 * seq_len

    def trial_at(seq_len: int) -> object:
        tried.append(seq_len)
        peak = 100 * seq_len
        return type("T", (), {"oom": False, "fits": peak <= 5_000, "peak_bytes": peak, "host_peak_bytes": None})()

    found = _longest(Surface(), trial_at, limit_bytes=5_000, micro_batch=1, shortest=8, cap=63, step=8)  # type: ignore[arg-type]
    assert found is not None and found.seq_len == 48  # 50 tokens fit: the longest multiple of 8 is 48
    assert all(length % 8 == 0 for length in tried), tried


def _cli(capsys: pytest.CaptureFixture[str], *args: str, output: Path) -> tuple[int, str, str]:
    """autotune probe in this process (its one-line errors and exit codes are main's): code, stdout, stderr."""
    code = main(["probe", *args, "--device", "cpu", "--budget", "1MiB", "--output", str(output)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (["--tp-plan", "torchtitan"], "--tp-plan torchtitan is the plan of tensor parallelism: give --tp N"),
        (
            ["--tp", "2", "--world-size", "2", "--tp-plan", "torchtitan", "--seq-len", "15"],
            "--tp-plan torchtitan shards the sequence over the 2 tp ranks (sequence parallel): --seq-len 15 is not "
            "a multiple of --tp 2",
        ),
        (
            ["--tp", "2", "--world-size", "2", "--tp-plan", "torchtitan", "--seq-len", "16", "bert"],
            "--tp-plan torchtitan on the model of bert-",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_nothing_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], line: str
) -> None:
    config = write_head_config(tmp_path, "bert-mlm") if flags[-1] == "bert" else _llama(tmp_path)
    flags = [flag for flag in flags if flag != "bert"]
    output = tmp_path / "profile.json"
    code, _, err = _cli(capsys, f"hf:{config}", *flags, output=output)
    errors = [text for text in err.splitlines() if text.startswith("autotune: error:")]
    assert code == 2 and len(errors) == 1, err[-2000:]
    assert line in errors[0]
    assert "Traceback" not in err
    assert not output.exists()


def test_the_datasheet_names_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "profile.json"
    code, out, err = _cli(
        capsys,
        f"hf:{_llama(tmp_path)}",
        *("--tp", "2", "--world-size", "2", "--tp-plan", "torchtitan", "--seq-len", "16", "--no-breakdown"),
        *("--max-seq-len", "16"),  # the longest-length search is test_lengths_under_sequence_parallel_...'s
        output=output,
    )
    assert code == 0, err[-2000:]
    assert "tp 2, torchtitan's tp plan (sequence and loss parallel)" in out
    stored = json.loads(output.read_text())
    profiles = stored if isinstance(stored, list) else [stored]
    assert all(p["tags"]["tp_plan"] == "torchtitan" for p in profiles)
