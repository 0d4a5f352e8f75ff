"""--device all's collection of per-GPU results: a child that dies without reporting is a failure,
not a wait that never ends. (The probing itself needs GPUs: tests/gpu and bench/gpu_check.sh.)"""

from __future__ import annotations

import multiprocessing as mp
import os

from autotune.orchestrate import multi


def _reports(index: int, queue: mp.Queue) -> None:
    queue.put((index, '{"ok": true}', None))


def _dies(index: int, queue: mp.Queue) -> None:
    os._exit(3)  # as a segfault or the OOM killer would: no report, no clean-up


def test_a_dead_child_becomes_a_failure(monkeypatch) -> None:
    monkeypatch.setattr(multi, "POLL_SECONDS", 0.5)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_reports, args=(0, queue)), ctx.Process(target=_dies, args=(1, queue))]
    for worker in workers:
        worker.start()
    results = multi._collect(queue, workers)
    assert results[0] == (0, '{"ok": true}', None)
    assert results[1][0] == 1 and results[1][1] is None
    assert "exited with code 3" in (results[1][2] or "")
