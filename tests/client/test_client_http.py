"""TunerClient over a mock transport: retries, back-off, Retry-After, the error tree, the methods."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest

from autotune.core.errors import AutotuneError
from autotune.core.schemas import Observation
from autotune_client import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    AutotuneClientError,
    BadRequestError,
    ConflictError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    TunerClient,
    UnprocessableEntityError,
)
from autotune_client._constants import (
    INITIAL_RETRY_DELAY_SECONDS,
    MAX_RETRY_DELAY_SECONDS,
    RETRY_JITTER_FRACTION,
)
from tests.client._factories import (
    BASE_URL,
    FINGERPRINT,
    error_body,
    json_response,
    make_profile,
    make_suggestion,
    mock_client,
    sequence,
)

SUGGEST_ARGS = {"fingerprint": FINGERPRINT, "target_batch": 128, "world_size": 2, "device_name": "cpu"}


def test_suggest_sends_the_query_and_parses_the_answer() -> None:
    expected = make_suggestion()
    handler, seen = sequence(json_response(200, expected.model_dump(mode="json")))
    with mock_client(handler) as client:
        got = client.suggest(**SUGGEST_ARGS, budget_bytes=1 << 30, headroom=0.2)
    assert got == expected
    (request,) = seen
    assert request.url.path == "/api/v1/suggest"
    assert dict(request.url.params) == {
        "fingerprint": FINGERPRINT,
        "target_batch": "128",
        "world_size": "2",
        "device_name": "cpu",
        "budget_bytes": str(1 << 30),
        "headroom": "0.2",
    }


def test_optional_query_parameters_are_left_out_when_none() -> None:
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    with mock_client(handler) as client:
        client.suggest(**SUGGEST_ARGS)
    assert "budget_bytes" not in seen[0].url.params
    assert "headroom" not in seen[0].url.params


@pytest.mark.parametrize("status", [500, 502, 503, 504, 408])
def test_transient_statuses_are_retried_until_success(status: int) -> None:
    sleeps: list[float] = []
    handler, seen = sequence(
        json_response(status, error_body("x", "busy")),
        json_response(status, error_body("x", "busy")),
        json_response(200, make_suggestion().model_dump(mode="json")),
    )
    with mock_client(handler, sleeps=sleeps) as client:
        assert client.suggest(**SUGGEST_ARGS).micro_batch == 16
    assert len(seen) == 3
    # Exponential: the second wait doubles the first (jitter pinned to zero by the factory).
    assert sleeps == [INITIAL_RETRY_DELAY_SECONDS, 2 * INITIAL_RETRY_DELAY_SECONDS]


def test_retries_stop_at_max_retries_and_raise_the_last_error() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(*[json_response(500, error_body("internal_error", "internal server error"))] * 3)
    with (
        mock_client(handler, max_retries=2, sleeps=sleeps) as client,
        pytest.raises(InternalServerError) as info,
    ):
        client.suggest(**SUGGEST_ARGS)
    assert len(seen) == 3
    assert len(sleeps) == 2
    assert info.value.status_code == 500
    assert "internal server error" in str(info.value)


def test_max_retries_zero_makes_one_attempt() -> None:
    handler, seen = sequence(json_response(503, error_body("x", "down")))
    with mock_client(handler, max_retries=0) as client, pytest.raises(InternalServerError):
        client.suggest(**SUGGEST_ARGS)
    assert len(seen) == 1


def test_connection_errors_are_retried_then_raised_as_api_connection_error() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(*[httpx.ConnectError("connection refused")] * 3)
    with mock_client(handler, sleeps=sleeps) as client, pytest.raises(APIConnectionError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert not isinstance(info.value, APITimeoutError)
    assert len(seen) == 3
    assert "connection refused" in str(info.value)
    assert BASE_URL in str(info.value)


def test_a_connection_error_then_success_recovers() -> None:
    handler, seen = sequence(
        httpx.ConnectError("refused"), json_response(200, make_suggestion().model_dump(mode="json"))
    )
    with mock_client(handler) as client:
        assert client.suggest(**SUGGEST_ARGS).source == "measured"
    assert len(seen) == 2


def test_read_timeouts_become_api_timeout_error() -> None:
    handler, seen = sequence(*[httpx.ReadTimeout("timed out")] * 3)
    with mock_client(handler) as client, pytest.raises(APITimeoutError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert isinstance(info.value, APIConnectionError)  # the tree: a timeout is a connection error
    assert len(seen) == 3


def test_retry_after_seconds_is_honoured() -> None:
    sleeps: list[float] = []
    handler, _ = sequence(
        json_response(429, error_body("rate_limited", "slow down"), headers={"Retry-After": "1.5"}),
        json_response(200, make_suggestion().model_dump(mode="json")),
    )
    with mock_client(handler, sleeps=sleeps) as client:
        client.suggest(**SUGGEST_ARGS)
    assert sleeps == [1.5]


def test_retry_after_as_http_date_is_honoured() -> None:
    sleeps: list[float] = []
    when = httpx.Headers({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"})  # in the past: retry now
    handler, _ = sequence(
        json_response(503, error_body("x", "down"), headers=dict(when)),
        json_response(200, make_suggestion().model_dump(mode="json")),
    )
    with mock_client(handler, sleeps=sleeps) as client:
        client.suggest(**SUGGEST_ARGS)
    assert sleeps == [0.0]


def test_a_retry_after_beyond_the_call_timeout_fails_at_once_instead_of_waiting() -> None:
    sleeps: list[float] = []
    handler, seen = sequence(
        json_response(429, error_body("rate_limited", "slow down"), headers={"Retry-After": "30"})
    )
    with mock_client(handler, timeout=2.0, sleeps=sleeps) as client, pytest.raises(RateLimitError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert sleeps == []
    assert len(seen) == 1
    assert info.value.code == "rate_limited"


def test_back_off_is_capped_and_jittered_downwards() -> None:
    client = TunerClient(base_url=BASE_URL)
    try:
        client._random = lambda: 1.0  # the largest jitter
        assert client._retry_delay(0, None) == pytest.approx(
            INITIAL_RETRY_DELAY_SECONDS * (1 - RETRY_JITTER_FRACTION)
        )
        client._random = lambda: 0.0
        assert client._retry_delay(30, None) == MAX_RETRY_DELAY_SECONDS
        client._random = __import__("random").random
        delays = {client._retry_delay(2, None) for _ in range(50)}
        assert len(delays) > 1  # real jitter: a sweep's jobs do not retry in lock-step
        assert all(
            4 * INITIAL_RETRY_DELAY_SECONDS * (1 - RETRY_JITTER_FRACTION)
            <= d
            <= 4 * INITIAL_RETRY_DELAY_SECONDS
            for d in delays
        )
    finally:
        client.close()


@pytest.mark.parametrize(
    ("status", "cls"),
    [
        (400, BadRequestError),
        (401, AuthenticationError),
        (403, PermissionDeniedError),
        (404, NotFoundError),
        (409, ConflictError),
        (422, UnprocessableEntityError),
        (418, APIStatusError),
    ],
)
def test_client_errors_are_typed_and_not_retried(status: int, cls: type[APIStatusError]) -> None:
    body = error_body("some_code", "what went wrong", field="target_batch")
    handler, seen = sequence(json_response(status, body))
    with mock_client(handler) as client, pytest.raises(cls) as info:
        client.suggest(**SUGGEST_ARGS)
    assert len(seen) == 1
    err = info.value
    assert type(err) is cls
    assert err.status_code == status
    assert err.body == body
    assert err.code == "some_code"
    assert err.field == "target_batch"
    assert str(err) == f"GET /api/v1/suggest: {status} what went wrong"
    assert isinstance(err, AutotuneClientError) and isinstance(err, AutotuneError)


def test_a_non_json_error_body_is_kept_as_text_and_the_message_stays_one_line() -> None:
    page = "<html>\n<body>\n" + "bad gateway " * 100 + "</body></html>"
    handler, _ = sequence(httpx.Response(400, text=page))
    with mock_client(handler) as client, pytest.raises(BadRequestError) as info:
        client.suggest(**SUGGEST_ARGS)
    assert info.value.body == page
    assert "\n" not in str(info.value)
    assert len(str(info.value)) < 300


def test_the_token_is_sent_as_a_bearer_header() -> None:
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    with mock_client(handler, token="s3cret") as client:
        client.suggest(**SUGGEST_ARGS)
    assert seen[0].headers["Authorization"] == "Bearer s3cret"


def test_no_token_sends_no_authorization_header(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_TOKEN", raising=False)
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    with mock_client(handler) as client:
        client.suggest(**SUGGEST_ARGS)
    assert "Authorization" not in seen[0].headers


def test_environment_fallbacks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_URL", "http://from-env:9000/api/v1/")
    monkeypatch.setenv("AUTOTUNE_TOKEN", "env-token")
    with TunerClient() as client:
        assert client.base_url == "http://from-env:9000"
        assert client.token == "env-token"
    with TunerClient(base_url="http://explicit:1", token="t") as client:
        assert (client.base_url, client.token) == ("http://explicit:1", "t")


def test_no_url_anywhere_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_URL", raising=False)
    with pytest.raises(AutotuneClientError, match="AUTOTUNE_URL"):
        TunerClient()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"base_url": "tuner:8765"}, "http://"),
        ({"base_url": BASE_URL, "timeout": 0}, "timeout"),
        ({"base_url": BASE_URL, "max_retries": -1}, "max_retries"),
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(AutotuneClientError, match=match):
        TunerClient(**kwargs)  # type: ignore[arg-type]


def test_the_context_manager_closes_its_own_pool_but_not_an_injected_one() -> None:
    with TunerClient(base_url=BASE_URL) as own:
        pass
    assert own._http.is_closed
    injected = httpx.Client(transport=httpx.MockTransport(lambda r: httpx.Response(200)))
    with TunerClient(base_url=BASE_URL, http_client=injected):
        pass
    assert not injected.is_closed
    injected.close()


def test_upload_returns_the_id_and_is_idempotent_on_the_server_side() -> None:
    profile = make_profile()
    ref = {"id": 12, "content_hash": "0" * 64, "created": True, "url": "/api/v1/profiles/12"}
    handler, seen = sequence(
        json_response(201, ref, headers={"Location": "/api/v1/profiles/12"}),
        json_response(200, {**ref, "created": False}, headers={"Location": "/api/v1/profiles/12"}),
    )
    with mock_client(handler, token="w") as client:
        assert client.upload(profile) == 12
        assert client.upload(profile) == 12
    assert [r.method for r in seen] == ["POST", "POST"]
    assert json.loads(seen[0].content) == profile.model_dump(mode="json")
    assert seen[0].content == seen[1].content  # the same body: the server dedups on its hash


def test_upload_is_retried_because_it_is_idempotent() -> None:
    handler, seen = sequence(
        httpx.ReadTimeout("lost the answer"),
        json_response(200, {"id": 3}, headers={"Location": "/api/v1/profiles/3"}),
    )
    with mock_client(handler) as client:
        assert client.upload(make_profile()) == 3
    assert len(seen) == 2


def test_upload_falls_back_to_the_location_header_for_the_id() -> None:
    handler, _ = sequence(httpx.Response(201, headers={"Location": "/api/v1/profiles/41"}))
    with mock_client(handler) as client:
        assert client.upload(make_profile()) == 41


def test_observe_is_not_retried_after_the_server_may_have_stored_it() -> None:
    handler, seen = sequence(httpx.ReadTimeout("no answer"))
    with mock_client(handler) as client, pytest.raises(APITimeoutError):
        client.observe(5, Observation(micro_batch=8, peak_bytes=123))
    assert len(seen) == 1
    handler, seen = sequence(json_response(500, error_body("internal_error", "internal server error")))
    with mock_client(handler) as client, pytest.raises(InternalServerError):
        client.observe(5, Observation(micro_batch=8, oom=True))
    assert len(seen) == 1


def test_observe_is_retried_when_the_request_surely_never_arrived() -> None:
    handler, seen = sequence(
        httpx.ConnectError("refused"),
        json_response(503, error_body("x", "starting")),
        json_response(201, {"id": 9, "profile_id": 5, "micro_batch": 8, "oom": True}),
    )
    with mock_client(handler) as client:
        assert client.observe(5, Observation(micro_batch=8, oom=True)) == 9
    assert len(seen) == 3
    assert seen[-1].url.path == "/api/v1/profiles/5/observations"
    assert json.loads(seen[-1].content)["oom"] is True


def _summary(i: int) -> dict[str, object]:
    return {
        "id": i,
        "content_hash": f"{i:064x}",
        "fingerprint": FINGERPRINT,
        "task": "tiny",
        "device_kind": "cpu",
        "device_name": "cpu",
        "precision": "fp32",
        "budget_bytes": 1 << 26,
        "headroom": 0.1,
        "max_micro_batch": 32,
        "world_size": 1,
        "trial_count": 3,
        "created_at": "2026-01-01T00:00:00Z",
        "uploaded_at": "2026-01-01T00:00:01Z",
        "uploader": None,
        "a_field_from_a_newer_server": True,
    }


def test_profiles_follows_the_cursor_and_passes_filters() -> None:
    handler, seen = sequence(
        json_response(200, {"items": [_summary(3), _summary(2)], "next_cursor": "c1"}),
        json_response(200, {"items": [_summary(1)], "next_cursor": None}),
    )
    with mock_client(handler) as client:
        rows = client.profiles(task="tiny", precision=None)
    assert [r.id for r in rows] == [3, 2, 1]
    assert seen[0].url.params["task"] == "tiny"
    assert "precision" not in seen[0].url.params
    assert "cursor" not in seen[0].url.params
    assert seen[1].url.params["cursor"] == "c1"


def test_profiles_limit_caps_the_total() -> None:
    handler, seen = sequence(json_response(200, {"items": [_summary(3), _summary(2)], "next_cursor": "c1"}))
    with mock_client(handler) as client:
        rows = client.profiles(limit=2)
    assert [r.id for r in rows] == [3, 2]
    assert seen[0].url.params["limit"] == "2"
    assert len(seen) == 1


def test_profile_and_delete() -> None:
    profile = make_profile()
    stored = {
        "id": 4,
        "content_hash": "f" * 64,
        "uploaded_at": "2026-01-01T00:00:00Z",
        "uploader": "ci",
        "observation_count": 2,
        "profile": profile.model_dump(mode="json"),
    }
    handler, seen = sequence(json_response(200, stored), httpx.Response(204))
    with mock_client(handler) as client:
        got = client.profile(4)
        client.delete(4)
    assert got.id == 4 and got.profile == profile and got.uploader == "ci"
    assert [(r.method, r.url.path) for r in seen] == [
        ("GET", "/api/v1/profiles/4"),
        ("DELETE", "/api/v1/profiles/4"),
    ]


def test_delete_of_an_unknown_profile_is_not_found() -> None:
    handler, _ = sequence(json_response(404, error_body("profile_not_found", "no profile 99")))
    with mock_client(handler) as client, pytest.raises(NotFoundError, match="no profile 99"):
        client.delete(99)


def test_healthy_is_one_attempt_and_never_raises() -> None:
    handler, seen = sequence(httpx.Response(200, json={"status": "ok"}))
    with mock_client(handler) as client:
        assert client.healthy() is True
    assert seen[0].url.path == "/healthz"
    handler, seen = sequence(httpx.ConnectError("refused"))
    with mock_client(handler) as client:
        assert client.healthy() is False
    assert len(seen) == 1
    handler, _ = sequence(httpx.Response(503))
    with mock_client(handler) as client:
        assert client.healthy() is False


def test_an_fsdp_suggest_sends_the_strategy_and_keeps_it() -> None:
    expected = make_suggestion(strategy="fsdp", source="predicted")
    handler, seen = sequence(json_response(200, expected.model_dump(mode="json")))
    with mock_client(handler) as client:
        got = client.suggest(**SUGGEST_ARGS, strategy="fsdp")
    assert seen[0].url.params["strategy"] == "fsdp"
    assert (got.strategy, got.source) == ("fsdp", "predicted")


def test_the_default_strategy_is_left_out_of_the_query() -> None:
    handler, seen = sequence(json_response(200, make_suggestion().model_dump(mode="json")))
    with mock_client(handler) as client:
        assert client.suggest(**SUGGEST_ARGS).strategy == "ddp"
    assert "strategy" not in seen[0].url.params


def test_an_fsdp_job_refuses_an_answer_from_a_server_without_strategies() -> None:
    # A server from before strategies ignores the parameter and answers without the field.
    old_answer = make_suggestion().model_dump(mode="json")
    del old_answer["strategy"]
    handler, _ = sequence(json_response(200, old_answer))
    with mock_client(handler) as client, pytest.raises(AutotuneClientError, match="strategy 'ddp', not 'fsdp'"):
        client.suggest(**SUGGEST_ARGS, strategy="fsdp")


def test_a_divisor_plan_is_asked_for_and_balanced_is_the_default() -> None:
    handler, seen = sequence(
        json_response(200, make_suggestion().model_dump(mode="json")),
        json_response(200, make_suggestion().model_dump(mode="json")),
    )
    with mock_client(handler) as client:
        client.suggest(**SUGGEST_ARGS, plan="divisor")
        client.suggest(**SUGGEST_ARGS)
    assert seen[0].url.params["plan"] == "divisor"
    assert "plan" not in seen[1].url.params  # the server's default: balanced
