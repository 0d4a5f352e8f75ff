"""A busy server (503 ``server_busy``): the client waits its Retry-After, spread by jitter, and retries
within its timeout beyond ``max_retries``; a database outage's 503 keeps the ordinary retry count."""

from __future__ import annotations

import time

import httpx2 as httpx
import pytest

from autotune_client import InternalServerError
from autotune_client._constants import BUSY_ERROR_CODE, BUSY_RETRY_JITTER_FRACTION
from tests.client._factories import error_body, json_response, make_suggestion, mock_client, sequence

SUGGEST_ARGS = {"fingerprint": "ab" * 32, "target_batch": 128, "world_size": 2, "device_name": "cpu"}


def _busy(retry_after: str = "1") -> httpx.Response:
    body = error_body(BUSY_ERROR_CODE, "the server is busy: nothing was done; try again in 1 s")
    return json_response(503, body, headers={"Retry-After": retry_after})


def _ok() -> httpx.Response:
    return json_response(200, make_suggestion().model_dump(mode="json"))


def test_busy_answers_are_retried_past_max_retries_after_their_retry_after() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(_busy(), _busy(), _busy(), _busy(), _ok())
    with mock_client(handler, max_retries=2, sleeps=sleeps) as client:
        suggestion = client.suggest(**SUGGEST_ARGS)
    assert suggestion.source == make_suggestion().source
    assert len(seen) == 5  # four busy answers, then the plan: more than 1 + max_retries attempts
    assert sleeps == [1.0, 1.0, 1.0, 1.0]  # mock_client draws no jitter: exactly what the server asked


def test_a_busy_wait_is_lengthened_by_up_to_its_jitter_fraction_never_shortened() -> None:
    sleeps: list[float] = []
    handler, _ = sequence(_busy("2"), _busy("2"), _ok())
    with mock_client(handler, sleeps=sleeps) as client:
        draws = iter([1.0, 0.5])
        client._random = lambda: next(draws)
        client.suggest(**SUGGEST_ARGS)
    assert sleeps == [2.0 * (1 + BUSY_RETRY_JITTER_FRACTION), 2.0 * (1 + 0.5 * BUSY_RETRY_JITTER_FRACTION)]


def test_max_retries_zero_never_retries_even_a_busy_server() -> None:
    handler, seen = sequence(_busy())
    with mock_client(handler, max_retries=0) as client, pytest.raises(InternalServerError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert info.value.status_code == 503 and info.value.code == BUSY_ERROR_CODE
    assert len(seen) == 1


def test_a_database_outage_keeps_the_ordinary_retry_count() -> None:
    down = json_response(503, error_body("database_unavailable", "down"), headers={"Retry-After": "2"})
    handler, seen = sequence(down, down, down)
    with mock_client(handler, max_retries=2) as client, pytest.raises(InternalServerError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert info.value.code == "database_unavailable"
    assert len(seen) == 3


def test_a_server_busy_for_longer_than_the_timeout_fails_within_it() -> None:
    handler, seen = sequence(*[_busy("0.1")] * 100)
    client = mock_client(handler, max_retries=1, timeout=1.0)
    client._sleep = time.sleep  # real waits: the deadline is the client's monotonic clock
    start = time.monotonic()
    with client, pytest.raises(InternalServerError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert time.monotonic() - start < 1.5
    assert info.value.code == BUSY_ERROR_CODE
    assert len(seen) > 2  # beyond max_retries, until the timeout
