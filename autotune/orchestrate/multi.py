"""`--device all`: one probe process per visible GPU, in parallel; the plan uses the smallest m.

The children are spawned, not forked: a parent that has touched CUDA (even to count devices) must
not fork. Each child loads the task again from its spec ("file.py:name"), since a ProbeTask is
usually full of lambdas that cannot be pickled.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import queue as queue_module
from typing import Any

import torch

from autotune.core.errors import AutotuneError, DeviceError
from autotune.core.schemas import Profile

__all__ = ["probe_all_devices", "tightest_of"]

POLL_SECONDS = 5.0


def _child(spec: str, config: Any, index: int, queue: Any) -> None:
    from autotune.orchestrate.probe import probe
    from autotune.tasks.load import load_task

    try:
        profile = probe(load_task(spec), dataclasses.replace(config, device=f"cuda:{index}"))
        queue.put((index, profile.model_dump_json(), None))
    except Exception as exc:  # reported by the parent as one line
        queue.put((index, None, f"{type(exc).__name__}: {exc}"))


def _collect(queue: Any, workers: list[Any]) -> list[tuple[int, str | None, str | None]]:
    """One result per child; a child that died without reporting (segfault, OOM killer, a fatal
    CUDA error) becomes a failure instead of a wait that never ends."""
    results: dict[int, tuple[int, str | None, str | None]] = {}
    while len(results) < len(workers):
        try:
            index, text, error = queue.get(timeout=POLL_SECONDS)
            results[index] = (index, text, error)
        except queue_module.Empty:
            for index, worker in enumerate(workers):
                if index not in results and not worker.is_alive() and worker.exitcode is not None:
                    # It may have reported just before dying: give the queue one last look.
                    try:
                        got = queue.get(timeout=POLL_SECONDS)
                        results[got[0]] = got
                    except queue_module.Empty:
                        results[index] = (index, None, f"the process exited with code {worker.exitcode}")
    for worker in workers:
        worker.join()
    return [results[i] for i in sorted(results)]


def probe_all_devices(spec: str, config: Any) -> Profile:
    """Probe every visible CUDA device with the task at spec; the returned profile is the tightest
    device's, with all devices listed and the plan made from the smallest m_max."""
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        raise DeviceError("--device all: no CUDA device is visible on this machine")
    count = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    workers = [ctx.Process(target=_child, args=(spec, config, i, queue)) for i in range(count)]
    for worker in workers:
        worker.start()
    results = _collect(queue, workers)
    failures = [f"cuda:{i}: {err}" for i, _, err in results if err]
    if failures:
        raise AutotuneError("probe failed on " + "; ".join(failures))
    return tightest_of([Profile.model_validate_json(text) for _, text, _ in sorted(results) if text], config)


def tightest_of(profiles: list[Profile], config: Any) -> Profile:
    """The tightest device's profile with every device listed and the plan made from the smallest m_max: the one plan
    of the setup (``ProbeConfig.plan_for``: over D, the data-parallel replicas, as each device's probe planned, not
    over every rank of the mesh)."""
    tightest = min(profiles, key=lambda p: p.max_micro_batch)
    single = tightest.single_step.max_micro_batch if tightest.single_step is not None else None
    the_plan = config.plan_for(tightest.max_micro_batch, [], single)
    return tightest.model_copy(update={"devices": [p.device for p in profiles], "plan": the_plan})
