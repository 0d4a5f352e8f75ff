"""The client against a store whose database is down: 503 retried after its Retry-After (within the
call's timeout, whatever the method), 507 not retried, and suggest() falling back to a local probe."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.core.schemas import Observation
from autotune_client import InternalServerError, TunerUnavailableWarning, suggest
from tests.client._factories import (
    error_body,
    json_response,
    make_profile,
    mock_client,
    sequence,
)
from tests.client.test_client_suggest import FakeProbe, fake_probe, tiny_batch, tiny_model

__all__ = ["fake_probe"]  # the fixture, imported for the fallback test

DOWN = error_body("database_unavailable", "the database is not reachable; try again in 2 s")
FULL = error_body("database_full", "the database's disk is full: nothing more can be stored")
RETRY_AFTER = {"Retry-After": "2"}


def _stored(profile_id: int = 7) -> Any:
    return json_response(201, {"id": profile_id, "content_hash": "ab" * 32, "created": True, "url": "/x"})


@pytest.fixture(autouse=True)
def _no_ambient_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_URL", "AUTOTUNE_TOKEN", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_a_503_upload_is_retried_after_its_retry_after() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(json_response(503, DOWN, headers=RETRY_AFTER), _stored())
    with mock_client(handler, sleeps=sleeps) as client:
        assert client.upload(make_profile()) == 7
    assert sleeps == [2.0]
    assert [r.method for r in seen] == ["POST", "POST"]


def test_a_503_observation_is_retried_although_observations_are_not_idempotent() -> None:
    # 503 says the server did not process the request: retrying cannot store it twice.
    sleeps: list[float] = []
    handler, seen = sequence(
        json_response(503, DOWN, headers=RETRY_AFTER),
        json_response(201, {"id": 3, "profile_id": 5, "micro_batch": 8, "oom": True}),
    )
    with mock_client(handler, sleeps=sleeps) as client:
        assert client.observe(5, Observation(micro_batch=8, oom=True)) == 3
    assert sleeps == [2.0] and len(seen) == 2


def test_retry_after_is_lengthened_by_jitter_never_shortened() -> None:
    sleeps: list[float] = []
    handler, _ = sequence(json_response(503, DOWN, headers=RETRY_AFTER), _stored())
    with mock_client(handler, sleeps=sleeps) as client:
        client._random = lambda: 1.0  # the largest jitter
        client.upload(make_profile())
    assert sleeps == [2.5]


def test_jitter_never_pushes_a_retry_past_the_call_timeout() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(json_response(503, DOWN, headers=RETRY_AFTER), _stored())
    with mock_client(handler, sleeps=sleeps, timeout=2.4) as client:
        client._random = lambda: 1.0
        client.upload(make_profile())
    assert sleeps == [2.0]  # 2.5 would overrun the 2.4 s timeout; the server's 2 s fits
    assert len(seen) == 2


def test_a_retry_after_past_the_timeout_fails_at_once_with_the_servers_reason() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(json_response(503, DOWN, headers=RETRY_AFTER))
    with mock_client(handler, sleeps=sleeps, timeout=1.5) as client, pytest.raises(InternalServerError) as info:
        client.upload(make_profile())
    assert sleeps == [] and len(seen) == 1
    assert info.value.status_code == 503 and info.value.code == "database_unavailable"
    assert "not reachable" in str(info.value)


def test_a_full_store_is_not_retried() -> None:
    handler, seen = sequence(json_response(507, FULL))
    with mock_client(handler) as client, pytest.raises(InternalServerError) as info:
        client.upload(make_profile())
    assert len(seen) == 1
    assert info.value.status_code == 507 and info.value.code == "database_full"


def test_suggest_falls_back_to_a_local_probe_while_the_store_is_down(fake_probe: FakeProbe) -> None:
    sleeps: list[float] = []
    handler, seen = sequence(*[json_response(503, DOWN, headers=RETRY_AFTER)] * 3)
    with (
        mock_client(handler, sleeps=sleeps) as client,
        pytest.warns(TunerUnavailableWarning) as warned,
    ):
        got = suggest(tiny_model(), 40, example=tiny_batch, budget="8MiB", client=client)
    assert got.source == "probed" and got.profile_id is None
    assert len(fake_probe.calls) == 1
    # Three asks, each after the server's 2 s, and no upload to a store that is down (as for a 500).
    assert [r.method for r in seen] == ["GET"] * 3
    assert sleeps == [2.0] * 2
    assert any("503" in str(w.message) for w in warned)
