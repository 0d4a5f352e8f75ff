"""Many writers at once: uniqueness and idempotency hold in the database, not in one process.

Two separate app instances (two engines, two pools) share each database, and 200 uploads come from
32 threads spread over both, so neither an in-process lock nor a per-app cache could be what keeps
one profile to one row.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from tests.factories import profile_payload
from tests.server.conftest import WRITE

UPLOADS = 200
THREADS = 32


def _upload_all(clients: list[TestClient], bodies: list[dict[str, object]]) -> list[tuple[int, int]]:
    # FastAPI builds each router's routes lazily on the first request, silencing a pydantic warning
    # with warnings.catch_warnings(), which is not thread-safe: two apps doing it at once in two
    # threads can let the warning escape (an error under pytest). Warm each app up first, one by one.
    for client in clients:
        assert client.get("/api/v1/profiles").status_code == 200

    def one(i: int) -> tuple[int, int]:
        response = clients[i % len(clients)].post("/api/v1/profiles", json=bodies[i], headers=WRITE)
        return response.status_code, int(response.json().get("id", -1))

    with ThreadPoolExecutor(max_workers=THREADS) as pool:
        return list(pool.map(one, range(len(bodies))))


def _row_count(client: TestClient) -> int:
    from sqlalchemy import func, select

    from autotune_server.models import ProfileRow, TrialRow

    with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        profiles = int(session.scalar(select(func.count()).select_from(ProfileRow)) or 0)
        trials = int(session.scalar(select(func.count()).select_from(TrialRow)) or 0)
    assert trials == 5 * profiles  # each factory profile has 5 trials: none lost, none duplicated
    return profiles


def test_200_concurrent_distinct_uploads_leave_200_rows(make_client: Callable[..., TestClient]) -> None:
    clients = [make_client(), make_client()]
    results = _upload_all(clients, [profile_payload(seed=i) for i in range(UPLOADS)])
    assert Counter(status for status, _ in results) == {201: UPLOADS}
    assert len({profile_id for _, profile_id in results}) == UPLOADS
    assert _row_count(clients[0]) == UPLOADS


def test_200_concurrent_uploads_of_one_profile_leave_one_row(make_client: Callable[..., TestClient]) -> None:
    clients = [make_client(), make_client()]
    body = profile_payload(seed=7)
    results = _upload_all(clients, [body] * UPLOADS)
    statuses = Counter(status for status, _ in results)
    assert statuses[201] == 1
    assert statuses[200] == UPLOADS - 1
    assert len({profile_id for _, profile_id in results}) == 1
    assert _row_count(clients[0]) == 1


def test_lost_race_on_insert_is_read_as_already_stored(
    make_client: Callable[..., TestClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Force the situation two racing uploads create: the look-up misses, the insert hits the unique
    # index. The IntegrityError must become the idempotent 200, not a 500.
    from autotune_server import repository

    client = make_client()
    body = profile_payload(seed=3)
    assert client.post("/api/v1/profiles", json=body, headers=WRITE).status_code == 201
    real = repository._by_hash
    calls: list[str] = []

    def miss_first(session: object, digest: str) -> object:
        calls.append(digest)
        return None if len(calls) == 1 else real(session, digest)  # type: ignore[arg-type]

    monkeypatch.setattr(repository, "_by_hash", miss_first)
    again = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert again.status_code == 200
    assert again.json()["created"] is False
    assert len(calls) == 2  # the fallback look-up after the IntegrityError ran
    assert _row_count(client) == 1
