"""Settings from the environment, the public names of every server module, and the entry points."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import autotune_server
from autotune_server import Settings
from autotune_server.db import make_engine


def test_settings_come_from_autotune_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_DATABASE_URL", "postgresql+psycopg://u@h/db")
    monkeypatch.setenv("AUTOTUNE_API_TOKENS", "ci=abc, def ,")
    monkeypatch.setenv("AUTOTUNE_READ_TOKEN_REQUIRED", "true")
    monkeypatch.setenv("AUTOTUNE_MAX_BODY_BYTES", "4096")
    settings = Settings()
    assert settings.database_url == "postgresql+psycopg://u@h/db"
    assert settings.api_tokens == ("ci=abc", "def")
    assert settings.read_token_required is True
    assert settings.max_body_bytes == 4096
    names = settings.write_token_names()
    assert names["abc"] == "ci"
    assert names["def"].startswith("token-") and "def" not in names["def"]


def test_default_database_is_a_sqlite_file_under_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_DATABASE_URL", raising=False)
    assert Settings().database_url == "sqlite:///./var/autotune.db"


def test_sqlite_engine_creates_its_folder_and_uses_wal(tmp_path: Path) -> None:
    from sqlalchemy import text

    db = tmp_path / "a" / "b" / "store.db"
    engine = make_engine(f"sqlite:///{db}", busy_timeout_seconds=7)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
            assert conn.execute(text("PRAGMA busy_timeout")).scalar() == 7000
            assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1
    finally:
        engine.dispose()
    assert db.parent.is_dir()


def _modules() -> list[str]:
    names = ["autotune_server"]
    for info in pkgutil.walk_packages(autotune_server.__path__, "autotune_server."):
        if ".migrations" not in info.name and info.name != "autotune_server.__main__":
            names.append(info.name)
    return names


@pytest.mark.parametrize("name", _modules())
def test_every_module_declares_all_and_documents_it(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no docstring"
    exported = getattr(module, "__all__", None)
    assert exported is not None, f"{name} has no __all__"
    for public in exported:
        obj = getattr(module, public)  # every listed name exists
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__, f"{name}.{public} has no docstring"


def test_every_route_has_its_one_line_docstring_as_openapi_summary() -> None:
    from autotune_server import create_app

    schema = create_app(Settings(database_url="sqlite://")).openapi()
    operations = [(m, p, op) for p, ops in schema["paths"].items() for m, op in ops.items()]
    assert len(operations) >= 10  # healthz, readyz, metrics and the seven API operations
    for method, path, operation in operations:
        summary = operation.get("summary", "")
        assert summary and "\n" not in summary, f"{method} {path}"
        assert summary == operation["description"].split("\n", 1)[0], f"{method} {path}"
    suggest = schema["paths"]["/api/v1/suggest"]["get"]
    assert suggest["summary"].startswith("The plan for a job")


def test_runner_refuses_zero_workers() -> None:
    from autotune_server.runner import serve

    with pytest.raises(ValueError, match="workers"):
        serve(host="127.0.0.1", port=0, workers=0, database_url="sqlite://")
