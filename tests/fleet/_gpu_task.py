"""A test-only task for an ``--accelerators`` pair on a cluster whose GPU is only a Ray resource.

Loading it (a zero-argument callable, as ``load_task`` allows) writes what Ray assigned to the worker
to ``$AUTOTUNE_FLEET_TEST_DIR/assigned-<pid>.json``; the probe that follows then fails on the CPU
build of torch (no CUDA), which is the pair's one-line error.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import ray

from autotune.tasks.task import ProbeTask
from tests.fleet._tasks import Small, _inputs


def where() -> ProbeTask:
    assigned = {
        "resources": ray.get_runtime_context().get_assigned_resources(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    (Path(os.environ["AUTOTUNE_FLEET_TEST_DIR"]) / f"assigned-{os.getpid()}.json").write_text(json.dumps(assigned))
    return ProbeTask(name="fleet-where", model=Small, batch=_inputs)
