"""/healthz, /readyz and /metrics."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from fastapi.testclient import TestClient

from autotune_server import Settings, create_app
from autotune_server.migrate import head_revision
from tests.factories import profile_payload
from tests.server.conftest import WRITE


def test_healthz_and_readyz_when_migrated(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz")
    assert ready.status_code == 200
    assert ready.json()["status"] == "ready"
    assert ready.json()["revision"] == head_revision()
    assert ready.json()["database"] in ("sqlite", "postgresql")


def test_readyz_is_503_on_an_unmigrated_database_while_healthz_stays_up(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path / 'fresh.db'}", access_log=False)
    with TestClient(create_app(settings)) as client:
        assert client.get("/healthz").status_code == 200
        ready = client.get("/readyz")
        assert ready.status_code == 503
        assert ready.json()["error"]["code"] == "database_unavailable"
        assert "sqlite" not in ready.json()["error"]["message"]  # no URL leaks out


def test_readyz_is_503_when_the_database_cannot_be_reached() -> None:
    settings = Settings(database_url="postgresql+psycopg://nobody:secret@127.0.0.1:1/none", access_log=False)
    with TestClient(create_app(settings)) as client:
        ready = client.get("/readyz")
    assert ready.status_code == 503
    assert "secret" not in ready.text


def _sample(text: str, name: str, **labels: str) -> float:
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = "^" + re.escape(name) + (r"\{" + re.escape(wanted) + r"\}" if labels else "") + r" (\S+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match is not None, f"{name} {labels} not in metrics"
    return float(match.group(1))


def test_metrics_count_requests_latency_and_profiles(client: TestClient) -> None:
    client.post("/api/v1/profiles", json=profile_payload(seed=1), headers=WRITE)
    client.post("/api/v1/profiles", json=profile_payload(seed=2), headers=WRITE)
    client.get("/api/v1/profiles/1")
    client.get("/api/v1/profiles/77")
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = response.text
    assert _sample(text, "autotune_profiles_stored") == 2
    assert _sample(text, "autotune_database_up") == 1
    route = "/api/v1/profiles/{profile_id}"
    assert _sample(text, "autotune_http_requests_total", method="GET", route=route, status="200") == 1
    assert _sample(text, "autotune_http_requests_total", method="GET", route=route, status="404") == 1
    assert (
        _sample(text, "autotune_http_requests_total", method="POST", route="/api/v1/profiles", status="201")
        == 2
    )
    count = _sample(text, "autotune_http_request_duration_seconds_count", method="GET", route=route)
    inf = _sample(text, "autotune_http_request_duration_seconds_bucket", method="GET", route=route, le="+Inf")
    assert count == inf == 2
    assert "# TYPE autotune_http_request_duration_seconds histogram" in text


def test_unmatched_paths_share_one_label(client: TestClient) -> None:
    for i in range(5):
        client.get(f"/random/{i}")
    text = client.get("/metrics").text
    assert _sample(text, "autotune_http_requests_total", method="GET", route="unmatched", status="404") == 5
    assert "/random/" not in text


def test_unexpected_error_is_a_bare_500_without_trace(
    make_client: Callable[..., TestClient], settings: Settings
) -> None:
    from fastapi import APIRouter

    boom = APIRouter()

    @boom.get("/boom")
    def explode() -> None:
        """Fail the way a bug would."""
        raise RuntimeError("secret internals /path/to/file.py line 42")

    app = create_app(settings, routers=[boom])
    with TestClient(app, raise_server_exceptions=False) as client:
        response = client.get("/boom")
    assert response.status_code == 500
    assert response.json() == {
        "error": {
            "code": "internal_error",
            "message": "internal server error",
            "field": None,
            "details": None,
        }
    }
    assert "secret" not in response.text
    assert "Traceback" not in response.text
