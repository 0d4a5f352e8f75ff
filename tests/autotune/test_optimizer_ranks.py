"""The optimizer specs under ``--world-size 2``: each option's m_max against rank 0 of two real gloo processes
(tests/autotune/_fsdp_mp_truth.py), the tiny GPT wrapped the ordinary way (FSDP2's ``fully_shard``, or
DistributedDataParallel with ``no_sync`` on the first micro-batch) and stepped by the optimizer as torch or the
library builds it (tests/autotune/_ordinary_optimizers.py), the peak counted by the CPU allocator itself, every
thread's frees in it: at m_max and m_max + 1, byte for byte, one run per size (gloo's thread used to free a
collective's input after the main thread's next allocation, one run in three or four 12,672 to 35,968 bytes more
under fsdp; the truth removes it at its cause, tests/autotune/_ordered_gloo.py).

adamw8bit under fsdp is refused (bitsandbytes' update ops have no DTensor sharding rule: the ordinary FSDP2 job
fails at its first step too, as the last test shows)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.core.mesh import Mesh
from autotune.orchestrate.config import EstimateConfig
from autotune.orchestrate.estimate import estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from examples.gpt import GPT, Block, GPTConfig, make_task
from tests.autotune import _fsdp_mp_truth
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._fsdp_mp_truth import Job
from tests.autotune._hf_configs import write_config
from tests.autotune._ordinary_optimizers import ORDINARY
from tests.ranks import spawn

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

MiB = 1 << 20
TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=1)  # one block: a trial costs its ops
WORLD_SIZE = 2


CASES = [
    ("torch.optim.AdamW:foreach=false", "fsdp"),
    ("torch.optim.AdamW:fused=true", "fsdp"),
    ("torch.optim.AdamW:foreach=false", "ddp"),
    ("torch.optim.AdamW:fused=true", "ddp"),
    ("adamw8bit", "ddp"),
    # torchao's compiled step over ddp replicas and fsdp shards (each rank compiles its own; the probe's real trials
    # too).
    ("adamw4bit", "ddp"),
    ("adamw4bit", "fsdp"),
]


def real_rank0_peaks(job: Job, sizes: list[int], out: Path) -> dict[int, int]:
    """Rank 0's peaks of one job in two fresh processes (one job per spawn: _fsdp_mp_truth._run says why)."""
    out.mkdir()
    try:
        spawn(_fsdp_mp_truth.run, args=(WORLD_SIZE, str(out / "rendezvous"), str(out), sizes, job), nprocs=2)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the {WORLD_SIZE}-process job failed: {exc}\n{errors}")
    print(f"rank 0's runs per size: {json.loads((out / 'rank0.runs.json').read_text())}")
    return {int(m): peak for m, peak in json.loads((out / "rank0.json").read_text()).items()}


@pytest.mark.parametrize(("spec", "strategy"), CASES)
def test_each_option_is_exact_against_two_real_ranks_at_m_max_and_past_it(
    spec: str, strategy: Literal["ddp", "fsdp"], tmp_path: Path
) -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), optimizer=spec)
    config = ProbeConfig(device="cpu", budget_bytes=MiB, target_batch=64, strategy=strategy, world_size=WORLD_SIZE)
    profile = probe(task, config)
    m_max = profile.max_micro_batch
    peaks = {t.micro_batch: t.peak_bytes for t in profile.trials if not t.fake}
    assert m_max + 1 in peaks, f"the probe measured no real trial past its m_max {m_max}"
    job = Job(optimizer=spec, precision="fp32", gpt_config=dataclasses.asdict(TINY), strategy=strategy)
    real = real_rank0_peaks(job, [m_max, m_max + 1], tmp_path / "truth")
    print(f"{strategy} x2 {spec}: m_max {m_max}; probe {peaks[m_max]}, {peaks.get(m_max + 1)}; real rank 0 {real}")
    assert (peaks[m_max], peaks[m_max + 1]) == (real[m_max], real[m_max + 1])
    assert real[m_max] <= profile.limit_bytes < real[m_max + 1]
    # The estimate's fake trials too: under ddp they hold DDP's gradient buckets without DDP (FakeReplicas), which
    # they used to leave out (a gradient set low).
    estimated = estimate(task, EstimateConfig(probe=config, device_kind="cpu", micro_batches=(m_max, m_max + 1)))
    fake = {t.micro_batch: t.peak_bytes for t in estimated.trials}
    assert (estimated.max_micro_batch, fake[m_max], fake[m_max + 1]) == (m_max, real[m_max], real[m_max + 1])
    assert not any("DDP's gradient buckets" in w for w in estimated.warnings)


def test_adamw8bit_under_fsdp_fails_in_the_ordinary_job_and_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # The ordinary FSDP2 job (fully_shard, bitsandbytes' own AdamW8bit; rank 0 of a fake group of 2) fails at
    # its first step: bitsandbytes' ops have no DTensor rule.
    ordinary = SimpleNamespace(
        model=lambda: GPT(TINY),
        batch=make_task(TINY).batch,
        compute_loss=make_task(TINY).compute_loss,
        shard_classes=(Block,),
        make_optimizer=ORDINARY["adamw8bit"],
    )
    with pytest.raises(NotImplementedError, match="bitsandbytes.optimizer_update.*sharding strategy"):
        allocator_peak_bytes(ordinary, 2, world_size=2)
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), optimizer="adamw8bit")
    sharded: list[tuple[Literal["ddp", "fsdp"], int, str]] = [("fsdp", 1, "--strategy fsdp"), ("ddp", 2, "--tp 2")]
    for strategy, tp, flag in sharded:
        config = ProbeConfig(device="cpu", budget_bytes=MiB, strategy=strategy, world_size=2, mesh=Mesh(tp=tp))
        with pytest.raises(TaskError) as caught:
            probe(task, config)
        message = str(caught.value)
        assert (
            message.startswith(f"--optimizer adamw8bit under {flag}: bitsandbytes' update ops") and "\n" not in message
        )
    hf = f"hf:{write_config(tmp_path, 'llama')}"
    argv = ["probe", hf, "--device", "cpu", "--budget", "8MiB", "--seq-len", "16", "--strategy", "fsdp"]
    code = main([*argv, "--world-size", "2", "--optimizer", "adamw8bit", "--output", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing stored
    assert "Traceback" not in err and any(
        "--optimizer adamw8bit under --strategy fsdp" in line for line in err.splitlines()
    )
