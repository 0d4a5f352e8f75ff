"""POST/GET/DELETE /api/v1/profiles through the real app, on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from fastapi.testclient import TestClient

from autotune.core.schemas import Profile
from tests.factories import FINGERPRINT, fingerprint_for, make_profile, profile_payload
from tests.server.conftest import OTHER_WRITE_TOKEN, READ, WRITE

PROFILES = "/api/v1/profiles"


def _upload(client: TestClient, body: dict[str, object]) -> int:
    response = client.post(PROFILES, json=body, headers=WRITE)
    assert response.status_code in (200, 201), response.text
    return int(response.json()["id"])


def test_upload_answers_201_with_id_and_location(client: TestClient) -> None:
    response = client.post(PROFILES, json=profile_payload(), headers=WRITE)
    assert response.status_code == 201
    ref = response.json()
    assert ref["created"] is True
    assert response.headers["location"] == f"{PROFILES}/{ref['id']}" == ref["url"]
    assert len(ref["content_hash"]) == 64


def test_same_body_twice_is_one_row_201_then_200(client: TestClient) -> None:
    body = profile_payload()
    first = client.post(PROFILES, json=body, headers=WRITE)
    second = client.post(PROFILES, json=body, headers=WRITE)
    assert (first.status_code, second.status_code) == (201, 200)
    assert second.json()["id"] == first.json()["id"]
    assert second.json()["created"] is False
    assert second.headers["location"] == first.headers["location"]
    assert len(client.get(PROFILES).json()["items"]) == 1


def test_body_without_created_at_is_still_idempotent(client: TestClient) -> None:
    # The model fills a missing created_at with "now"; the hash must not see that.
    body = profile_payload()
    del body["created_at"]
    first = client.post(PROFILES, json=body, headers=WRITE)
    second = client.post(PROFILES, json=body, headers=WRITE)
    assert (first.status_code, second.status_code) == (201, 200)


def test_different_content_is_a_different_row(client: TestClient) -> None:
    ids = {_upload(client, profile_payload(seed=seed)) for seed in range(3)}
    assert len(ids) == 3


def test_get_returns_the_profile_as_uploaded(client: TestClient) -> None:
    profile = make_profile(tags={"model": "gpt", "layers": 12, "compiled": False, "lr": 3e-4})
    profile_id = _upload(client, profile.model_dump(mode="json"))
    response = client.get(f"{PROFILES}/{profile_id}")
    assert response.status_code == 200
    stored = response.json()
    assert stored["id"] == profile_id
    assert stored["uploader"] == "ci"  # the token's name, never the token
    assert stored["observation_count"] == 0
    assert Profile.model_validate(stored["profile"]) == profile


def test_uploader_is_the_name_of_the_token_used(client: TestClient) -> None:
    response = client.post(
        PROFILES, json=profile_payload(), headers={"Authorization": f"Bearer {OTHER_WRITE_TOKEN}"}
    )
    assert response.status_code == 201
    assert client.get(response.headers["location"]).json()["uploader"] == "laptop"


def test_get_unknown_id_is_404_in_the_error_shape(client: TestClient) -> None:
    response = client.get(f"{PROFILES}/999")
    assert response.status_code == 404
    assert response.json() == {
        "error": {
            "code": "profile_not_found",
            "message": "no profile with id 999",
            "field": "profile_id",
            "details": None,
        }
    }


def test_delete_removes_profile_trials_and_observations(client: TestClient) -> None:
    profile_id = _upload(client, profile_payload())
    observation = client.post(
        f"{PROFILES}/{profile_id}/observations", json={"micro_batch": 8, "peak_bytes": 10}, headers=WRITE
    )
    assert observation.status_code == 201
    assert client.delete(f"{PROFILES}/{profile_id}", headers=WRITE).status_code == 204
    assert client.get(f"{PROFILES}/{profile_id}").status_code == 404
    assert client.delete(f"{PROFILES}/{profile_id}", headers=WRITE).status_code == 404
    # No orphans left behind: the same body uploads again as a new row.
    again = client.post(PROFILES, json=profile_payload(), headers=WRITE)
    assert again.status_code == 201


def test_delete_leaves_no_trial_rows(client: TestClient) -> None:
    from sqlalchemy import func, select

    from autotune_server.models import ObservationRow, TrialRow

    profile_id = _upload(client, profile_payload())
    client.post(f"{PROFILES}/{profile_id}/observations", json={"micro_batch": 2}, headers=WRITE)
    client.delete(f"{PROFILES}/{profile_id}", headers=WRITE)
    app = client.app
    with app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        assert session.scalar(select(func.count()).select_from(TrialRow)) == 0
        assert session.scalar(select(func.count()).select_from(ObservationRow)) == 0


def test_list_filters_by_each_lookup_key(client: TestClient) -> None:
    other = fingerprint_for("other model")
    _upload(client, profile_payload(seed=1))
    _upload(client, profile_payload(seed=2, fingerprint=other))
    _upload(client, profile_payload(seed=3, device_name="NVIDIA H100 80GB HBM3"))
    _upload(client, profile_payload(seed=4, task="examples/cnn.py:task"))
    _upload(client, profile_payload(seed=5, precision="fp16"))

    def count(**params: str) -> int:
        response = client.get(PROFILES, params=params)
        assert response.status_code == 200, response.text
        return len(response.json()["items"])

    assert count() == 5
    assert count(fingerprint=other) == 1
    assert count(fingerprint=FINGERPRINT) == 4
    assert count(device_name="NVIDIA H100 80GB HBM3") == 1
    assert count(task="examples/cnn.py:task") == 1
    assert count(precision="fp16") == 1
    assert count(precision="bf16", fingerprint=FINGERPRINT) == 3


def test_bf16_autocast_is_stored_and_listed_as_a_precision_of_its_own(client: TestClient) -> None:
    """bf16-autocast (under fsdp: FSDP2's policy with autocast on top) is 13 characters: stored whole."""
    _upload(client, profile_payload(seed=1, strategy="fsdp", world_size=2))
    _upload(client, profile_payload(seed=2, strategy="fsdp", world_size=2, precision="bf16-autocast"))
    listed = client.get(PROFILES, params={"precision": "bf16-autocast"})
    assert listed.status_code == 200, listed.text
    assert [item["precision"] for item in listed.json()["items"]] == ["bf16-autocast"]
    assert client.get(PROFILES, params={"precision": "bf16-mixed"}).status_code == 422


def test_list_filters_by_strategy_world_size_and_source(client: TestClient) -> None:
    ddp = _upload(client, profile_payload(seed=1))
    fsdp_8 = _upload(client, profile_payload(seed=2, strategy="fsdp", world_size=8))
    fsdp_4 = _upload(client, profile_payload(seed=3, strategy="fsdp", world_size=4))
    estimate = _upload(client, profile_payload(seed=4, source="estimate"))

    def ids(**params: object) -> list[int]:
        response = client.get(PROFILES, params=params)
        assert response.status_code == 200, response.text
        return [item["id"] for item in response.json()["items"]]

    assert ids(strategy="fsdp") == [fsdp_4, fsdp_8]
    assert ids(strategy="fsdp", world_size=8) == [fsdp_8]
    assert ids(strategy="ddp") == [estimate, ddp]
    assert ids(source="estimate") == [estimate]
    assert ids(source="measured", strategy="ddp") == [ddp]
    items = {item["id"]: item for item in client.get(PROFILES).json()["items"]}
    assert (items[fsdp_8]["strategy"], items[fsdp_8]["world_size"], items[fsdp_8]["source"]) == ("fsdp", 8, "measured")
    assert (items[estimate]["strategy"], items[estimate]["source"]) == ("ddp", "estimate")


@pytest.mark.parametrize(
    ("params", "field"),
    [({"strategy": "zero3"}, "strategy"), ({"source": "guess"}, "source"), ({"world_size": 0}, "world_size")],
)
def test_bad_strategy_source_or_world_size_filter_is_422(
    client: TestClient, params: dict[str, object], field: str
) -> None:
    response = client.get(PROFILES, params=params)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field


def test_fake_trials_and_the_new_labels_are_stored_and_returned(client: TestClient) -> None:
    from sqlalchemy import select

    from autotune_server.models import ProfileRow, TrialRow

    profile = make_profile(strategy="fsdp", world_size=4, fake_micro_batches=(6, 30))
    profile_id = _upload(client, profile.model_dump(mode="json"))
    stored = Profile.model_validate(client.get(f"{PROFILES}/{profile_id}").json()["profile"])
    assert stored == profile
    assert [t.fake for t in stored.trials][:3] == [True, True, False]
    with client.app.state.sessionmaker() as session:  # type: ignore[attr-defined]
        row = session.get(ProfileRow, profile_id)
        assert (row.strategy, row.world_size, row.source, row.non_monotone) == ("fsdp", 4, "measured", False)
        query = select(TrialRow.fake).where(TrialRow.profile_id == profile_id).order_by(TrialRow.position)
        assert list(session.scalars(query)) == [t.fake for t in profile.trials]


def test_a_profile_of_before_the_new_labels_hashes_as_it_did(client: TestClient) -> None:
    import hashlib
    import json

    # What the store computed before strategy, source, non_monotone, the allocator's figures
    # (expandable_segments, reserved_gap_bytes) and Trial.fake existed.
    body = profile_payload()
    later = ("strategy", "source", "non_monotone", "expandable_segments", "reserved_gap_bytes")
    old = {k: v for k, v in body.items() if k not in later}
    old["trials"] = [{k: v for k, v in t.items() if k != "fake"} for t in body["trials"]]
    old["plan"] = {k: v for k, v in body["plan"].items() if k != "micro_batches"}
    canonical = json.dumps(old, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    response = client.post(PROFILES, json=old, headers=WRITE)
    assert response.status_code == 201, response.text
    assert response.json()["content_hash"] == hashlib.sha256(canonical.encode()).hexdigest()
    # An fsdp profile is different content, whatever else it shares.
    fsdp = client.post(PROFILES, json={**body, "strategy": "fsdp"}, headers=WRITE)
    assert fsdp.status_code == 201 and fsdp.json()["content_hash"] != response.json()["content_hash"]


def test_cursor_pagination_walks_every_profile_once_newest_first(client: TestClient) -> None:
    uploaded = [_upload(client, profile_payload(seed=seed)) for seed in range(7)]
    seen: list[int] = []
    cursor: str | None = None
    pages = 0
    while True:
        params: dict[str, str | int] = {"limit": 3}
        if cursor is not None:
            params["cursor"] = cursor
        page = client.get(PROFILES, params=params).json()
        seen += [item["id"] for item in page["items"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == sorted(uploaded, reverse=True)


def test_garbage_cursor_is_422_naming_cursor(client: TestClient) -> None:
    response = client.get(PROFILES, params={"cursor": "not-a-cursor"})
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "cursor"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.update(surprise=1), "surprise"),
        (lambda b: b["device"].update(colour="green"), "device.colour"),
        (lambda b: b.update(budget_bytes=-1), "budget_bytes"),
        (lambda b: b.update(headroom=1.5), "headroom"),
        (lambda b: b.update(max_micro_batch=2**40), "max_micro_batch"),
        (lambda b: b["trials"][0].update(peak_bytes=2**61), "trials.0.peak_bytes"),
        (lambda b: b.update(fingerprint="NOT HEX"), "fingerprint"),
        (lambda b: b.pop("trials"), "trials"),
        # Lax pydantic would read true as 1; the server is as strict as the schema it publishes.
        (lambda b: b["trials"][1].update(allocated_bytes=True), "trials.1.allocated_bytes"),
        (lambda b: b.update(max_micro_batch="24"), "max_micro_batch"),
    ],
)
def test_bad_profile_is_422_naming_the_field(
    client: TestClient, mutate: Callable[[dict[str, object]], None], field: str
) -> None:
    body = profile_payload()
    mutate(body)
    response = client.post(PROFILES, json=body, headers=WRITE)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "validation_error"
    assert error["field"] == field
    assert field in error["message"]
    assert client.get(PROFILES).json()["items"] == []


def test_malformed_json_is_422_in_the_error_shape(client: TestClient) -> None:
    response = client.post(
        PROFILES, content=b"{not json", headers={**WRITE, "Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "validation_error"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        # Issue 62: '{"a":' answered "5: JSON decode error" with the field "5", a character offset as a field.
        (b'{"a":', "the body is not valid JSON: Expecting value at character 5 (counting from 0)"),
        (b"{not json", "the body is not valid JSON: Expecting property name enclosed in double quotes at character 1"),
        (b"\xff\xfe{", "the body is not valid JSON: not UTF-8 text"),
    ],
)
def test_a_body_that_is_not_json_names_the_position_and_no_field(
    client: TestClient, content: bytes, message: str
) -> None:
    response = client.post(PROFILES, content=content, headers={**WRITE, "Content-Type": "application/json"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "validation_error" and error["field"] is None
    assert error["message"].startswith(message), error["message"]
    assert all(problem["field"] is None for problem in error["details"] or [])


def test_write_without_token_is_401_and_wrong_token_403(client: TestClient) -> None:
    body = profile_payload()
    missing = client.post(PROFILES, json=body)
    assert missing.status_code == 401
    assert missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["code"] == "authentication_required"
    wrong = client.post(PROFILES, json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403
    assert wrong.json()["error"]["code"] == "permission_denied"
    # A read-only token does not allow writes either.
    assert client.post(PROFILES, json=body, headers=READ).status_code == 403
    assert client.delete(f"{PROFILES}/1").status_code == 401
    assert client.get(PROFILES).json()["items"] == []


def test_server_without_write_tokens_refuses_every_write(make_client: Callable[..., TestClient]) -> None:
    client = make_client(api_tokens=())
    response = client.post(PROFILES, json=profile_payload(), headers=WRITE)
    assert response.status_code == 403
    assert "AUTOTUNE_API_TOKENS" in response.json()["error"]["message"]


def test_reads_can_require_a_token(make_client: Callable[..., TestClient]) -> None:
    client = make_client(read_token_required=True)
    assert client.get(PROFILES).status_code == 401
    assert client.get(PROFILES, headers={"Authorization": "Bearer nope"}).status_code == 403
    assert client.get(PROFILES, headers=READ).status_code == 200
    assert client.get(PROFILES, headers=WRITE).status_code == 200  # a write token reads too
    assert client.get("/healthz").status_code == 200  # probes stay open


def test_body_over_the_cap_is_413_by_content_length(client: TestClient) -> None:
    body = profile_payload()
    body["warnings"] = ["x" * 1000] * 64  # ~64 KiB + the rest: over the 64 KiB cap of the test app
    response = client.post(PROFILES, json=body, headers=WRITE)
    assert response.status_code == 413
    assert response.json()["error"] == {
        "code": "body_too_large",
        "message": "request body larger than 65536 bytes",
        "field": "body",
        "details": None,
    }


def test_body_over_the_cap_is_413_when_streamed_without_length(client: TestClient) -> None:
    # A generator body goes out chunked: no Content-Length, so only counting the stream can catch it.
    def chunks():  # type: ignore[no-untyped-def]
        yield b'{"task": "'
        for _ in range(100):
            yield b"y" * 1024
        yield b'"}'

    response = client.post(PROFILES, content=chunks(), headers={**WRITE, "Content-Type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "body_too_large"


def test_unknown_route_and_wrong_method_use_the_error_shape(client: TestClient) -> None:
    missing = client.get("/api/v1/nothing-here")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"
    wrong = client.put(PROFILES, json={})
    assert wrong.status_code == 405
    assert wrong.json()["error"]["code"] == "method_not_allowed"
    assert "POST" in wrong.headers["allow"]


def test_path_id_out_of_range_is_422_not_a_database_error(client: TestClient) -> None:
    response = client.get(f"{PROFILES}/{2**63}")
    assert response.status_code == 422
    assert response.json()["error"]["field"] == "profile_id"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.update(task="gpt\x00"), "task"),
        (lambda b: b.update(oom_count=2**31), "oom_count"),
        (lambda b: b.update(tags={"lr": float("nan")}), "tags.lr"),
        (lambda b: b.update(tags={"big": 2**70}), "tags.big"),
    ],
)
def test_values_the_database_cannot_keep_are_422_naming_the_field(
    client: TestClient, mutate: Callable[[dict[str, object]], None], field: str
) -> None:
    # Valid for pydantic, but NUL is refused by PostgreSQL text, NaN is not JSON, and the integers
    # are wider than their columns: each must be the client's 422, never the server's 500.
    import json

    body = profile_payload()
    mutate(body)
    response = client.post(
        PROFILES,
        content=json.dumps(body, allow_nan=True),
        headers={**WRITE, "Content-Type": "application/json"},
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
    assert client.get(PROFILES).json()["items"] == []


def test_nul_in_a_query_is_refused_without_a_500(client: TestClient) -> None:
    response = client.get(PROFILES, params={"device_name": "a\x00b"})
    assert response.status_code in (200, 422)  # SQLite compares it; PostgreSQL refuses it as a 422
    if response.status_code == 422:
        assert response.json()["error"]["code"] == "unstorable_value"
