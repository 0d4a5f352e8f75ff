"""What the libraries autotune drives print on their own: kept off the user's terminal unless asked (issue 41).

torch's logging (``W1204 ... _pytree.py:630] ... Enum subclass ...``), Kineto's profiler lines
(``USDT:... SyncActivityProfilerHandler.cpp ... profiler_start``, the compiled meter reads the allocator through the
profiler), c10's C++ warnings, the libraries' Python warnings about themselves (torch's AOT autograd cache on
torchao's states) and the "Failed to load ..." lines torchao and bitsandbytes log on import say nothing about the job.
``autotune`` run from a terminal quiets them (``autotune -v`` keeps them); the processes it starts (fake lanes'
workers, the emulated card's child, real-process ranks) inherit the environment and quiet their own Python loggers and
warnings (:func:`quiet_if_asked`). A variable the user set stays as set.

Torch-free: the environment must be set before torch is imported.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["QUIET_VARIABLE", "quiet_if_asked", "quiet_library_logs", "quiet_native_stderr"]

# Set by the CLI for the processes it starts.
QUIET_VARIABLE = "AUTOTUNE_LIBRARY_LOGS"
# Python loggers of the libraries whose import or use logs warnings about themselves, not about the job.
_LOGGERS = ("torch", "torchao", "bitsandbytes", "transformers", "accelerate", "peft", "lightning")
# The modules of those libraries, for the warnings filter (matched from the start of a warning's module name).
_LIBRARY_MODULES = rf"({'|'.join(_LOGGERS)})(\.|$)"
_ENVIRONMENT = {
    "TORCH_LOGS": "-all",  # torch's own logging (dynamo, inductor, the pytree registry) below ERROR
    "KINETO_LOG_LEVEL": "4",  # the profiler's C++ lines (USDT, SyncActivityProfilerHandler): errors only
    "TORCH_CPP_LOG_LEVEL": "ERROR",  # c10's C++ warnings
    # transformers sets its root logger's level from this when it first logs, over a level set before its import.
    "TRANSFORMERS_VERBOSITY": "error",
}


def quiet_library_logs() -> None:
    """Quiet the libraries' own logs in this process and the processes it starts."""
    os.environ[QUIET_VARIABLE] = "quiet"
    for name, value in _ENVIRONMENT.items():
        if not os.environ.get(name):  # an empty TORCH_LOGS breaks torch's import: set, never left empty
            os.environ[name] = value
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Their Python warnings too (torch's AOT autograd cache on torchao's OptimState4bit: "does not implement
    # _stable_hash_for_caching"): those raised in their own modules, not those they raise on a caller's behalf
    # (attributed to the caller's module: the task's code, autotune's).
    warnings.filterwarnings("ignore", module=_LIBRARY_MODULES)


def quiet_if_asked() -> None:
    """In a process autotune started: quiet the libraries' Python loggers where the CLI quieted its own."""
    if os.environ.get(QUIET_VARIABLE) == "quiet":
        quiet_library_logs()


@contextmanager
def quiet_native_stderr() -> Iterator[None]:
    """Where the libraries' logs are quieted: the process's stderr (fd 2) sent to /dev/null around a native call
    that prints with no switch to stop it (Kineto's ``USDT: ... profiler_start`` / ``profiler_stop`` lines, which
    no environment variable silences). Keep the span to the call: what else is printed meanwhile is lost too."""
    if os.environ.get(QUIET_VARIABLE) != "quiet":
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as devnull:
            os.dup2(devnull.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
