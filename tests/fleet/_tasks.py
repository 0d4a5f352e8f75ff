"""Test-only ProbeTasks for the fleet's fault tests (loaded by Ray workers from their spec).

Each misbehaves on purpose, steered by files in ``$AUTOTUNE_FLEET_TEST_DIR`` (the test's Ray cluster
and its workers have it in their environment), so that a fault happens once and deterministically:

- ``killed_once``: the worker process SIGKILLs itself at the first trial above m=1 on its first
  attempt (a marker file remembers it), so Ray retries the task and the second attempt finishes.
- ``broken``: every forward raises a ValueError (not an OOM), so the probe stops with a TrialError.
- ``slow``: every micro-batch writes ``slow-started-<pid>`` and then sleeps, long enough for the test
  to interrupt the fleet; a probe that ever got past it would write ``slow-finished-<pid>``.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from autotune.tasks.task import ProbeTask

SLOW_SECONDS = 120.0


def marker_dir() -> Path:
    return Path(os.environ["AUTOTUNE_FLEET_TEST_DIR"])


class Small(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Broken(Small):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("broken on purpose: this model has no forward")


def _inputs(micro_batch: int) -> torch.Tensor:
    return torch.randn(micro_batch, 256, generator=torch.Generator().manual_seed(0))


def _killing_batch(micro_batch: int) -> torch.Tensor:
    marker = marker_dir() / "killed_once.marker"
    if micro_batch > 1 and not marker.exists():
        marker.write_text(str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)  # the worker dies mid-probe, as on a lost node
    return _inputs(micro_batch)


def _slow_batch(micro_batch: int) -> torch.Tensor:
    pid = os.getpid()
    (marker_dir() / f"slow-started-{pid}").write_text(str(pid))
    time.sleep(SLOW_SECONDS)
    (marker_dir() / f"slow-finished-{pid}").write_text(str(pid))
    return _inputs(micro_batch)


killed_once = ProbeTask(name="fleet-killed-once", model=Small, batch=_killing_batch)
broken = ProbeTask(name="fleet-broken", model=Broken, batch=_inputs)
slow = ProbeTask(name="fleet-slow", model=Small, batch=_slow_batch)


def tiny_seq() -> ProbeTask:
    """A sequence-aware GPT small enough for a fleet test over lengths (``--seq-len``)."""
    from examples.gpt import GPTConfig, make_seq_task

    return make_seq_task(GPTConfig(seq_len=4096, d_model=32, n_heads=2, n_layers=2), name="tiny-seq")
