"""The CPU meter as the peers see it: the same live-storage accounting, a budget of budget x (1 - headroom),
the budget enforced only while a peer's trial runs, and an OOM message the peers recognise.

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

from autotune.meters import CpuMeter, CpuOutOfMemoryError

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
    autotune/meters.py raises today.
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
