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


def test_the_tightest_device_plans_over_the_replicas() -> None:
    """--device all: the plan of the tightest device's m_max is the setup's one plan, over D = W / (tp x pp x cp)
    (issue 61: it was planned over every rank W)."""
    from autotune.core.mesh import Mesh
    from autotune.orchestrate.config import ProbeConfig
    from tests.factories import make_profile

    config = ProbeConfig(device="all", target_batch=64, world_size=4, mesh=Mesh(tp=2))
    profiles = [make_profile(max_micro_batch=m, seed=m, bytes_per_sample=2**30) for m in (16, 8)]
    tightest = multi.tightest_of(profiles, config)
    assert tightest.max_micro_batch == 8 and len(tightest.devices) == 2
    assert tightest.plan is not None
    # D = 4 / 2 = 2 replicas: 8 x 4 x 2 = 64 (over W = 4 it would have been 8 x 2 x 4).
    assert (tightest.plan.micro_batch, tightest.plan.accumulation_steps, tightest.plan.world_size) == (8, 4, 2)
