"""Real gloo collectives with gloo's releases in program order: how the real-rank truths read one peak, every run.

Why a real job's peak varied on gloo (12-74 KB above a floor, about one run in three): ProcessGroupGloo runs each
collective on a worker thread, which holds the work (the collective's input and output tensors) until the end of
its loop, after it has marked the work complete. The rank's main thread, woken by the completion, goes on. Where
the job has already let go of the collective's input (FSDP2's all-gather input and its reduce-scatter's unsharded
gradients, funcol's copies under DTensor), the worker thread's release is the free, and whether it lands before or
after the main thread's next allocations was the scheduler's choice. The truths used to run each size until the
most loaded rank read at or below the probe's figure; a test that can fail one run in N is a defect.

What this does, without changing what the job allocates or when it lets go of anything:
- ``one_thread_groups()``: every gloo group the rank makes after it (the world and each device-mesh dimension's) has
  one worker thread (gloo's own ``threads`` option, 2 by default);
- ``collectives_in_order()``: a dispatch mode that waits on each collective as it is issued, then fences its group:
  a one-element all-reduce on the group's backend, which runs on that group's only worker thread after the
  collective's loop has ended, so when it completes gloo holds none of the collective's tensors: each is freed where
  the job lets go of it, on the main thread, as if gloo had released it with the completion. (gloo's barrier would
  not do: it keeps the work still in progress as its prior work and lets go of it late itself.)
It sees c10d's ops (``torch.distributed``'s calls, FSDP2's all-gathers and reduce-scatters, DDP's all-reduce) and
funcol's (DTensor's tp and cp). Point-to-point sends and receives (a pipeline's) are left alone: a receive's buffer
and a send's input are the caller's until it waits, and waiting at issue would deadlock two stages' batched
sends and receives.
A truth also runs once at m = 1 before it measures: the first step makes one-time allocations (peft's and DTensor's
caches, 144 bytes under LoRA; torchao's compiled step) that a warm process, as the probe measures, does not.

Measured: the tp truth at tp 2, m 3, 48 runs over two ranks: 608,316 bytes every run (the old way: 608,316, and
633,676 in 3 runs of 24); at m 4, 24 runs: 711,548 every run (the old way: 745,364 once in 12); under dp 2 x tp 2,
with FSDP2: 502,972 every run (the old way: 503,220 once in 16).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

_Gloo = dist.ProcessGroupGloo

# funcol's own bookkeeping: no collective of its own.
_FUNCOL_BOOKKEEPING = frozenset({"wait_tensor", "_wrap_tensor_autograd", "_unwrap_tensor_autograd"})
_NOT_COLLECTIVES = frozenset({"send", "recv_", "recv_any_source_", "barrier", "monitored_barrier_"})


class _OneThreadGloo(_Gloo):  # type: ignore[misc]
    """ProcessGroupGloo made as distributed_c10d makes it (store, rank, size, timeout), with one worker thread."""

    def __init__(self, store: Any, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)) -> None:
        options = _Gloo._Options()
        options._devices = [_Gloo.create_default_device()]
        options._threads = 1
        options._timeout = timeout
        super().__init__(store, rank, size, options)


def one_thread_groups() -> None:
    """Every gloo group this process makes from now on has one worker thread (distributed_c10d builds gloo through
    this name). For a rank's own process: a truth's ranks make no group of another kind."""
    c10d.ProcessGroupGloo = _OneThreadGloo  # type: ignore[misc]


def _argument(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[[argument.name for argument in func._schema.arguments].index(name)]


# The fence's own tensor, made once at import (before any profiled run) and never freed: gloo's thread may let go of it
# late without a free.
_FENCE = torch.zeros(1)


def _fence(group: Any) -> None:
    """A one-element all-reduce on group's gloo backend, waited: it runs on the group's only worker thread after the
    collective's loop has ended. Not a barrier: gloo's barrier holds the work still in progress as its prior work and
    would let go of it late itself; and the process group's own calls allocate a tensor for their op."""
    group._get_backend(torch.device("cpu")).allreduce([_FENCE]).wait()


class collectives_in_order(TorchDispatchMode):  # noqa: N801 (used as a context manager, named as one)
    """Each collective waited at once, then its group fenced by _fence (the module's docstring says why)."""

    def __torch_dispatch__(
        self, func: Any, types: tuple[type, ...], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        kwargs = kwargs or {}
        if any(t not in (torch.Tensor, torch.nn.Parameter) and not issubclass(t, FakeTensor) for t in types):
            # A tensor subclass (DTensor, funcol's AsyncCollectiveTensor) dispatches itself with this mode still on,
            # so the collectives it issues come back here as plain tensors' ops.
            return NotImplemented
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[1]
        if func.namespace == "c10d" and name not in _NOT_COLLECTIVES:
            work = out[-1] if isinstance(out, tuple | list) else out
            dist.Work.unbox(work).wait()
            _fence(dist.ProcessGroup.unbox(_argument(func, args, kwargs, "process_group")))
        elif func.namespace == "_c10d_functional" and name not in _FUNCOL_BOOKKEEPING:
            for tensor in out if isinstance(out, tuple | list) else [out]:
                torch.ops._c10d_functional.wait_tensor(tensor)
            _fence(c10d._resolve_process_group(_argument(func, args, kwargs, "group_name")))
        return out


@contextmanager
def compiled_waits_fenced(group: Any) -> Iterator[None]:
    """Within: each wait on a collective in a compiled graph followed by a fence of ``group`` (:func:`_fence`), for the
    collectives a compiled block issues itself (tp's, traced into its graph), which run outside any dispatch mode.
    Inductor's code calls ``torch.ops._c10d_functional.wait_tensor.default`` by name at each run, so the packet's
    ``default`` is swapped for a waiting-then-fencing call; only around runs that compile nothing (the lowering of a
    graph compiled within would find a function where it looks for the op)."""
    packet = torch.ops._c10d_functional.wait_tensor
    wait = packet.default

    def fenced(tensor: torch.Tensor) -> torch.Tensor:
        out = wait(tensor)
        _fence(group)
        return out

    packet.default = fenced
    try:
        yield
    finally:
        packet.default = wait


def warmed_up(steps: Callable[[], None]) -> None:
    """The job run once before it is measured, collectives in order as in the measured runs, without the profiler (whose
    recording of every op and allocation is most of a tiny job's time): the first step's one-time allocations (peft's
    and DTensor's caches, torchao's compiled step, a pipeline's schedule) are made here, not in the first measured
    run."""
    with collectives_in_order():
        steps()
