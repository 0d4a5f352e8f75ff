"""Real ranks started warm: ``spawn`` is ``torch.multiprocessing.spawn`` with its processes forked from a
forkserver that has already imported torch, its distributed packages and autotune's trial modules.

A spawned rank is a fresh interpreter that imports all of that again: 2 s a rank on the 2-core machine, the
same again for every run a truth repeats. A forkserver's rank is as fresh (the server is a clean interpreter of
its own, started once per test process, never a fork of pytest's) and starts in 0.05 s. What it cannot see: an
environment variable set after the server started, which no rank's truth uses (they take their settings as
arguments).

    spawn(worker.run, args=(2, rendezvous, out), nprocs=2)
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

__all__ = ["FORKSERVER", "spawn", "spawn_or_fail"]

# What every rank imports; a module that fails to import here is left to the rank (forkserver skips it).
_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.fsdp",
    "torch.distributed.pipelining",
    "torch.nn.parallel",
    "torch._dynamo",
    "transformers",
    "autotune.measure.trial",
    "autotune.measure.strategies",
    "autotune.cli",
    # What the truths' models and the CLI's hf: tasks import on first use, 0.5-2 s each in every rank and every
    # forked command (measured over the lines above): transformers' lazy model modules, peft (which imports
    # bitsandbytes' and torchao's kinds), inductor and the low-bit optimizers.
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "peft",
    "bitsandbytes",
    "torchao.optim",
    "torch._inductor.compile_fx",
    "tests._forkserver_heap",  # last: freezes what the lines above imported
]
multiprocessing.set_forkserver_preload(_PRELOAD)

# For a ProcessPoolExecutor's mp_context.
FORKSERVER = multiprocessing.get_context("forkserver")


def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: int = 1, join: bool = True) -> Any:
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)``, each process forked from the warm server: the
    same ProcessException for a rank that failed, the same ``fn(rank, *args)``."""
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")


def spawn_or_fail(fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, out: Path) -> None:
    """:func:`spawn`, joined; a rank that failed fails the test in one message with every rank's traceback (the
    ``rank*.error`` files a truth's worker writes under ``out``)."""
    import pytest
    from torch.multiprocessing.spawn import ProcessException

    try:
        spawn(fn, args=args, nprocs=nprocs, join=True)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the {nprocs}-process job failed: {exc}\n{errors}")
