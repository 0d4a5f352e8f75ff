"""The integrations' public surface: __all__ sorted, true and documented; importing the client or the
integrations package imports neither framework (each module imports its own)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def _modules() -> list[ModuleType]:
    import autotune.tasks.hf
    import autotune_client._distributed
    import autotune_client.integrations
    import autotune_client.integrations._common

    modules: list[ModuleType] = [
        autotune.tasks.hf,
        autotune_client._distributed,
        autotune_client.integrations,
        autotune_client.integrations._common,
    ]
    try:
        import autotune_client.integrations.lightning

        modules.append(autotune_client.integrations.lightning)
    except ImportError:
        pass
    try:
        import autotune_client.integrations.transformers

        modules.append(autotune_client.integrations.transformers)
    except ImportError:
        pass
    return modules


@pytest.mark.parametrize("module", _modules(), ids=lambda m: m.__name__)
def test_all_names_exist_are_sorted_and_documented(module: ModuleType) -> None:
    names = module.__all__
    assert names == sorted(set(names))
    for name in names:
        obj = getattr(module, name)
        if callable(obj):
            assert obj.__doc__, f"{module.__name__}.{name} has no docstring"


def test_the_client_and_the_integrations_package_import_no_framework() -> None:
    code = (
        "import sys, json, autotune_client, autotune_client.integrations, autotune.tasks.hf\n"
        "names = ('lightning', 'pytorch_lightning', 'transformers', 'torch')\n"
        "print(json.dumps([m for m in names if m in sys.modules]))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
