"""The frozen heap's spans (autotune/core/heap.py), in a fresh interpreter: the suite's own tests run inside
the span tests/conftest.py opens, so the outermost span is only to be seen in a process of its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(script: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_only_the_outermost_span_freezes_and_the_heap_is_unfrozen_after_it() -> None:
    out = _run(
        """
        import gc
        from autotune.core.heap import FrozenHeap

        calls = []
        with FrozenHeap(before=lambda: calls.append("outer")):
            outer = gc.get_freeze_count()
            made = [object() for _ in range(1000)]  # young: not frozen by the inner span
            with FrozenHeap(before=lambda: calls.append("inner")):
                inner = gc.get_freeze_count()
            after_inner = gc.get_freeze_count()
        print(outer > 0, inner == outer, after_inner == outer, gc.get_freeze_count(), calls)
        """
    )
    assert out == "True True True 0 ['outer']"


def test_garbage_made_inside_the_span_is_collected_and_a_decorated_call_is_a_span() -> None:
    out = _run(
        """
        import gc, weakref
        from autotune.core.heap import FrozenHeap

        class Node:
            pass

        @FrozenHeap()
        def trial():
            a, b = Node(), Node()
            a.b, b.a = b, a  # a cycle: only the collector frees it
            ref = weakref.ref(a)
            del a, b
            frozen_now = gc.get_freeze_count()
            gc.collect()
            return ref() is None, frozen_now > 0

        print(*trial(), gc.get_freeze_count())
        """
    )
    assert out == "True True 0"


def test_a_heap_frozen_by_the_process_is_left_as_it_was() -> None:
    out = _run(
        """
        import gc
        from autotune.core.heap import FrozenHeap

        gc.freeze()
        before = gc.get_freeze_count()
        with FrozenHeap(before=lambda: print("never")):
            during = gc.get_freeze_count()
        print(before > 0, during == before, gc.get_freeze_count() == before)
        """
    )
    assert out == "True True True"
