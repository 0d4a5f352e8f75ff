"""--cp: one rank of a context-parallel group measured in one process, against real processes on gloo.

The truth (tests/autotune/_cp_worker.py) shares no measuring code with the probe: the tiny Llama built the ordinary
way, DDP over both ranks (or FSDP2 over both, torchtitan's way), each micro-batch prepared as transformers' Trainer
prepares one and run under torch's context_parallel, each rank's peak the CPU allocator's own running total. The
one-process answer's m_max and m_max + 1 must agree with the most loaded rank, which must be the rank the probe
measures. Both run torch's ring attention on the CPU through install_cpu_flash_attention, whose results are checked
against plain SDPA here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from autotune.cli import main
from autotune.core.mesh import Mesh
from autotune.core.schemas import Strategy
from autotune.measure.context_parallel import MEASURED_RANK
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import CONFIGS, write_config
from tests.ranks import spawn_or_fail

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
    ),
    # FSDP2 over a tp-parallelized model warns that the root returns a view (the gathered logits), as the real job's
    # ranks do; no op of the trial writes into it.
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]

# Long enough that the activations, which cp splits, weigh against the weights, which it does not.
SEQ_LEN = 64
# The fake group's figures differ from the real ranks' by a few bytes (the probe reads 8 above under ddp, as under
# --tp: a scalar the probe holds and the ordinary loop does not; 16 below under fsdp); the limit is put between
# m_max and m_max + 1 far from that.
SLACK_BYTES = 64


def _cp_job(
    tmp_path_factory: pytest.TempPathFactory, inner: Strategy, ring: bool, tp: int = 1, optimizer: str | None = None
) -> dict[str, Any]:
    """The probe's answer at cp = 2 over inner (ddp, or fsdp over both ranks) and, in one spawn of 2 real processes
    (cp = 2), every rank's peak at m_max and m_max + 1 (one run each: tests/autotune/_ordered_gloo.py); with ring,
    then the ring's differences from plain SDPA under each rotation. ``optimizer``: a spec the real ranks build
    with the library's own class (tests/autotune/_ordinary_optimizers.py)."""
    from tests.autotune import _cp_worker

    tmp_path = tmp_path_factory.mktemp(f"cp_{inner}_tp{tp}")
    task = hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False)).at_length(SEQ_LEN)
    if optimizer is not None:
        task = dataclasses.replace(task, optimizer=optimizer)
    world_size = 2 * tp
    config = ProbeConfig(
        device="cpu",
        budget_bytes=1_500_000,
        headroom=0.0,
        strategy=inner,
        world_size=world_size,
        mesh=Mesh(cp=2, tp=tp),
    )
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    # A trial that crossed the budget stopped there: its figure is where it stopped, not its peak.
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake and not t.oom}
    # A size the probe stopped at the budget has no real figure: its fake trial's stands in (the estimate's test
    # asserts it against the real ranks).
    fake = _fake_peaks(task, inner, tp, (m_max, m_max + 1))  # also the estimate's test's figures
    worker_config: dict[str, Any] = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
    worker_config["tie_word_embeddings"] = False
    out = tmp_path / "truth"
    out.mkdir()
    args = (
        world_size,
        SEQ_LEN,
        str(out / "rendezvous"),
        str(out),
        worker_config,
        [m_max, m_max + 1],
        "allgather",
        ring,
        inner,
        tp,
        optimizer,
    )
    spawn_or_fail(_cp_worker.run, args, world_size, out)
    real = {int(m): ranks for m, ranks in json.loads((out / "peaks.json").read_text()).items()}
    found = json.loads((out / "ring.json").read_text()) if ring else None
    return {"inner": inner, "tp": tp, "measured": measured, "peaks": peaks, "fake": fake, "real": real, "ring": found}


def _fake_peaks(task: Any, inner: str, tp: int, sizes: tuple[int, ...]) -> dict[int, int]:
    """The job's fake trials (the CPU's semantics, no budget) at each size: what `autotune estimate` holds."""
    import torch

    from autotune.measure.context_parallel import ContextParallel
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.trial import TrialRunner

    strategy = ContextParallel(2 * tp, Mesh(cp=2, tp=tp), inner=inner)
    with strategy.process_group(torch.device("cpu")):
        runner = TrialRunner(task, FakeMeter(1 << 40, "cpu"), limit_bytes=1 << 40, strategy=strategy)
        try:
            return {m: runner(m).peak_bytes for m in sizes}
        finally:
            runner.close()


@pytest.fixture(scope="module")
def cp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cp 2 over ddp, with the ring's check in the same processes."""
    return _cp_job(tmp_path_factory, "ddp", ring=True)


@pytest.fixture(scope="module")
def cp_fsdp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cp 2 under FSDP2 over both ranks (the cp ranks' shared parameters sharded over them, torchtitan's way)."""
    return _cp_job(tmp_path_factory, "fsdp", ring=False)


@pytest.fixture(scope="module")
def cp_tp_fsdp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cp 2 x tp 2 (4 processes): each cp rank's model parallelized over 2 tp ranks by transformers' Llama plan,
    FSDP2 over the cp ranks (torchtitan's fsdp x tp x cp with one data-parallel replica)."""
    return _cp_job(tmp_path_factory, "fsdp", ring=False, tp=2)


@pytest.fixture(scope="module")
def cp_tp_ddp_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cp 2 x tp 2 over ddp (4 processes): each cp rank's model parallelized over 2 tp ranks by transformers' Llama
    plan, then torch's TP + DDP over the cp ranks (DistributedDataParallel(device_mesh=cp): each DTensor parameter
    made its local shard, so each gradient is the shard; the row-wise embedding's gradient, Replicate without DDP,
    read 16,384 B high before the probe kept it as its shard)."""
    return _cp_job(tmp_path_factory, "ddp", ring=False, tp=2)


@pytest.fixture(scope="module")
def cp_adamw4bit_job(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """cp 2 over ddp stepped by torchao's AdamW4bit (its step compiled per parameter: the probe's real trials on the
    allocator's own count, the estimate's fake ones eager)."""
    return _cp_job(tmp_path_factory, "ddp", ring=False, optimizer="adamw4bit")


JOBS = ["cp_job", "cp_fsdp_job", "cp_tp_fsdp_job", "cp_tp_ddp_job", "cp_adamw4bit_job"]


@pytest.mark.parametrize("job", JOBS)
def test_cp2_m_max_agrees_with_the_most_loaded_of_the_real_ranks(job: str, request: pytest.FixtureRequest) -> None:
    found: dict[str, Any] = request.getfixturevalue(job)
    measured, peaks, real = found["measured"], found["peaks"], found["real"]
    m_max = measured.max_micro_batch
    tp = found["tp"]
    assert measured.mesh == ({"cp": 2, "tp": tp} if tp > 1 else {"cp": 2}) and measured.strategy == found["inner"]
    label = f"cp 2{f' x tp {tp}' if tp > 1 else ''} ({found['inner']}, L={SEQ_LEN})"
    print(f"{label}: m_max {m_max}; probe {peaks}; real ranks' peaks {real}")
    # The rank the probe measures is the most loaded one (the head-tail balancer gives it the partial merges): cp
    # rank MEASURED_RANK, tp rank 0, global rank MEASURED_RANK x tp (tp innermost).
    assert all(ranks[MEASURED_RANK * tp] == max(ranks) for ranks in real.values())
    truth = {m: max(ranks) for m, ranks in real.items()}
    assert truth[m_max] <= measured.limit_bytes < truth[m_max + 1]
    assert abs(peaks[m_max] - truth[m_max]) <= SLACK_BYTES
    if m_max + 1 in peaks:
        assert abs(peaks[m_max + 1] - truth[m_max + 1]) <= SLACK_BYTES


@pytest.mark.parametrize("job", JOBS)
def test_the_fake_trials_of_an_estimate_equal_the_real_trials(job: str, request: pytest.FixtureRequest) -> None:
    """`autotune estimate`'s trials (fake tensors, the CPU's semantics) hold what the real trial holds: under ddp
    DDP's buckets without DDP (strategies.hold_ddp_buckets), under fsdp the shards over the flattened (dp, cp) mesh."""
    found: dict[str, Any] = request.getfixturevalue(job)
    measured, peaks, real, fake = found["measured"], found["peaks"], found["real"], found["fake"]
    m_max = measured.max_micro_batch
    print(f"cp 2 x tp {found['tp']} ({found['inner']}): fake {fake}; probe's real trials {peaks}")
    if job == "cp_adamw4bit_job":
        # The probe's real trials ran on the allocator's own count (torchao's compiled step) and equal the real
        # ranks to the byte; the fake meter counts storages as the CPU's dispatch meter does, with the few bytes
        # (8) that meter reads above the real ranks here (SLACK_BYTES above).
        assert peaks[m_max] == max(real[m_max])
        assert abs(fake[m_max] - peaks[m_max]) <= SLACK_BYTES
    else:
        assert fake[m_max] == peaks[m_max]
    truth = max(real[m_max + 1])
    assert abs(fake[m_max + 1] - truth) <= SLACK_BYTES


# An attention-heavy Llama: one block of 8 heads of 64 over a hidden size of 32, so that the peak is in the ring.
ATTENTION_HEAVY = {
    "tie_word_embeddings": False,
    "vocab_size": 32,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "intermediate_size": 32,
    "max_position_embeddings": 1024,
}


def test_the_rings_own_buffers_are_counted_under_each_rotation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's ring runs inside a DTensor handler, where the meter's mode is off: counted only because the CPU rules
    re-enter it. The allgather rotation holds the whole sequence's key and value at once, alltoall one shard."""
    from autotune.measure.context_parallel import ContextParallel

    task = hf_task(write_config(tmp_path, "llama", **ATTENTION_HEAVY)).at_length(256)
    peaks = {}
    for rotation in ("allgather", "alltoall"):
        monkeypatch.setitem(ContextParallel.__init__.__kwdefaults__, "rotation", rotation)  # type: ignore[arg-type]
        config = ProbeConfig(
            device="cpu", budget_bytes=28_500_000, headroom=0.0, strategy="ddp", world_size=2, mesh=Mesh(cp=2)
        )
        measured = probe(task, config)
        peaks[rotation] = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake and not t.oom}
    m = 4
    key_value_bytes = m * 8 * (256 // 2) * 64 * 4 * 2  # one rank's key and value shards, fp32
    # allgather holds cp = 2 shards of each where alltoall holds one arriving shard: the difference is one shard.
    assert peaks["allgather"][m] - peaks["alltoall"][m] == key_value_bytes, peaks


def test_torchs_ring_attention_on_the_cpu_kernel_equals_plain_sdpa(cp_job: dict[str, Any]) -> None:
    differences = cp_job["ring"]  # checked in the truth's processes (tests/autotune/_cp_worker.py)
    assert set(differences) == {"allgather", "alltoall"}
    for rotation, (out, grad_q, grad_k, grad_v) in differences.items():
        assert max(out, grad_q, grad_k, grad_v) < 1e-5, (rotation, differences[rotation])


@pytest.mark.parametrize(
    ("target", "flags", "line"),
    [
        # Refused by the composition table (issue 62, item 6): at parse time for the length, once the task is loaded
        # for the model, before any trial.
        (
            "llama",
            ["--seq-len", "15", "--cp", "2", "--world-size", "2"],
            "--cp 2 at --seq-len 15: context parallelism splits each sequence over the cp ranks: --cp must divide "
            "every length",
        ),
        (
            "gpt",
            ["--cp", "2", "--world-size", "2"],
            "--cp 2 on the model of gpt-small: torch's context parallelism is measured for hf: causal LMs",
        ),
    ],
)
def test_a_job_cp_cannot_take_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, flags: list[str], line: str
) -> None:
    output = tmp_path / "profile.json"
    task = f"hf:{write_config(tmp_path, 'llama')}" if target == "llama" else "examples/gpt.py"
    code = main(["probe", task, *flags, "--device", "cpu", "--budget", "1MiB", "--output", str(output)])
    stderr = capsys.readouterr().err
    errors = [text for text in stderr.splitlines() if text.startswith("autotune: error:")]
    assert code == 2 and len(errors) == 1 and line in errors[0], stderr[-2000:]
    assert not output.exists()
