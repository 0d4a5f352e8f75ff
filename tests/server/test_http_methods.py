"""HTTP exactly: a 405's Allow lists every method of the resource, OPTIONS answers with them, HEAD
works wherever GET does (RFC 9110 sections 9.3.2, 9.3.7 and 15.5.6), on the API and the dashboard."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from autotune_server.middleware import METHOD_ORDER
from tests.factories import profile_payload
from tests.server.conftest import WRITE

PROFILES = "/api/v1/profiles"
OTHER_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")


def _documented(client: TestClient) -> dict[str, set[str]]:
    """The OpenAPI paths with a concrete id in place of each path parameter, and their methods."""
    out: dict[str, set[str]] = {}
    for template, operations in client.get("/openapi.json").json()["paths"].items():
        path = template.replace("{profile_id}", "1")
        out[path] = {method.upper() for method in operations if method.upper() in METHOD_ORDER}
    return out


def _allow(value: str) -> list[str]:
    return [part.strip() for part in value.split(",")]


def test_every_documented_resource_lists_exactly_its_methods(client: TestClient) -> None:
    assert client.post(PROFILES, json=profile_payload(), headers=WRITE).status_code == 201
    resources = _documented(client)
    assert resources[PROFILES] == {"GET", "POST"}
    assert resources[f"{PROFILES}/1"] == {"GET", "DELETE"}
    assert resources[f"{PROFILES}/1/observations"] == {"GET", "POST"}
    for path, methods in resources.items():
        expected = set(methods) | {"OPTIONS"} | ({"HEAD"} if "GET" in methods else set())
        options = client.options(path)
        assert options.status_code == 204, path
        assert options.content == b""
        assert set(_allow(options.headers["allow"])) == expected, path
        # In the one order every answer uses.
        assert _allow(options.headers["allow"]) == [m for m in METHOD_ORDER if m in expected]
        for method in OTHER_METHODS:
            if method in methods:
                continue
            refused = client.request(method, path, headers=WRITE)
            assert refused.status_code == 405, (method, path)
            assert set(_allow(refused.headers["allow"])) == expected, (method, path)
            assert refused.json()["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("path", [PROFILES, "/healthz", "/readyz", "/metrics", "/", "/openapi.json"])
def test_head_answers_what_get_answers_without_the_body(client: TestClient, path: str) -> None:
    got = client.get(path)
    head = client.head(path)
    assert head.status_code == got.status_code == 200
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]


def test_head_of_a_missing_profile_is_the_get_status(client: TestClient) -> None:
    assert client.head(f"{PROFILES}/999").status_code == 404


def test_dashboard_pages_list_their_methods_too(client: TestClient) -> None:
    for path in ("/", "/profiles/1"):
        refused = client.request("PUT", path, headers={"Accept": "text/html"})
        assert refused.status_code == 405
        assert _allow(refused.headers["allow"]) == ["GET", "HEAD", "OPTIONS"]
        assert refused.headers["content-type"].startswith("text/html")


def test_unknown_paths_stay_404_for_every_method(client: TestClient) -> None:
    for method in ("OPTIONS", "HEAD", "GET", "DELETE"):
        assert client.request(method, "/api/v1/nothing-here").status_code == 404
