"""The app under test: a real app per test, on a real database (both backends), through TestClient."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from autotune.core.schemas import Profile
from autotune_server import Settings, create_app
from autotune_server.repository import add_profile

WRITE_TOKEN = "write-token-for-tests"
OTHER_WRITE_TOKEN = "second-write-token"
READ_TOKEN = "read-token-for-tests"
WRITE = {"Authorization": f"Bearer {WRITE_TOKEN}"}
READ = {"Authorization": f"Bearer {READ_TOKEN}"}


@pytest.fixture
def settings(database_url: str) -> Settings:
    """Settings for a test app: a fresh database, two named write tokens, one read token."""
    return Settings(
        database_url=database_url,
        api_tokens=(f"ci={WRITE_TOKEN}", f"laptop={OTHER_WRITE_TOKEN}"),
        read_tokens=(READ_TOKEN,),
        max_body_bytes=64 * 1024,
        access_log=False,
    )


@pytest.fixture
def make_client(settings: Settings) -> Iterator[Callable[..., TestClient]]:
    """Build clients on apps with adjusted settings; all are closed (lifespan ended) after the test."""
    opened: list[TestClient] = []

    def build(app: FastAPI | None = None, **overrides: object) -> TestClient:
        target = app if app is not None else create_app(settings.model_copy(update=overrides))
        client = TestClient(target)
        client.__enter__()
        opened.append(client)
        return client

    yield build
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    """A client on the test app (reads open, writes need WRITE)."""
    return make_client()


def store_unchecked(client: TestClient, body: dict[str, Any]) -> int:
    """Store a profile as a server before the consistency checks did (straight into the database,
    past POST /profiles). Returns its id."""
    app: Any = client.app
    with app.state.sessionmaker() as session:
        row, _ = add_profile(session, Profile.model_validate(body), uploader="before-the-checks")
        return int(row.id)
