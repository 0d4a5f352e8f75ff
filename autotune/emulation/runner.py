"""Fake trials on an emulated card, run in a child process, and the check that the emulation works.

The parent stays torch-free on this path: it finds a Python with a CUDA build of torch, builds the
emulation's libraries for it (build.py), starts ``python -m autotune.emulation.child`` with the card in
its environment (environment.py), and reads back JSON. Whatever the child prints (torch's warnings,
the emulation's lines) goes to a log file, never the user's terminal; a failure comes back as one
line, naming the CUDA entry point the emulation did not cover where that was the cause; a child that
outlives its timeout is killed with its process group.

    run = run_emulated_trials("examples/gpt.py:task", [2, 3], card="h200")
    run.trials[0].peak_bytes, run.trials[0].reserved_bytes
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.core.cards import Card, lookup
from autotune.core.errors import TrialError
from autotune.core.mesh import Mesh
from autotune.core.setup import JobSetup
from autotune.emulation.build import (
    CudaTorch,
    EmulationError,
    EmulationLibraries,
    build_libraries,
    inspect_cuda_torch,
    torch_versions,
)
from autotune.emulation.environment import child_environment

__all__ = [
    "CUDA_PYTHON_VARIABLE",
    "DEFAULT_TIMEOUT_SECONDS",
    "CudaTorchMissing",
    "EmulatedDevice",
    "EmulatedJobError",
    "EmulatedRun",
    "EmulatedTrial",
    "check_emulation",
    "find_cuda_python",
    "keep_children_warm",
    "run_emulated_trials",
]

CUDA_PYTHON_VARIABLE = "AUTOTUNE_CUDA_PYTHON"
# A child's torch import alone costs seconds; a 7B configuration's fake trial about ten.
DEFAULT_TIMEOUT_SECONDS = 600.0
_LOG_PREFIX = "autotune-emulation: "
_REPO = Path(__file__).resolve().parents[2]


class CudaTorchMissing(EmulationError):
    """No Python with a CUDA build of torch was found: the caller falls back to CPU semantics."""


class EmulatedJobError(TrialError):
    """The task's job failed in the child under an emulation that ran (a trial at a size, the task's load): an
    error of the estimate, in one line, never a reason to fall back to CPU semantics. Only what says the
    emulation is not to be had here (an EmulationError: no CUDA build of torch, libraries that do not build, an
    entry point the emulation does not cover, a CUDA runtime failure, a child that died or hung) falls back."""


# The jobs that run the user's task in the child (the check runs none: any failure of it is the emulation's).
_TASK_JOBS = ("search", "trials")
# A child's error that says the CUDA runtime under it failed: the emulation's fault, not the task's.
_RUNTIME_FAILURE = re.compile(
    r"CUDA error|CUDA driver|cuda runtime|cudaError|CUresult|no CUDA GPUs|NVIDIA driver", re.I
)


@dataclass(frozen=True)
class EmulatedTrial:
    """One fake trial on the emulated card.

    Attributes:
        micro_batch: m.
        peak_bytes: the peak of live storage bytes, as the fake meter counts it (the trial's figure).
        forward_backward_bytes, step_bytes: the peaks of the two phases (None after an OOM).
        oom: the live bytes crossed the budget (the trial stops there, and so does its trace).
        seconds: wall time of the trial in the child.
        held: storages live when the trial began (the model's weights, what the wrapper keeps), as
            allocations ``(key, nbytes)`` in the order they were made.
        events: the trial's allocations ``(key, nbytes)`` and releases ``(key, -1)``, in order; keys are
            small integers, one per allocation. ``held + events`` is the whole process's trace.
        ops: with ``record_ops``: every op the trial dispatched, with the dtypes of what it returned.
        streams: the stream of each allocation made off the default stream, by key (FSDP2's collectives).
        reserved_bytes, allocated_bytes: ``max_memory_reserved`` and ``max_memory_allocated`` as the
            caching allocator's model (autotune/core/allocator.py) replays ``held + events`` (on their
            streams) on the
            card (defaults of ``PYTORCH_CUDA_ALLOC_CONF``); the memory outside the allocator is not in them.
    """

    micro_batch: int
    peak_bytes: int
    forward_backward_bytes: int | None
    step_bytes: int | None
    oom: bool
    seconds: float
    held: tuple[tuple[int, int], ...]
    events: tuple[tuple[int, int], ...]
    ops: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    streams: Mapping[int, int] = field(default_factory=dict)
    reserved_bytes: int | None = None
    allocated_bytes: int | None = None


@dataclass(frozen=True)
class EmulatedDevice:
    """What the child's torch read of the emulated card (``get_device_name``, ``get_device_capability``,
    ``get_device_properties``), and which torch it was."""

    card: str
    name: str
    capability: tuple[int, int]
    total_bytes: int
    sm_count: int
    torch_version: str
    cuda_version: str
    python: str


@dataclass(frozen=True)
class EmulatedRun:
    """Fake trials of one task on one emulated card, and what they ran under."""

    task: str
    device: EmulatedDevice
    trials: list[EmulatedTrial]
    warnings: list[str]
    log: list[str]  # the emulation's own lines (entry points it did not cover, refused allocations)


def find_cuda_python() -> str:
    """The Python whose torch is a CUDA build: this one if its torch is, else ``$AUTOTUNE_CUDA_PYTHON``,
    else ``.venv-cuda/bin/python`` of this checkout.

    Raises:
        CudaTorchMissing: none of them exists, in one line saying what to install.
    """
    if _current_torch_is_cuda():
        return sys.executable
    given = os.environ.get(CUDA_PYTHON_VARIABLE)
    if given:
        return given
    local = _REPO / ".venv-cuda" / "bin" / "python"
    if local.exists():
        return str(local)
    raise CudaTorchMissing(
        f"CUDA semantics need a CUDA build of torch: this torch is a CPU build, {CUDA_PYTHON_VARIABLE} is not set "
        f"and {local.parent.parent} does not exist (run `make .venv-cuda`, or point {CUDA_PYTHON_VARIABLE} at a "
        "Python with the CUDA build of torch)"
    )


def _current_torch_is_cuda() -> bool:
    torch = sys.modules.get("torch")
    if torch is not None:
        return getattr(torch.version, "cuda", None) is not None
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return False
    return torch_versions(Path(spec.origin).parent)[1] is not None


def _prepare(card: Card | str, python: str | None) -> tuple[Card, CudaTorch, EmulationLibraries]:
    chosen = lookup(card) if isinstance(card, str) else card
    torch = inspect_cuda_torch(python or find_cuda_python())
    return chosen, torch, build_libraries(torch)


def _run_child(
    card: Card,
    torch: CudaTorch,
    libraries: EmulationLibraries,
    request: dict[str, Any],
    *,
    timeout_seconds: float,
    disable: Sequence[str],
    what: str,
) -> tuple[dict[str, Any], list[str]]:
    """The child's result and the emulation's lines of its log; EmulationError for a child that
    failed, hung or wrote no result, in one line."""
    env = child_environment(card, libraries, driver_version=torch.cudart_version, disable=disable)
    # The child imports this very package: from this checkout, whatever its Python has installed (an
    # installed autotune is the child's own to find).
    if "site-packages" not in str(_REPO):
        env["PYTHONPATH"] = str(_REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    with tempfile.TemporaryDirectory(prefix="autotune-emulation-") as folder:
        request_path, result_path, log_path = (Path(folder) / name for name in ("request.json", "result.json", "log"))
        request_path.write_text(json.dumps(request))
        paths = (request_path, result_path, log_path)
        status = _warm_child(torch.python, env, paths, timeout_seconds) if _KEEP_WARM else None
        if status is None:
            status = _cold_child(torch.python, env, paths, timeout_seconds)
        if status == _TIMED_OUT:
            raise EmulationError(
                f"{what} on an emulated {card.short_name} did not finish within {timeout_seconds:g} s: killed"
            )
        lines = log_path.read_text(errors="replace").splitlines()
        emulation_lines = [line for line in lines if line.startswith(_LOG_PREFIX)]
        if not result_path.is_file():
            last = next((line for line in reversed(lines) if line.strip()), "no output")
            cause = emulation_lines[0] if emulation_lines else last
            raise EmulationError(f"{what} on an emulated {card.short_name} died (exit status {status}): {cause}")
        result: dict[str, Any] = json.loads(result_path.read_text())
    if "error" in result:
        cause = f" ({_uncovered(emulation_lines)})" if emulation_lines else ""
        message = f"{what} on an emulated {card.short_name} failed: {result['error']}{cause}"
        if request.get("job") in _TASK_JOBS and not _emulation_at_fault(str(result["error"]), emulation_lines):
            raise EmulatedJobError(message)
        raise EmulationError(message)
    return result, emulation_lines


# The exit status that stands for a child killed at its timeout.
_TIMED_OUT = -(10**6)


def _cold_child(python: str, env: dict[str, str], paths: tuple[Path, Path, Path], timeout_seconds: float) -> int:
    """A child of its own: ``python -m autotune.emulation.child``; its exit status, or _TIMED_OUT."""
    request_path, result_path, log_path = paths
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [python, "-m", "autotune.emulation.child", str(request_path), str(result_path)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: a timeout kills whatever it started
        )
        try:
            return process.wait(timeout=timeout_seconds)
        except subprocess.TimeoutExpired:
            _kill(process)
            return _TIMED_OUT


# keep_children_warm(): one zygote per (Python, card environment), forking each child (autotune/emulation/zygote.py).
_KEEP_WARM = False
_ZygoteKey = tuple[str, tuple[tuple[str, str], ...]]  # a Python and a card environment
_ZYGOTES: dict[_ZygoteKey, subprocess.Popen[bytes]] = {}


def keep_children_warm(warm: bool = True) -> None:
    """Fork each emulated-card child from a process that has already imported torch, one per card environment,
    instead of starting it cold: 3 s less a child, for a process that runs many (the test suite does). Each
    child is still a fresh process. ``warm=False`` stops the zygotes."""
    global _KEEP_WARM
    _KEEP_WARM = warm
    if not warm:
        _stop_zygotes()


def _stop_zygotes() -> None:
    while _ZYGOTES:
        _, zygote = _ZYGOTES.popitem()
        _stop(zygote)


def _stop(zygote: subprocess.Popen[bytes]) -> None:
    _kill(zygote)
    for pipe in (zygote.stdin, zygote.stdout):
        if pipe is not None:
            pipe.close()


atexit.register(_stop_zygotes)


def _zygote(key: _ZygoteKey, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """The running zygote of key (a Python and a card environment), started where there is none or it died."""
    zygote = _ZYGOTES.get(key)
    if zygote is not None and zygote.poll() is not None:
        _drop(key)
        zygote = None
    if zygote is None:
        zygote = subprocess.Popen(
            [key[0], "-m", "autotune.emulation.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: a line read ahead into a buffer would be invisible to select()
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        _ZYGOTES[key] = zygote
    return zygote


def _drop(key: _ZygoteKey) -> None:
    zygote = _ZYGOTES.pop(key, None)
    if zygote is not None:
        _stop(zygote)


def _line(zygote: subprocess.Popen[bytes], deadline: float) -> int | None:
    """The zygote's next line as an integer; None where it wrote none before the deadline (or died)."""
    assert zygote.stdout is not None
    ready, _, _ = select.select([zygote.stdout], [], [], max(0.0, deadline - time.monotonic()))
    if not ready:
        return None
    line = zygote.stdout.readline()
    return int(line) if line.strip() else None


def _warm_child(python: str, env: dict[str, str], paths: tuple[Path, Path, Path], timeout_seconds: float) -> int | None:
    """The child forked by the card environment's zygote: its exit status, or _TIMED_OUT; None where the zygote
    failed before the child started (the caller starts a cold one)."""
    key = (python, tuple(sorted(env.items())))
    zygote = _zygote(key, env)
    assert zygote.stdin is not None
    deadline = time.monotonic() + timeout_seconds
    try:
        zygote.stdin.write((json.dumps([str(path) for path in paths]) + "\n").encode())
        zygote.stdin.flush()
        pid = _line(zygote, deadline)
    except (OSError, ValueError):
        pid = None
    if pid is None:  # it could not import torch, or died: dropped, and this child starts cold
        _drop(key)
        return None
    status = _line(zygote, deadline)
    if status is not None:
        return status
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if _line(zygote, time.monotonic() + 10) is None:  # the zygote reports the kill; if not, it goes too
        _drop(key)
    return _TIMED_OUT


def _emulation_at_fault(error: str, emulation_lines: list[str]) -> bool:
    """Whether a child's error is the emulation's (an entry point it does not cover, an allocation it refused,
    the CUDA runtime under it failing) rather than the task's own at some size."""
    if any("is not emulated" in line or "refused" in line for line in emulation_lines):
        return True
    return _RUNTIME_FAILURE.search(error) is not None


def _uncovered(lines: list[str]) -> str:
    """The line that names the cause: an entry point the emulation does not cover, else the first."""
    for line in lines:
        if "is not emulated" in line or "refused" in line:
            return line
    return lines[0]


def _kill(process: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def check_emulation(
    card: Card | str,
    *,
    python: str | None = None,
    timeout_seconds: float = 120.0,
    disable: Sequence[str] = (),
) -> EmulatedDevice:
    """Start a child under the emulation of card and check that its torch sees the card: CUDA
    available, the card's name, capability and memory, and a fake step through autograd and AdamW.

    Args:
        card: a Card or a name ``lookup`` takes.
        python: the Python to run (default: :func:`find_cuda_python`).
        disable: emulated entry points to answer as uncovered ones (to test the failure path).

    Raises:
        CudaTorchMissing: no CUDA build of torch here.
        EmulationError: the emulation cannot be built, or the child's torch does not see the card; the
            line names the entry point that failed where one did.
    """
    chosen, torch, libraries = _prepare(card, python)
    found, lines = _run_child(
        chosen, torch, libraries, {"job": "check"}, timeout_seconds=timeout_seconds, disable=disable, what="the check"
    )
    return _device(found, chosen, torch, lines)


def _device(found: dict[str, Any], card: Card, torch: CudaTorch, lines: list[str]) -> EmulatedDevice:
    """What the child read, checked against the card: a runtime the emulation covers only in part
    could read another card's figures (a zero, a default) without failing."""
    device = EmulatedDevice(
        card=card.short_name,
        name=found["name"],
        capability=(int(found["capability"][0]), int(found["capability"][1])),
        total_bytes=int(found["total_bytes"]),
        sm_count=int(found["sm_count"]),
        torch_version=found["torch_version"],
        cuda_version=found["cuda_version"],
        python=torch.python,
    )
    expected = (card.nvml_name, card.compute_capability, card.device_total_bytes, card.sm_count)
    seen = (device.name, device.capability, device.total_bytes, device.sm_count)
    if seen != expected:
        cause = f" ({_uncovered(lines)})" if lines else ""
        raise EmulationError(f"the emulated {card.short_name} reads {seen}, not {expected}{cause}")
    return device


def run_emulated_trials(
    task: str,
    micro_batches: Sequence[int],
    *,
    card: Card | str,
    seq_len: int | None = None,
    strategy: str = "ddp",
    world_size: int = 1,
    precision: str | None = None,
    activation_checkpointing: str | None = None,
    offload: str | None = None,
    mesh: Mesh | None = None,
    record_ops: bool = False,
    python: str | None = None,
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
    disable: Sequence[str] = (),
) -> EmulatedRun:
    """Fake trials of task at each micro-batch size, on an emulated card, in one child process.

    Args:
        task: the task's spec, as ``autotune.tasks.task.load_task`` takes it ("path/file.py:name", "hf:...").
        micro_batches: the sizes, in the order to run them (one model, reused, as the probe does).
        card: a Card or a name ``lookup`` takes; its memory is the fake trials' budget.
        seq_len: a sequence-aware task's length.
        strategy, world_size, mesh: how the ranks hold the model (fake trials of ddp hold DDP's buckets without
            DDP; a mesh's tp or cp rank 0).
        precision, activation_checkpointing, offload: override the task's own (None keeps it).
        record_ops: note every op the trials dispatch and the dtypes they return (``EmulatedTrial.ops``).
        python: the Python to run (default: :func:`find_cuda_python`).
        timeout_seconds: the child is killed past it.
        disable: emulated entry points to answer as uncovered ones (to test the failure path).

    Returns:
        An EmulatedRun: one EmulatedTrial per size, with its trace and, replayed through the caching
        allocator's model, its reserved and allocated peaks.

    Raises:
        CudaTorchMissing: no CUDA build of torch here (the caller falls back to CPU semantics).
        EmulationError: the emulation cannot be built, it failed in the child (one line, naming the entry point
            it did not cover where that was the cause), the child died or outlived timeout_seconds.
        EmulatedJobError: the task failed in the child under an emulation that ran (at a size, at its load).
        ValueError: an unknown card, or a size that is not a positive integer.
    """
    sizes = [int(m) for m in micro_batches]
    if not sizes or any(m < 1 for m in sizes):
        raise ValueError(f"micro-batch sizes must be positive integers, got {list(micro_batches)!r}")
    chosen, torch, libraries = _prepare(card, python)
    request = {
        "job": "trials",
        "task": task,
        "micro_batches": sizes,
        "seq_len": seq_len,
        # The setup, whole and typed (autotune/core/setup.py), as the card's search sends it: the child reads one
        # format for both jobs.
        "setup": JobSetup.model_construct(
            strategy=strategy,
            world_size=world_size,
            mesh=mesh or Mesh(),
            precision=precision,
            activation_checkpointing=activation_checkpointing,
            offload=offload,
        ).model_dump(mode="json"),
        "record_ops": record_ops,
        "budget_bytes": chosen.device_total_bytes,
    }
    what = f"the trials of {task}"
    found, lines = _run_child(
        chosen, torch, libraries, request, timeout_seconds=timeout_seconds, disable=disable, what=what
    )
    trials = [_trial(raw, chosen) for raw in found["trials"]]
    return EmulatedRun(
        task=found["task"],
        device=_device(found["device"], chosen, torch, lines),
        trials=trials,
        warnings=list(found["warnings"]),
        log=lines,
    )


def _trial(raw: dict[str, Any], card: Card) -> EmulatedTrial:
    held = tuple((int(key), int(nbytes)) for key, nbytes in raw["held"])
    events = tuple((int(key), int(nbytes)) for key, nbytes in raw["events"])
    streams = {int(key): int(stream) for key, stream in raw.get("streams", ())}
    reserved, allocated = _replayed(held + events, card, raw["oom"], streams)
    return EmulatedTrial(
        micro_batch=int(raw["micro_batch"]),
        peak_bytes=int(raw["peak_bytes"]),
        forward_backward_bytes=raw["forward_backward_bytes"],
        step_bytes=raw["step_bytes"],
        oom=bool(raw["oom"]),
        seconds=float(raw["seconds"]),
        held=held,
        events=events,
        ops={name: tuple(dtypes) for name, dtypes in raw["ops"].items()},
        streams=streams,
        reserved_bytes=reserved,
        allocated_bytes=allocated,
    )


def _replayed(
    trace: tuple[tuple[int, int], ...], card: Card, oom: bool, streams: dict[int, int]
) -> tuple[int | None, int | None]:
    """The allocator model's peaks for the trace (None after an OOM, whose trace stops short, or where
    this checkout has no allocator model)."""
    if oom:
        return None, None
    try:
        from autotune.core.allocator import AllocatorConfig, replay
    except ImportError:
        return None, None
    config = AllocatorConfig.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    peaks = replay(trace, config, card.device_total_bytes, streams=streams)
    if peaks.oom:
        return None, None
    return peaks.peak_reserved_bytes, peaks.peak_allocated_bytes
