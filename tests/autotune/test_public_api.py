"""Every public module of autotune declares __all__, and every name in it exists."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PUBLIC_MODULES = [
    "autotune.schemas",
    "autotune.plan",
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
