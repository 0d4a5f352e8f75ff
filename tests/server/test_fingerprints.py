"""One fingerprint form a user can copy (issue 62, item 3), on SQLite and PostgreSQL: the 16 hex digits the
datasheet, `autotune profiles ls` and the dashboard show are what /suggest and the profile list take; a prefix
one stored fingerprint starts with answers for it, one that several start with is refused naming them.

Before: the datasheet showed 16 digits, the list 12, and /suggest matched whole fingerprints only (404 for the
datasheet's own)."""

from __future__ import annotations

from fastapi.testclient import TestClient

from autotune.core.schemas import FINGERPRINT_SHOWN_CHARS, shown_fingerprint
from tests.factories import DEFAULT_DEVICE, profile_payload
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"
# Two fingerprints that share their first 16 digits, and one that shares nothing with them.
TWIN_A = "923454115ee1139d" + "a" * 48
TWIN_B = "923454115ee1139d" + "b" * 48
ALONE = "5eed" * 16


def _upload(client: TestClient, fingerprint: str) -> int:
    response = client.post("/api/v1/profiles", json=profile_payload(fingerprint=fingerprint), headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _ask(client: TestClient, fingerprint: str) -> tuple[int, dict[str, object]]:
    response = client.get(
        SUGGEST, params={"fingerprint": fingerprint, "device_name": DEFAULT_DEVICE, "target_batch": 64}
    )
    return response.status_code, response.json()


def test_the_shown_prefix_of_a_stored_fingerprint_answers_for_it(client: TestClient) -> None:
    profile_id = _upload(client, ALONE)
    shown = shown_fingerprint(ALONE)
    assert len(shown) == FINGERPRINT_SHOWN_CHARS == 16
    status, body = _ask(client, shown)
    assert status == 200, body
    assert body["profile_id"] == profile_id and body["fingerprint"] == ALONE and body["source"] == "measured"
    # Any longer prefix too, and the whole one as before.
    assert _ask(client, ALONE[:40])[1]["profile_id"] == profile_id
    assert _ask(client, ALONE)[1]["profile_id"] == profile_id
    # The list takes the same form.
    listed = client.get("/api/v1/profiles", params={"fingerprint": shown}).json()["items"]
    assert [item["id"] for item in listed] == [profile_id]


def test_a_prefix_several_fingerprints_start_with_is_refused_naming_them(client: TestClient) -> None:
    _upload(client, TWIN_A)
    _upload(client, TWIN_B)
    status, body = _ask(client, "923454115ee1139d")
    assert status == 422
    error = body["error"]
    assert isinstance(error, dict)
    assert error["code"] == "ambiguous_fingerprint" and error["field"] == "fingerprint"
    assert error["message"] == (
        f"fingerprint 923454115ee1139d is the start of several stored fingerprints ({TWIN_A}, {TWIN_B}): "
        "give more of it"
    )
    assert error["details"] == {"fingerprint": "923454115ee1139d", "candidates": [TWIN_A, TWIN_B]}
    # One more digit tells them apart.
    assert _ask(client, "923454115ee1139da")[1]["fingerprint"] == TWIN_A
    assert _ask(client, "923454115ee1139db")[1]["fingerprint"] == TWIN_B
    # The list shows both for the prefix: a filter, not a lookup.
    listed = client.get("/api/v1/profiles", params={"fingerprint": "923454115ee1139d"}).json()["items"]
    assert sorted(item["fingerprint"] for item in listed) == [TWIN_A, TWIN_B]


def test_a_fingerprint_stored_as_asked_is_that_one(client: TestClient) -> None:
    """A short fingerprint stored whole is itself, whatever longer ones start with it."""
    short_id = _upload(client, "923454115ee1139d")
    _upload(client, TWIN_A)
    status, body = _ask(client, "923454115ee1139d")
    assert status == 200 and body["profile_id"] == short_id


def test_a_prefix_nothing_starts_with_is_the_404_it_was(client: TestClient) -> None:
    _upload(client, ALONE)
    status, body = _ask(client, "0123456789abcdef")
    assert status == 404
    error = body["error"]
    assert isinstance(error, dict) and error["code"] == "no_matching_profile"
