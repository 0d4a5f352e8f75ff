"""A real gloo rank's count made deterministic: each of FSDP2's collectives returns only once gloo has let go of its
buffers, so every buffer is freed where the job's own code drops it.

Why: gloo runs a collective on a worker thread of its own, which holds the collective's work (and through it the
input and output tensors) until it has signalled completion and taken its queue's lock again. The job's thread,
woken by the signal, may run on and allocate before that thread lets go; under load (another test's processes on
the same two cores) the buffer is then freed late and a peak holds it beside what the job allocated next. Seen in a
whole run: rank 0 of the FSDP2 truth read 7,718,524 bytes where every other run (and the fake group) reads
7,518,588: 199,936 more, one block's all-gather output (49,984 fp32 parameters) still held by gloo while the
block's unsharded parameters were allocated. A card has no such thread: NCCL's kernels are stream-ordered and the
caching allocator frees a block where the program drops it. Repeating a run until it reads low would hide that
race one run in N; waiting for gloo to let go removes it.

How: FSDP2 calls ``torch.distributed.all_gather_single`` and ``reduce_scatter_single`` (its default collectives in
torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py). While :func:`collectives_released` is entered they run,
are waited on, and return after their tensors and storages are back to the use counts they had before the call (the
work and gloo's views of them gone). An async all-gather then returns no work, which FSDP2 takes as a
completed one; what the job allocates, and in which order, is unchanged (its buffers are made before the call).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

# Gloo lets go within microseconds once scheduled; a rank that never gets there fails the truth loudly instead.
RELEASE_TIMEOUT_S = 30.0
# Collectives whose buffers gloo still held after completing them, in this process (the truths print it).
late_releases = 0


def _use_count(tensor: torch.Tensor) -> tuple[int, int]:
    """The references to the tensor itself (gloo's work keeps the caller's tensors) and to its storage (and views
    of it, as gloo cuts one per rank)."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)


def _held(tensors: tuple[torch.Tensor, ...], before: list[tuple[int, int]]) -> bool:
    """Whether anything beyond what held the tensors before the call still holds one of them or its storage."""
    for tensor, counts in zip(tensors, before, strict=True):
        if any(now > then for now, then in zip(_use_count(tensor), counts, strict=True)):
            return True
    return False


def _released(original: Callable[..., Any]) -> Callable[..., Any]:
    def collective(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> None:  # noqa: A002
        tensors = (output, input)
        before = [_use_count(t) for t in tensors]
        kwargs["async_op"] = True
        work = original(output, input, *args, **kwargs)
        work.wait()
        del work
        global late_releases
        late_releases += _held(tensors, before)
        deadline = time.monotonic() + RELEASE_TIMEOUT_S
        while _held(tensors, before):
            if time.monotonic() > deadline:
                raise RuntimeError(f"gloo held a collective's buffers for over {RELEASE_TIMEOUT_S} s")
            time.sleep(0)  # gloo's worker thread drops its work after it signalled completion
        return None

    return collective


@contextmanager
def collectives_released() -> Iterator[None]:
    """FSDP2's all-gathers and reduce-scatters, inside the block, return once gloo has let go of their buffers."""
    originals = {name: getattr(dist, name) for name in ("all_gather_single", "reduce_scatter_single")}
    for name, original in originals.items():
        setattr(dist, name, _released(original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
