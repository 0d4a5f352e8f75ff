"""DDP's all-reduce over a gloo group that returns once gloo has let go of the bucket, so that a probe's trial frees
DDP's buckets where the job's code drops them, as a card does.

gloo runs a collective on a worker thread of its own, which holds the collective's work (and through it the bucket)
until after it has signalled completion and taken its queue's lock again. Under load that thread can be descheduled:
the bucket DDP's reducer replaces after its first backward (1 MiB, then 25 MiB buckets) would then be freed by
gloo's thread after the reducer let go of it, and a trial's peak could hold it beside its successor. NCCL has no such
thread: its kernels are stream-ordered and the caching allocator frees a block where the program drops it.
(tests/autotune/_ordered_gloo.py orders the truths' collectives, written apart: a dispatch mode that waits on each
collective and fences its group's one gloo thread.)

This hook alone did not cure the compiled probe over ddp that read 122,368 bytes high (2 runs in 16 with it, both
cores busy): that block was the DDP constructor's broadcast of the weights, freed by gloo's thread after the build's
span, which apply_ddp now avoids (``init_sync=False`` in the probe's one-process group). The hook keeps the buckets'
frees where DDP drops them; no run was caught reading a bucket high without it.

A third: DDP's reducer rebuilds its buckets at the second forward after its construction and broadcasts their indices
(int32s: 72 B for 17 parameters) from C++, where no comm hook sees it; one probe in about 2,700 read those 72 B high.
The trial runner settles a new DDP with one unmeasured trial before its first measured one (TrialRunner._settle in
autotune/measure/trial.py).

The hook all-reduces the bucket's flat buffer in place, waits, and waits again until the buffer and its storage are
back to the references they had before the call; it allocates nothing (the one-process group's sum is the buffer
itself, so it divides by nothing, as the reducer's own division by 1 changes no byte).
"""

# No ``from __future__ import annotations``: DDP's register_comm_hook compares the hook's annotations with
# dist.GradBucket and Future[Tensor] themselves.
import time
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RELEASE_TIMEOUT_S", "released_allreduce"]

# gloo lets go within microseconds once scheduled; a thread that never gets there fails the trial loudly instead.
RELEASE_TIMEOUT_S = 30.0


def _references(tensor: torch.Tensor) -> tuple[int, int]:
    """The references to the tensor itself (gloo's work keeps the caller's tensors) and to its storage."""
    return tensor._use_count(), torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)  # type: ignore[attr-defined]


def released_allreduce(group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook (``register_comm_hook(group, released_allreduce)``): the bucket summed over ``group``,
    returned as a completed future once gloo holds none of it.

    Raises:
        RuntimeError: gloo still held the bucket after :data:`RELEASE_TIMEOUT_S`.
    """
    buffer = bucket.buffer()
    before = _references(buffer)
    work = dist.all_reduce(buffer, group=group, async_op=True)
    work.wait()
    del work
    deadline = time.monotonic() + RELEASE_TIMEOUT_S
    while any(now > then for now, then in zip(_references(buffer), before, strict=True)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"gloo held a DDP bucket for over {RELEASE_TIMEOUT_S} s after its all-reduce")
        time.sleep(0)  # gloo's worker thread drops its work after it signalled completion
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done
