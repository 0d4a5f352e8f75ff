"""Test data for the client tests: suggestions, error bodies, mock transports (profiles come from
tests/factories.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2 as httpx

from autotune.core.schemas import Profile, Suggestion
from autotune_client import TunerClient
from tests.factories import make_profile as shared_make_profile

BASE_URL = "http://tuner.test"
FINGERPRINT = "ab" * 32

Handler = Callable[[httpx.Request], httpx.Response]


def make_profile(*, fingerprint: str = FINGERPRINT, max_micro_batch: int = 32) -> Profile:
    """A valid CPU profile (the shared factory, with this folder's fingerprint and device)."""
    return shared_make_profile(
        fingerprint=fingerprint,
        device_kind="cpu",
        device_name="cpu",
        precision="fp32",
        budget_bytes=64 << 20,
        fixed_bytes=1 << 20,
        bytes_per_sample=1 << 20,
        max_micro_batch=max_micro_batch,
    )


def make_suggestion(**overrides: Any) -> Suggestion:
    """A measured suggestion: 16 x 4 x 2 = 128."""
    values: dict[str, Any] = {
        "micro_batch": 16,
        "accumulation_steps": 4,
        "world_size": 2,
        "effective_batch": 128,
        "target_batch": 128,
        "exact": True,
        "source": "measured",
        "profile_id": 7,
        "fingerprint": FINGERPRINT,
        "device_name": "cpu",
        "max_micro_batch": 20,
        "peak_bytes": 50_000_000,
        "budget_bytes": 64 << 20,
    }
    values.update(overrides)
    return Suggestion(**values)


def error_body(code: str, message: str, field: str | None = None) -> dict[str, Any]:
    """The server's one error shape."""
    return {"error": {"code": code, "message": message, "field": field, "details": None}}


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.Response(
        status,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json", **(headers or {})},
    )


def sequence(*responses: httpx.Response | Exception) -> tuple[Handler, list[httpx.Request]]:
    """A handler answering the given responses in turn (an exception is raised), and the requests seen."""
    seen: list[httpx.Request] = []
    queue = list(responses)

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if not queue:
            raise AssertionError(f"unexpected extra request {request.method} {request.url}")
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    return handler, seen


def mock_client(
    handler: Handler,
    *,
    max_retries: int = 2,
    timeout: float = 10.0,
    token: str | None = None,
    sleeps: list[float] | None = None,
) -> TunerClient:
    """A TunerClient over a MockTransport whose back-off waits are recorded instead of slept."""
    client = TunerClient(
        base_url=BASE_URL,
        token=token,
        timeout=timeout,
        max_retries=max_retries,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
    )
    recorded = sleeps if sleeps is not None else []
    client._sleep = recorded.append
    client._random = lambda: 0.0
    return client
