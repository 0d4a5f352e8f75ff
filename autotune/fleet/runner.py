"""The fleet's driver: connect to Ray (or start it here), submit one task per pair, collect.

    rows = run_fleet(pairs, sink=sink, progress=progress, ray_address=None, working_dir=Path.cwd())

Ray is imported here, inside :func:`run_fleet`, and nowhere at module level: ``import autotune`` and
every other command stay free of it, and the service image has none.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, TextIO

from autotune.core.errors import AutotuneError
from autotune.core.plan import micro_batches_text
from autotune.core.schemas import Profile
from autotune.fleet.pairs import Pair
from autotune.fleet.progress import PairState, Progress
from autotune.fleet.sink import ProfileSink
from autotune.fleet.worker import Board, Outcome, estimate_pair, one_line, probe_pair

__all__ = [
    "DEFAULT_MAX_RETRIES",
    "LOCAL_OBJECT_STORE_BYTES",
    "POLL_SECONDS",
    "SHIPPED_EXCLUDES",
    "run_fleet",
]

DEFAULT_MAX_RETRIES = 3
"""Re-runs of a pair whose worker process died (Ray's own default for tasks)."""

POLL_SECONDS = 0.5
"""How often the driver looks for finished pairs and redraws the table."""

BOARD_TIMEOUT_SECONDS = 10.0

LOCAL_OBJECT_STORE_BYTES = 256 * 1024**2
"""A local instance's object store: the fleet moves a few kilobytes of JSON per pair, so Ray's
default (30 % of the machine's memory) would only reserve shared memory for nothing."""

SHIPPED_EXCLUDES = [".git", ".venv", "venv", "__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"]
"""Never shipped to the workers with the working directory (Ray also honours .gitignore and .rayignore)."""


NOT_EMULATED = "could not be emulated here"
"""The words of the warning an estimate carries when its card could not be emulated (orchestrate/estimate.py)."""

LOCAL_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
"""Set to 0, Ray runs as it does on a laptop by default: one node, on the loopback address (Linux
otherwise binds a local instance to this machine's network address). Read when ray is imported."""

NO_PRESTART_ENV = "RAY_prestart_worker_first_driver"
"""Set to 0 for a local instance: Ray otherwise starts an idle worker per CPU as the first driver connects,
workers without the fleet's runtime environment (its working directory) that no pair and no board can use,
each a Python importing Ray that competes with the pairs' own workers as they start. Read by the raylet."""


def _import_ray(local: bool) -> Any:
    if local and "ray" not in sys.modules:
        os.environ.setdefault(LOCAL_ONLY_ENV, "0")
    try:
        import ray
    except ImportError:
        raise AutotuneError("autotune fleet needs Ray: pip install 'autotune[fleet]'") from None
    return ray


def _excludes() -> list[str]:
    """SHIPPED_EXCLUDES less those this Ray excludes by itself (it warns about each one repeated)."""
    try:
        from ray._private.ray_constants import get_runtime_env_default_excludes

        defaults = set(get_runtime_env_default_excludes())
    except ImportError:  # a Ray without default excludes: name them all
        defaults = set()
    return [name for name in SHIPPED_EXCLUDES if name not in defaults]


def _quiet_default_exclude_notices() -> None:
    """Ray (2.5x) warns on every run that .git / .venv are no longer shipped with a working
    directory; the fleet never wants them shipped, so the notice only hides the lines that matter."""
    for name in ("ray._private.worker", "ray._private.runtime_env.working_dir"):  # the loggers it comes through
        logging.getLogger(name).addFilter(lambda record: "is now ignored by default" not in record.getMessage())


def _connect(ray: Any, address: str | None, working_dir: Path, log: TextIO) -> None:
    _quiet_default_exclude_notices()
    runtime_env = {"working_dir": str(working_dir.resolve()), "excludes": _excludes()}
    if address:
        print(f"fleet: connecting to the Ray cluster at {address}", file=log, flush=True)
        ray.init(address=address, runtime_env=runtime_env, logging_level=logging.WARNING)
    else:
        # A laptop's or a single node's own instance, on the loopback address (LOCAL_ONLY_ENV):
        # nothing else needs to reach it, and it goes away with this process.
        print("fleet: no --ray-address: starting a local Ray instance", file=log, flush=True)
        os.environ.setdefault(NO_PRESTART_ENV, "0")
        ray.init(
            address="local",  # a new instance even when `ray start` runs here (--ray-address auto uses that)
            runtime_env=runtime_env,
            include_dashboard=False,
            object_store_memory=LOCAL_OBJECT_STORE_BYTES,
            logging_level=logging.WARNING,
        )


def _warn_unplaceable(ray: Any, pairs: list[Pair], log: TextIO) -> None:
    """Say which pairs no node can take now: Ray keeps them pending (an autoscaler may add a node)."""
    resources = ray.cluster_resources()
    kinds = sorted({pair.accelerator for pair in pairs if pair.accelerator is not None})
    missing = [kind for kind in kinds if f"accelerator_type:{kind}" not in resources]
    for kind in missing:
        print(
            f"fleet: warning: no node of this cluster has a GPU of kind {kind} now (Ray resource "
            f"accelerator_type:{kind}); its pairs wait until one joins (Ctrl-C cancels)",
            file=log,
            flush=True,
        )
    if any(pair.needs_gpu for pair in pairs) and resources.get("GPU", 0) < 1:
        print("fleet: warning: this cluster has no GPU now; the GPU pairs wait until one joins", file=log, flush=True)


def _finish(ray: Any, ref: Any, index: int, progress: Progress, sink: ProfileSink, attempts: dict[int, int]) -> None:
    try:
        outcome: Outcome = ray.get(ref)
    except ray.exceptions.RayError as exc:  # the worker died on every attempt, the node is gone, ...
        started = attempts.get(index, 0)
        tries = f" (started {started} times)" if started > 1 else ""
        progress.failed(index, one_line(exc) + tries, attempt=started)
        return
    if outcome.error is not None or outcome.profile_json is None:
        progress.failed(
            index, outcome.error or "no profile", attempt=outcome.attempt, seconds=outcome.seconds, host=outcome.host
        )
        return
    try:
        parsed = json.loads(outcome.profile_json)
        profiles = [Profile.model_validate(item) for item in (parsed if isinstance(parsed, list) else [parsed])]
    except ValueError as exc:  # a node with another autotune: its profile is not this driver's Profile
        progress.failed(
            index,
            f"the worker's profile does not validate here (is autotune the same version on every node?): "
            f"{one_line(exc)}",
            attempt=outcome.attempt,
            seconds=outcome.seconds,
            host=outcome.host,
        )
        return
    stored = [sink.keep(profile) for profile in profiles][-1]
    profile = profiles[0]
    plan = _plan_text(profile)
    if len(profiles) > 1 or profile.seq_len is not None:  # a run over lengths: each length's plan
        plan = "; ".join(f"L={p.seq_len}: {_plan_text(p) or p.max_micro_batch}" for p in profiles)
    progress.done(
        index,
        attempt=outcome.attempt,
        max_micro_batch=profile.max_micro_batch,
        plan=plan,
        stored=stored,
        seconds=outcome.seconds,
        host=outcome.host,
        note=_not_emulated(profile),
    )


def _not_emulated(profile: Profile) -> str | None:
    """An estimate whose card could not be emulated on its node ran with CPU semantics (as `autotune
    estimate --gpu` does there): the row says so, since the store now holds the weaker figure."""
    reason = next((w for w in profile.warnings if NOT_EMULATED in w), None)
    return None if reason is None else f"not emulated, CPU semantics: {reason}"


def _plan_text(profile: Profile) -> str | None:
    """One update's micro-batches, count×size: ``16×16 = 256 (16 steps)``, ``6×26 + 4×25 = 256 (10 steps)``."""
    the_plan = profile.plan
    return None if the_plan is None else micro_batches_text(the_plan.micro_batches, the_plan.world_size)


def _driver_cuda_python(pairs: list[Pair]) -> str | None:
    """This machine's Python with a CUDA build of torch, for the estimate pairs' nodes (where they have
    the same path); None when there are no estimates, or no such Python here."""
    if not any(pair.estimate is not None for pair in pairs):
        return None
    from autotune.emulation.runner import CudaTorchMissing, find_cuda_python

    try:
        return str(Path(find_cuda_python()).absolute())
    except CudaTorchMissing:  # the nodes may have their own (AUTOTUNE_CUDA_PYTHON on each)
        return None


def _submit(ray: Any, pairs: list[Pair], board: Any, max_retries: int) -> dict[Any, int]:
    """One Ray task per pair: a probe, or an estimate on a CPU; returns each task's ref -> pair index."""
    # max_calls=1: every probe in a fresh worker process, so that nothing an earlier probe left in
    # the process (memory, a frozen heap, CUDA state) counts against this one.
    probe_task = ray.remote(max_calls=1)(probe_pair)
    estimate_task = ray.remote(max_calls=1)(estimate_pair)
    cuda_python = _driver_cuda_python(pairs)
    refs: dict[Any, int] = {}
    for pair in pairs:
        options = pair.ray_options(max_retries)
        if pair.estimate is not None:
            ref = estimate_task.options(**options).remote(
                pair.index, pair.worker_spec, pair.config, pair.estimate, board, cuda_python
            )
        else:
            ref = probe_task.options(**options).remote(pair.index, pair.worker_spec, pair.config, board)
        refs[ref] = pair.index
    return refs


def _cancel(ray: Any, refs: dict[Any, int], progress: Progress) -> int:
    """Cancel every unfinished task, the pending ones first (so that none of them takes the CPU or
    GPU that a killed running one frees); a running one's worker is killed (``force``).

    A task's "running" reaches the board after it has started, so at Ctrl-C a started task may
    still read as pending: among tasks of one state the last submitted go first, since Ray grants
    resources in submission order and the last are the ones most likely still waiting."""
    order = sorted(refs, key=lambda ref: (progress.rows[refs[ref]].state == "running", -refs[ref]))
    for ref in order:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # finished in the meantime: nothing to cancel
            pass
    return len(order)


def run_fleet(
    pairs: list[Pair],
    *,
    sink: ProfileSink,
    progress: Progress,
    ray_address: str | None,
    working_dir: Path,
    max_retries: int = DEFAULT_MAX_RETRIES,
    poll_seconds: float = POLL_SECONDS,
    log: TextIO | None = None,
) -> list[PairState]:
    """Probe every pair as a Ray task and keep each profile as it arrives.

    Args:
        pairs: from :func:`autotune.fleet.make_pairs`.
        sink: uploads (and/or writes) each finished profile.
        progress: the rows, updated and redrawn as the pairs move.
        ray_address: a running cluster (``host:6379``, ``ray://host:10001``, or ``auto`` for the
            one ``ray start`` runs on this machine); None uses ``$RAY_ADDRESS`` or starts a new
            local instance on this machine, which ends with the run.
        working_dir: shipped to the workers (Ray's runtime environment); task files lie inside it.
        max_retries: re-runs of a pair whose worker process died.
        poll_seconds: how often to look for finished pairs.
        log: where the driver's own lines go (default stderr).

    Returns:
        The rows, one per pair, done or failed.

    Raises:
        AutotuneError: Ray is not installed.
        KeyboardInterrupt: after cancelling every unfinished task (nothing partial is kept: a
            profile is stored only whole, when its pair is done).
    """
    log = log or sys.stderr
    address = ray_address or os.environ.get("RAY_ADDRESS")
    ray = _import_ray(local=not address)
    # Ray prints what its workers and raylets say ("(raylet) A worker died ...") on the driver's
    # stdout; stdout is the fleet's results (``--json``), so all of it goes to the log instead.
    with contextlib.redirect_stdout(log):
        _connect(ray, address, working_dir, log)
        try:
            return _submit_and_collect(ray, pairs, sink, progress, max_retries, poll_seconds, log)
        finally:
            ray.shutdown()


def _submit_and_collect(
    ray: Any,
    pairs: list[Pair],
    sink: ProfileSink,
    progress: Progress,
    max_retries: int,
    poll_seconds: float,
    log: TextIO,
) -> list[PairState]:
    _warn_unplaceable(ray, pairs, log)
    board = ray.remote(num_cpus=0)(Board).remote()
    refs = _submit(ray, pairs, board, max_retries)
    progress.refresh()
    attempts: dict[int, int] = {}
    try:
        while refs:
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=poll_seconds)
            try:
                attempts = ray.get(board.attempts.remote(), timeout=BOARD_TIMEOUT_SECONDS)
            except ray.exceptions.RayError:  # only the table's "running" column depends on it
                pass
            for index, attempt in sorted(attempts.items()):
                progress.started(index, attempt)
            for ref in ready:
                _finish(ray, ref, refs.pop(ref), progress, sink, attempts)
            progress.refresh()
    except KeyboardInterrupt:
        cancelled = _cancel(ray, refs, progress)
        print(
            f"fleet: interrupted: cancelled {cancelled} unfinished task(s); "
            "only profiles of pairs already done were kept",
            file=log,
            flush=True,
        )
        raise
    return list(progress.rows.values())
