"""--cp: one rank of a context-parallel group measured in one process, against real processes on gloo.

The truth (tests/autotune/_cp_worker.py) shares no measuring code with the probe: the tiny Llama built the ordinary
way, DDP over both ranks, each micro-batch prepared as transformers' Trainer prepares one and run under torch's
context_parallel, each rank's peak the CPU allocator's own running total. The one-process answer's m_max and
m_max + 1 must agree with the most loaded rank, which must be the rank the probe measures. Both run torch's ring
attention on the CPU through install_cpu_flash_attention, whose results are checked against plain SDPA here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from autotune.core.mesh import Mesh
from autotune.measure.context_parallel import MEASURED_RANK
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import CONFIGS, write_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

# Long enough that the activations, which cp splits, weigh against the weights, which it does not.
SEQ_LEN = 64
# The fake group's figures differ from the real ranks' by 8 bytes (as under --tp: a scalar the probe holds and
# the ordinary loop does not); the limit is put between m_max and m_max + 1 far from that.
SLACK_BYTES = 64


def _spawn(target: Any, args: tuple[Any, ...], out: Path) -> None:
    try:
        mp.spawn(target, args=args, nprocs=2, join=True)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the 2-process job failed: {exc}\n{errors}")


def _truth(floors: dict[int, int], tmp_path: Path) -> dict[int, list[list[int]]]:
    """Each run's per-rank peaks at each size, over 2 real processes (cp = 2), until the most loaded rank is at or
    below the size's floor (the probe's figure; a huge one for one run)."""
    from tests.autotune import _cp_worker

    config: dict[str, Any] = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
    config["tie_word_embeddings"] = False
    out = tmp_path / "truth"
    out.mkdir()
    _spawn(_cp_worker.run, (2, SEQ_LEN, str(out / "rendezvous"), str(out), config, floors), out)
    return {int(m): runs for m, runs in json.loads((out / "runs.json").read_text()).items()}


def test_cp2_m_max_agrees_with_the_most_loaded_of_the_real_ranks(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False)).at_length(SEQ_LEN)
    config = ProbeConfig(
        device="cpu", budget_bytes=1_500_000, headroom=0.0, strategy="ddp", world_size=2, mesh=Mesh(cp=2)
    )
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert measured.mesh == {"cp": 2}
    # A trial that crossed the budget stopped there: its figure is where it stopped, not its peak.
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake and not t.oom}
    runs = _truth({m_max: peaks[m_max], m_max + 1: peaks.get(m_max + 1, 1 << 62)}, tmp_path)
    print(f"cp 2 (ddp x2, L={SEQ_LEN}): m_max {m_max}; probe {peaks}; real ranks' peaks, runs {runs}")
    floor = {m: min(figures, key=max) for m, figures in runs.items()}  # the run whose most loaded rank is lowest
    # The rank the probe measures is the most loaded one (the head-tail balancer gives it the partial merges).
    assert all(ranks.index(max(ranks)) == MEASURED_RANK for ranks in floor.values())
    truth = {m: max(ranks) for m, ranks in floor.items()}
    assert truth[m_max] <= measured.limit_bytes < truth[m_max + 1]
    assert abs(peaks[m_max] - truth[m_max]) <= SLACK_BYTES
    if m_max + 1 in peaks:
        assert abs(peaks[m_max + 1] - truth[m_max + 1]) <= SLACK_BYTES


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


def test_torchs_ring_attention_on_the_cpu_kernel_equals_plain_sdpa(tmp_path: Path) -> None:
    from tests.autotune import _cp_worker

    _spawn(_cp_worker.check_ring, (2, str(tmp_path / "rendezvous"), str(tmp_path)), tmp_path)
    differences = json.loads((tmp_path / "ring.json").read_text())
    assert set(differences) == {"allgather", "alltoall"}
    for rotation, (out, grad_q, grad_k, grad_v) in differences.items():
        assert max(out, grad_q, grad_k, grad_v) < 1e-5, (rotation, differences[rotation])


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", "probe", *args, "--device", "cpu", "--budget", "1MiB"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.parametrize(
    ("target", "flags", "line"),
    [
        ("llama", ["--seq-len", "15", "--cp", "2", "--world-size", "2"], "--cp 2 does not divide the sequence length"),
        ("gpt", ["--cp", "2", "--world-size", "2"], "context parallelism is measured for hf: causal LMs"),
    ],
)
def test_a_job_cp_cannot_take_is_one_line_and_exit_2(tmp_path: Path, target: str, flags: list[str], line: str) -> None:
    output = tmp_path / "profile.json"
    task = f"hf:{write_config(tmp_path, 'llama')}" if target == "llama" else "examples/gpt.py"
    done = _cli(task, *flags, "--output", str(output))
    errors = [text for text in done.stderr.splitlines() if text.startswith("autotune: error:")]
    assert done.returncode == 2 and len(errors) == 1 and line in errors[0], done.stderr[-2000:]
    assert not output.exists()
