"""Every public module of autotune declares __all__, and every name in it exists."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import autotune

PUBLIC_MODULES = [
    "autotune.schemas",
    "autotune.plan",
    "autotune.split",
    "autotune.files",
    "autotune.diagnose",
    "autotune.search",
    "autotune.task",
    "autotune.fingerprint",
    "autotune.meters",
    "autotune.meters.base",
    "autotune.meters.cpu",
    "autotune.meters.cuda",
    "autotune.trial",
    "autotune.probe",
    "autotune.accumulate",
    "autotune.verify",
    "autotune.errors",
    "autotune.oom",
    "autotune.units",
    "autotune.report",
    "autotune.cli",
    "autotune.cli.common",
    "autotune.cli.parser",
    "autotune.cli.probe",
    "autotune.cli.service",
    "autotune.cli.store",
    "autotune.cli.fleet",
    "autotune.fleet",
    "autotune.fleet.pairs",
    "autotune.fleet.worker",
    "autotune.fleet.progress",
    "autotune.fleet.sink",
    "autotune.fleet.runner",
    "autotune.checkpointing",
    "autotune.recommend",
    "autotune.throughput",
    "autotune.cli.policies",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_declared_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    missing = [symbol for symbol in exported if not hasattr(module, symbol)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, autotune, autotune.schemas, autotune.plan, autotune.units; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_nothing_but_the_fleet_command_imports_ray() -> None:
    """Ray is the fleet extra's: the package, the parser of every command (fleet's included) and the
    fleet's own modules import it only when `autotune fleet` runs."""
    code = (
        "import sys, autotune, autotune.cli, autotune.fleet, autotune_client; "
        "autotune.cli.build_parser(); print('ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _autotune_imports(path: Path, *, lazy: bool) -> set[str]:
    """The autotune modules a file imports at module level, and inside functions too when ``lazy``."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree) if lazy else tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "autotune":
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] == "autotune"}
    return found


def test_the_lower_floor_imports_nothing_above_it() -> None:
    """Each name has one home on the lower floor: the wire schemas import only the split arithmetic,
    which imports nothing of autotune (plan.py and schemas.py once imported each other), and the
    fleet writes files through autotune.files, not through a command module."""
    root = Path(autotune.__file__).parent
    assert _autotune_imports(root / "schemas.py", lazy=True) <= {"autotune.split"}
    assert _autotune_imports(root / "split.py", lazy=True) == set()
    assert _autotune_imports(root / "files.py", lazy=True) == set()
    assert not any(m.startswith("autotune.cli") for m in _autotune_imports(root / "fleet" / "sink.py", lazy=True))


def test_no_two_modules_import_each_other_at_module_level() -> None:
    root = Path(autotune.__file__).parent
    graph: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[name] = _autotune_imports(path, lazy=False)
    pairs = sorted(
        (a, b)
        for a, imports in graph.items()
        for b in imports
        if a < b and a in graph.get(b, set()) and not b.startswith(a + ".") and not a.startswith(b + ".")
    )
    assert pairs == []
