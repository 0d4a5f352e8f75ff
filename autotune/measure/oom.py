"""Is this exception an out-of-memory? By type first, message text only as a fallback.

A shape error or an illegal memory access is never an OOM: treating it as one would make the
search shrink m and return a confidently wrong answer.
"""

from __future__ import annotations

__all__ = ["is_oom", "release_failed_backward"]

# Allocation failures that surface as a plain RuntimeError (older builds, cuDNN, cuBLAS).
_OOM_MARKERS = (
    "cuda out of memory",
    "out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cudnn_status_not_enough_workspace",
    "hip out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
    "failed to allocate memory",
)


def is_oom(exc: BaseException) -> bool:
    """True when exc reports that an allocation failed.

    >>> is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    True
    >>> is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    False
    """
    try:
        import torch

        if isinstance(exc, torch.OutOfMemoryError):
            return True
    except ImportError:  # classification must work where torch is absent (the server)
        pass
    if not isinstance(exc, (RuntimeError, MemoryError)):
        return False
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    if "illegal memory access" in text or "misaligned address" in text:
        return False
    return any(marker in text for marker in _OOM_MARKERS)


def release_failed_backward() -> None:
    """Let go of the graph of a backward that raised (a trial's OOM inside the backward): autograd's engine keeps the
    failed graph's remaining work in its ready queue until the next backward runs, and with it every tensor the graph
    saved. Until then they are live: under --offload activations the packed host copies of a trial that ran out in
    its backward sat on the host ledger into the next trial, whose host peak read them (the tiny GPT at m = 6 after
    m = 12: 2,385,920 B where a fresh trial reads 1,150,464). One backward of a scalar here drains it. Call it outside
    any measured span."""
    import torch

    try:
        with torch.inference_mode(False), torch.enable_grad():
            torch.ones(1, requires_grad=True).sum().backward()
    except Exception:  # noqa: BLE001 - a drain that cannot run leaves what it would have freed, never the trial's error
        pass
