"""Loading a task from its spec: "path/to/file.py:name", "package.module:name" or "hf:CONFIG".

Above both kinds of task it loads (``task``'s ProbeTask and ``hf``'s builders), so that neither of them
imports the other's module to dispatch.

A task file's folder is importable while the file loads, as ``python file.py`` makes it: ``from model
import GPT`` in a task file next to ``model.py`` finds it. The folder goes first on ``sys.path`` for the
import and the call of the task's factory, then leaves it again, so that it does not stay on the path of
every later import of the process. Modules the file imported from its folder are then dropped from
``sys.modules`` (the task's objects keep them alive): a second task file elsewhere with its own
``model.py`` gets its own, not the first one's. A module already imported (``torch``, ``autotune``) is never
shadowed by a file of the same name in the folder, as in Python itself; a module first imported inside the
task's ``model()`` or ``batch()`` at trial time is not found there: import it at the file's top.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from autotune.core.errors import TaskError
from autotune.tasks.hf import is_hf_spec, load_hf_spec
from autotune.tasks.task import ProbeTask

__all__ = ["load_task"]


def load_task(spec: str) -> ProbeTask:
    """Load "path/to/file.py:name" or "package.module:name".

    ``name`` is a ProbeTask or a zero-argument callable returning one. Without ":name" the
    module's ``task`` attribute is used.

    ``hf:path/to/config.json`` (or ``hf:DIRECTORY``) builds a causal LM from a Hugging Face config
    instead (:mod:`autotune.tasks.hf`; needs the ``hf`` extra).

    Raises:
        TaskError: with what was looked for and why it failed, in one line.
    """
    if is_hf_spec(spec):
        return dataclasses.replace(load_hf_spec(spec), source=spec)
    module_part, _, attr = spec.rpartition(":") if ":" in spec else (spec, "", "task")
    attr = attr or "task"
    if not module_part:
        raise TaskError(f"task {spec!r} is not of the form path/to/file.py:name or package.module:name")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise TaskError(f"task file {module_part!r} not found (from {spec!r})")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        mod_name = f"_autotune_task_{path.stem}_{digest}"
        mod_spec = importlib.util.spec_from_file_location(mod_name, path)
        if mod_spec is None or mod_spec.loader is None:
            raise TaskError(f"cannot import {module_part!r} as Python (from {spec!r})")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[mod_name] = module
        with _folder_importable(path.resolve().parent):
            try:
                mod_spec.loader.exec_module(module)
            except SystemExit as exc:  # sys.exit() at import would end autotune itself, silently with 0
                sys.modules.pop(mod_name, None)
                raise _exited(spec, f"importing {module_part!r}", exc) from None
            except Exception as exc:  # the user's module failed at import: say where, in one line
                sys.modules.pop(mod_name, None)
                raise TaskError(f"importing {module_part!r} failed: {type(exc).__name__}: {_one_line(exc)}") from exc
            return _task_from(module, spec, module_part, attr)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            raise TaskError(f"module {module_part!r} not found (from {spec!r}): {exc}") from exc
        except SystemExit as exc:
            raise _exited(spec, f"importing {module_part!r}", exc) from None
        except Exception as exc:
            raise TaskError(f"importing {module_part!r} failed: {type(exc).__name__}: {_one_line(exc)}") from exc
    return _task_from(module, spec, module_part, attr)


def _task_from(module: object, spec: str, module_part: str, attr: str) -> ProbeTask:
    """The module's ``attr``: a ProbeTask, or a zero-argument callable returning one (called here)."""
    if not hasattr(module, attr):
        raise TaskError(f"{module_part!r} has no attribute {attr!r} (from {spec!r})")
    obj = getattr(module, attr)
    if not isinstance(obj, ProbeTask) and callable(obj):
        try:
            obj = obj()
        except SystemExit as exc:
            raise _exited(spec, f"calling {attr}()", exc) from None
        except Exception as exc:
            raise TaskError(f"{spec!r}() failed: {type(exc).__name__}: {_one_line(exc)}") from exc
    if not isinstance(obj, ProbeTask):
        raise TaskError(f"{spec!r} is a {type(obj).__name__}, not a ProbeTask or a callable returning one")
    return dataclasses.replace(obj, source=spec)


@contextmanager
def _folder_importable(folder: Path) -> Iterator[None]:
    """``folder`` first on sys.path while the task file loads (``python file.py``'s rule), then off it,
    with the modules imported from it out of sys.modules (see the module docstring for why)."""
    entry = str(folder)
    before = set(sys.modules)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)
        # Only packages that were new to the process: a submodule of autotune or torch imported for the
        # first time here stays (the folder may hold the project itself, and a second copy of its classes
        # would fail every isinstance check).
        for name in set(sys.modules) - before:
            top = name.partition(".")[0]
            if top not in before and not top.startswith("_autotune_task_") and _lies_in(sys.modules.get(name), folder):
                sys.modules.pop(name, None)


def _lies_in(module: object, folder: Path) -> bool:
    file = getattr(module, "__file__", None)
    if not file:
        return False
    try:
        return Path(file).resolve().is_relative_to(folder)
    except (OSError, ValueError):
        return False


def _exited(spec: str, doing: str, exc: SystemExit) -> TaskError:
    """A task that calls sys.exit() while it loads: an error naming it (autotune, not the task, decides when
    to exit; a script's ``if __name__ == "__main__"`` guard keeps its own exit out of an import)."""
    return TaskError(
        f"task {spec!r}: {doing} called sys.exit({exc.code!r}): a task file must not exit when imported "
        "(put the script's part under if __name__ == '__main__':)"
    )


def _one_line(exc: BaseException) -> str:
    """The error's message on one line (a multi-line message's lines joined)."""
    return " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
