"""The package's public surface: __all__ is complete and true, importing it stays torch-free,
and the error tree is the one drawn in the errors module's docstring."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import autotune_client
import autotune_client._client
import autotune_client._constants
import autotune_client._models
import autotune_client._observer
import autotune_client._suggest
import autotune_client.errors
from autotune.core.errors import AutotuneError

REPO = Path(__file__).resolve().parents[2]
MODULES = [
    autotune_client,
    autotune_client._client,
    autotune_client._constants,
    autotune_client._models,
    autotune_client._suggest,
    autotune_client.errors,
    autotune_client._observer,
]


@pytest.mark.parametrize("module", MODULES, ids=lambda m: m.__name__)
def test_all_names_exist_and_are_documented(module: object) -> None:
    names = module.__all__  # type: ignore[attr-defined]
    assert len(names) == len(set(names))
    assert names == sorted(names)
    for name in names:
        obj = getattr(module, name)
        if callable(obj):  # functions and classes; constants are documented in place
            assert obj.__doc__, f"{module.__name__}.{name} has no docstring"  # type: ignore[attr-defined]


def test_all_lists_every_public_definition_of_the_package() -> None:
    public = {n for n in dir(autotune_client) if not n.startswith("_")}
    # Subpackages a test (or a job) imported become attributes of the package; they are not definitions.
    submodules = {"errors", "integrations"}
    assert public - submodules - {"annotations"} == set(autotune_client.__all__)


def test_importing_the_client_does_not_import_torch() -> None:
    code = "import sys, autotune_client; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_importing_the_client_does_not_import_the_cli() -> None:
    """The command code is autotune.cli's (autotune/cli/client_commands.py); the client sits below it."""
    code = "import sys, autotune_client; print(sorted(m for m in sys.modules if m.startswith('autotune.cli')))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_the_error_tree() -> None:
    e = autotune_client
    assert issubclass(e.AutotuneClientError, AutotuneError)
    assert issubclass(e.APIConnectionError, e.AutotuneClientError)
    assert issubclass(e.APITimeoutError, e.APIConnectionError)
    assert issubclass(e.APIStatusError, e.AutotuneClientError)
    assert not issubclass(e.APIStatusError, e.APIConnectionError)
    for cls in (
        e.BadRequestError,
        e.AuthenticationError,
        e.PermissionDeniedError,
        e.NotFoundError,
        e.ConflictError,
        e.UnprocessableEntityError,
        e.RateLimitError,
        e.InternalServerError,
    ):
        assert issubclass(cls, e.APIStatusError)
        assert cls.__name__ in autotune_client.errors.__doc__  # drawn in the docstring


def test_defaults_live_in_the_constants_module() -> None:
    from autotune_client import TunerClient

    client = TunerClient(base_url="http://x")
    try:
        assert client.timeout == autotune_client._constants.DEFAULT_TIMEOUT_SECONDS
        assert client.max_retries == autotune_client._constants.DEFAULT_MAX_RETRIES
    finally:
        client.close()
