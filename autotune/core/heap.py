"""The heap frozen for a span of trials: what is alive when the span starts (modules, the task, torch's own
objects) is never garbage of a trial, so the collection after each trial walks only what the trials made.

Spans nest: only the outermost freezes and unfreezes, and the inner ones cost nothing. ``gc.get_freeze_count()``
walks the whole frozen generation (0.04 s over torch's heap), so it is asked once, by the outermost span, to
leave alone a process that froze its own heap (some servers do). Torch-free: the test suite's own span
(tests/conftest.py) is this one, so that the probe's spans inside it are inner ones.

    with FrozenHeap():
        for m in sizes: run_trial(m)  # each meter.release() collects only the trial's garbage
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from contextlib import ContextDecorator

__all__ = ["FrozenHeap"]

_lock = threading.Lock()
_depth = 0  # spans open now; the outermost's choice holds for the rest
_froze = False  # whether the outermost span froze the heap (False: it found a heap frozen by someone else)


class FrozenHeap(ContextDecorator):
    """Freeze the heap for the span (a ``with`` block, or a decorated function's call), unless a span is
    already open or the process froze its own heap.

    Args:
        before: run before the outermost span freezes (imports whose objects should be frozen too).
    """

    def __init__(self, before: Callable[[], None] | None = None) -> None:
        self._before = before

    def __enter__(self) -> None:
        global _depth, _froze
        with _lock:
            outermost = _depth == 0
            _depth += 1
            if outermost:
                _froze = gc.get_freeze_count() == 0
                if _froze:
                    if self._before is not None:
                        self._before()
                    gc.freeze()

    def __exit__(self, *exc: object) -> None:
        global _depth, _froze
        with _lock:
            _depth -= 1
            if _depth == 0 and _froze:
                gc.unfreeze()
                _froze = False
