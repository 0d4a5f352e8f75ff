"""An in-process server for the client tests: the real app on a fresh SQLite file, reached through
Starlette's TestClient (an httpx.Client), so the client's requests meet the real routes and errors."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

WRITE_TOKEN = "client-tests-write-token"
IN_PROCESS_URL = "http://testserver"


@pytest.fixture
def in_process_server(
    _sqlite_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[..., Any]]:
    """Routes every TunerClient the CLI functions build to a real app; yields a TunerClient factory."""
    pytest.importorskip("fastapi", reason="the server extra is not installed")
    from fastapi.testclient import TestClient

    from autotune.cli import client_commands
    from autotune_client import TunerClient
    from autotune_server import Settings, create_app

    path = tmp_path / "store.db"
    shutil.copyfile(_sqlite_template, path)
    settings = Settings(
        database_url=f"sqlite:///{path}", api_tokens=(f"tests={WRITE_TOKEN}",), access_log=False
    )
    with TestClient(create_app(settings), base_url=IN_PROCESS_URL) as app_client:
        # TestClient warns at a per-request timeout, which TunerClient always sends; a plain
        # httpx.Client over the TestClient's own transport (lifespan running) takes it silently.
        http = httpx.Client(transport=app_client._transport)

        def make(**kwargs: Any) -> TunerClient:
            kwargs.setdefault("base_url", IN_PROCESS_URL)
            return TunerClient(**kwargs, http_client=http)

        monkeypatch.setattr(client_commands, "TunerClient", make)
        yield make
        http.close()
