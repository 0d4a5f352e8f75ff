"""Fake trials of one run on more than one core: worker processes beside the main one.

A fake trial is pure Python dispatch on one core (about 9 s for the 7B configuration under fsdp over
8 ranks on these machines), and the trials of a run over lengths are mostly independent of each
other: the surface's seven traced points, and, once the surface has spoken, every length's
confirmations and the longest length's pair. Each worker loads the run's task from the spec it was
loaded from, holds a fake model of its own inside a fake process group of its own, and runs the
trials it is handed; the main process runs others meanwhile. A trial depends only on the task, the
point (m, L) and the budget (the reused model gives a fresh model's peak byte for byte, and the same
trace), so where a trial runs changes nothing but the wall time.

Workers are started only where they pay: the task must come from a spec (a ProbeTask built in
Python cannot be sent to another process), the machine must have an idle core, and a fake trial must
take long enough (``SLOW_TRIAL_SECONDS``) to cover a worker's start (imports and its model build,
which overlap the main process's own trials). A worker that fails costs nothing but its share: the
main process runs what did not come back.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from autotune.core.mesh import Mesh
from autotune.core.setup import JobSetup
from autotune.measure.meters.fake import current_load_factor

__all__ = ["SLOW_BUILD_SECONDS", "SLOW_TRIAL_SECONDS", "FakeLanes", "LaneSetup", "Point", "spare_cores"]

# A fake trial this slow or slower is worth a worker: a worker's start (about 6 s of imports and a
# model build) then overlaps less than one of the main process's trials.
SLOW_TRIAL_SECONDS = 2.0
# A fake model this slow to build has trials slower than SLOW_TRIAL_SECONDS (measured here: the 7B
# configuration builds in 1.4 s under fsdp over 8 and 0.35 s alone, its trials take 9 s and 6 s;
# the small GPT builds in 0.05 s, its trials take 0.3 s).
SLOW_BUILD_SECONDS = 0.25
MAX_WORKERS = 3


@dataclass(frozen=True)
class Point:
    """One fake trial: the task at seq_len, micro_batch, under budget_bytes with limit_bytes."""

    seq_len: int
    micro_batch: int
    budget_bytes: int
    limit_bytes: int


@dataclass(frozen=True)
class LaneSetup:
    """What a worker needs to hold the run's fake model: everything picklable."""

    spec: str
    # The job's setup, whole (autotune/core/setup.py): the worker applies it to the task it loads
    # (ProbeTask.with_setup) and holds the model under its strategy and mesh.
    job: JobSetup
    device_type: str
    device_name: str | None
    # Loads the task and holds its fake model in the worker: (task, the ExitStack its process group and
    # heap live in, the fake trials). A module-level function, so that it pickles by name; the search
    # passes autotune.search.presearch.hold_lane_model, which this floor does not import.
    hold: Callable[[LaneSetup], tuple[Any, ExitStack, Any]]
    # The mixture-of-experts routing the run's fake trials assume (autotune/measure/meters/fake.py).
    moe_load_factor: float = 1.0


def spare_cores() -> int:
    """Idle cores this process may use beyond its own, at most MAX_WORKERS: the cores it may run on, less one for
    itself, less what the machine's load keeps busy besides it (the 1-minute load average, this process counted in
    it as at least one). A worker on a core another process keeps busy buys no wall time and costs its start (an
    import of torch and the task's libraries, a model build: about 6 s of CPU on these machines): measured on 2
    cores under a second busy process, an hf: estimate spent 27.8 s of CPU with its worker and 21.5 s without,
    for the same figures."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average here: every core counted idle
        load = 0.0
    idle = int(cores - max(load, 1.0))
    return max(0, min(MAX_WORKERS, cores - 1, idle))


# The worker's own fake model and the task it loaded (one of each per worker process).
_WORKER: dict[str, Any] = {}


class WorkerNotStarted(RuntimeError):
    """The worker could not load the task or hold its model: the main process runs everything."""


def _start_worker(setup: LaneSetup) -> None:
    # A failure here would print a traceback from the pool and kill the worker: kept instead, and
    # said by every trial handed to it, so that the main process stops handing it trials.
    try:
        _hold_model(setup)
    except Exception as exc:
        _WORKER["failed"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"


def _hold_model(setup: LaneSetup) -> None:
    torch.set_num_threads(1)  # fake tensors compute nothing; the lanes share the cores
    task, stack, fakes = setup.hold(setup)
    # Left open, the group and the frozen heap would be torn down half-way through the interpreter's
    # own shutdown: closed first, as the worker exits.
    multiprocessing.util.Finalize(None, _stop_worker, exitpriority=10)
    _WORKER.update(task=task, stack=stack, fakes=fakes)


def _stop_worker() -> None:
    fakes, stack = _WORKER.pop("fakes", None), _WORKER.pop("stack", None)
    if fakes is not None:
        fakes.close()
    if stack is not None:
        stack.close()


def _run_point(point: Point) -> tuple[dict[str, Any], list[int] | None]:
    if "failed" in _WORKER:
        raise WorkerNotStarted(_WORKER["failed"])
    task = _WORKER["task"].at_length(point.seq_len)
    trial, trace = _WORKER["fakes"].run(
        task, point.micro_batch, budget_bytes=point.budget_bytes, limit_bytes=point.limit_bytes
    )
    return trial.model_dump(mode="json"), trace


class FakeLanes:
    """A pool of ``workers`` processes holding the run's fake model, started on first use."""

    @classmethod
    def for_task(
        cls,
        task: Any,
        workers: int,
        *,
        device_type: str,
        strategy: str,
        world_size: int,
        device_name: str | None,
        hold: Callable[[LaneSetup], tuple[Any, ExitStack, Any]],
        mesh: str = "",
    ) -> FakeLanes | None:
        """Lanes for task (a ProbeTask), or None where there are no workers or no spec to load it from."""
        if workers <= 0 or task.source is None:
            return None
        setup = LaneSetup(
            spec=task.source,
            job=task.job_setup(strategy=strategy, world_size=world_size, mesh=Mesh.parse(mesh)),
            device_type=device_type,
            device_name=device_name,
            hold=hold,
            moe_load_factor=current_load_factor(),
        )
        return cls(setup, workers)

    def __init__(self, setup: LaneSetup, workers: int) -> None:
        self.setup, self.workers = setup, workers
        self.broken = False
        self._pool: ProcessPoolExecutor | None = None

    def submit(self, point: Point) -> Future[tuple[dict[str, Any], list[int] | None]] | None:
        """The trial at point on a worker; None where the pool cannot take it (it broke: a worker
        died, or a script without a ``__main__`` guard cannot be spawned), and from then on."""
        if self.broken:
            return None
        try:
            if self._pool is None:
                # spawn, not fork: a forked torch with live threads and a fake process group is not safe.
                self._pool = ProcessPoolExecutor(
                    max_workers=self.workers,
                    mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_worker,
                    initargs=(self.setup,),
                )
            return self._pool.submit(_run_point, point)
        except (BrokenProcessPool, RuntimeError, OSError):
            self.broken = True
            return None

    def finished(
        self, running: dict[Future[Any], Point], *, block: bool
    ) -> Iterator[tuple[Point, tuple[dict[str, Any], list[int] | None] | None]]:
        """The points whose trials came back (None where the worker failed), waiting for the first
        one where block is set."""
        done, _ = wait(list(running), timeout=None if block else 0, return_when=FIRST_COMPLETED)
        for future in done:
            point = running.pop(future)
            try:
                yield point, future.result()
            except (BrokenProcessPool, WorkerNotStarted):  # a worker died or never started: no more lanes
                self.broken = True
                yield point, None
            except Exception:  # the trial failed on the worker: the main process runs it when asked
                yield point, None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
