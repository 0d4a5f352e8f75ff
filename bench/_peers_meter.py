"""The meters as the peers see them: the same accounting as autotune's, a budget of budget x (1 - headroom),
the budget enforced only while a peer's trial runs, and an OOM the peers recognise.

:class:`PeerMeter` is the CPU meter's; :class:`CudaPeerMeter` is the CUDA meter's (``bench/peers.py
--device cuda``), where the OOM is CUDA's own and both peers recognise its text as it is.

Why a different budget: autotune's meter raises at the budget and autotune calls a trial that stays under
the budget but over budget x (1 - headroom) "over limit" from the measured peak. A peer sees nothing but
OOMs, so the peer's meter raises at budget x (1 - headroom): "no OOM" for a peer is then exactly "fits"
for autotune, and every answer is judged against the same line.

Why another message: Lightning (``pytorch_lightning.utilities.memory.is_oom_error``) and Accelerate
(``accelerate.utils.memory.should_reduce_batch_size``) recognise an OOM by the text of a RuntimeError
with a single argument, never by type. Both accept the text PyTorch's own CPU allocator raises when
malloc fails, ``DefaultCPUAllocator: can't allocate memory``; Lightning's other CPU-free option needs
the word "CUDA", which a CPU error should not claim. :data:`PEER_OOM_TEXT` is that text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from autotune.measure.meters import CpuMeter, CpuOutOfMemoryError, CudaMeter

# What PyTorch's DefaultCPUAllocator says when malloc fails; both peers match it as a substring.
PEER_OOM_TEXT = "DefaultCPUAllocator: can't allocate memory"


class PeerOutOfMemoryError(CpuOutOfMemoryError):
    """The CPU meter's OOM with text the peers match (still a torch.OutOfMemoryError by type)."""


class PeerMeter(CpuMeter):
    """A CpuMeter whose budget binds only inside :meth:`enforcing`, raising :class:`PeerOutOfMemoryError`.

    Outside ``enforcing()`` the meter keeps counting (so a peer's leftovers show in the next trial's
    baseline) but never raises: a peer's own bookkeeping between trials (Lightning saves and restores
    a checkpoint around its search) is not a trial and is not what the budget judges.
    """

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self._enforce = False

    @contextmanager
    def enforcing(self) -> Iterator[None]:
        """Enforce the budget for one trial of a peer."""
        self._enforce = True
        try:
            yield
        finally:
            self._enforce = False

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        previous, self._enforce = self._enforce, False
        try:
            yield
        finally:
            self._enforce = previous

    def _account(self, out: Any, func: Any) -> None:
        try:
            super()._account(out, func)
        except CpuOutOfMemoryError as exc:
            raise PeerOutOfMemoryError(f"{PEER_OOM_TEXT} under the CPU meter's budget: {exc}") from None

    def adopt(self, module: torch.nn.Module) -> None:
        try:
            super().adopt(module)
        except CpuOutOfMemoryError as exc:
            raise PeerOutOfMemoryError(f"{PEER_OOM_TEXT} under the CPU meter's budget: {exc}") from None


def recognition(predicate: Callable[[BaseException], bool]) -> dict[str, bool]:
    """Whether a peer's OOM predicate accepts autotune's own CPU-meter OOM and the peer meter's.

    The first is made by a real CpuMeter crossing a real budget, so the report follows whatever message
    autotune/measure/meters.py raises today.
    """
    meter = CpuMeter(1024)
    own: BaseException | None = None
    try:
        with meter.measure():
            torch.empty(4096, dtype=torch.uint8)
    except CpuOutOfMemoryError as exc:
        own = exc
    assert own is not None, "a 4 KiB tensor under a 1 KiB budget must raise"
    peer_meter = PeerMeter(1024)
    peer: BaseException | None = None
    try:
        with peer_meter.measure(), peer_meter.enforcing():
            torch.empty(4096, dtype=torch.uint8)
    except PeerOutOfMemoryError as exc:
        peer = exc
    assert peer is not None
    return {"autotune_cpu_meter_oom": bool(predicate(own)), "peer_meter_oom": bool(predicate(peer))}


class CudaPeerMeter(CudaMeter):
    """A CudaMeter whose budget binds only inside :meth:`enforcing`: there the allocator's per-process
    memory fraction is what :class:`CudaMeter` sets (budget less the memory outside the allocator, read
    now), outside it the fraction is 1. Crossing it is a real ``torch.OutOfMemoryError`` ("CUDA out of
    memory"), which Lightning and Accelerate recognise by its text.
    """

    def __init__(self, index: int, budget_bytes: int) -> None:
        super().__init__(index, budget_bytes)
        self._fraction = 1.0
        torch.cuda.set_per_process_memory_fraction(1.0, index)

    @contextmanager
    def _fraction_set_to(self, fraction: float) -> Iterator[None]:
        previous, self._fraction = self._fraction, fraction
        torch.cuda.set_per_process_memory_fraction(fraction, self.index)
        try:
            yield
        finally:
            self._fraction = previous
            torch.cuda.set_per_process_memory_fraction(previous, self.index)

    @contextmanager
    def enforcing(self) -> Iterator[None]:
        """Enforce the budget for one trial of a peer."""
        allocator_bytes = max(0, self.budget_bytes - self._outside_bytes())
        with self._fraction_set_to(min(1.0, allocator_bytes / self.total_bytes)):
            yield

    @contextmanager
    def unbounded(self) -> Iterator[None]:
        with self._fraction_set_to(1.0):
            yield

    @property
    def live_bytes(self) -> int:
        """Bytes the caching allocator has handed out now (tensors alive on the device)."""
        return int(torch.cuda.memory_allocated(self.index))


def cuda_recognition(predicates: dict[str, Callable[[BaseException], bool]], index: int = 0) -> dict[str, bool]:
    """Whether each peer's OOM predicate accepts a real CUDA OOM raised under a :class:`CudaPeerMeter`."""
    meter = CudaPeerMeter(index, 1 << 30)
    oom: BaseException | None = None
    try:
        with meter.measure(), meter.enforcing():
            torch.empty(2 * meter.budget_bytes, dtype=torch.uint8, device=meter.device)
    except torch.OutOfMemoryError as exc:
        oom = exc.with_traceback(None)
    finally:
        meter.close()
    assert oom is not None, "2 GiB under a 1 GiB budget must raise"
    return {name: bool(predicate(oom)) for name, predicate in predicates.items()}
