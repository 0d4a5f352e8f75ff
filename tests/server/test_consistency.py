"""The store cannot be told nonsense: uploads that contradict their own trials are a 422 naming the
field and the trial; stored ones (from before the checks) are served with a warning and never used
by /suggest. Every case on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from autotune.core.schemas import Suggestion
from tests.factories import inconsistent_payloads, make_run_payload, profile_payload
from tests.server.conftest import WRITE, store_unchecked

PROFILES = "/api/v1/profiles"
SUGGEST = "/api/v1/suggest"
CASES = inconsistent_payloads()


def _query(body: dict[str, Any], **params: object) -> dict[str, object]:
    return {"fingerprint": body["fingerprint"], "device_name": body["device"]["name"], **params}


@pytest.mark.parametrize(("rule", "body", "field", "trial"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_refuses_its_failing_upload(
    client: TestClient, rule: str, body: dict[str, Any], field: str, trial: int | None
) -> None:
    response = client.post(PROFILES, json=body, headers=WRITE)
    assert response.status_code == 422, (rule, response.text)
    error = response.json()["error"]
    assert error["code"] == "inconsistent_profile"
    assert error["field"] == field and error["message"].startswith(f"{field}: ")
    first = error["details"][0]
    assert (first["field"], first["trial"]) == (field, trial)
    if trial is not None:
        assert first["micro_batch"] == body["trials"][trial]["micro_batch"]
    assert client.get(PROFILES).json()["items"] == []  # nothing stored


def test_the_tampered_make_run_upload_is_422_naming_max_micro_batch_and_the_trial(client: TestClient) -> None:
    body = make_run_payload()
    assert client.post(PROFILES, json=body, headers=WRITE).status_code == 201
    tampered = make_run_payload()
    tampered["max_micro_batch"] = 1_000_000
    response = client.post(PROFILES, json=tampered, headers=WRITE)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["field"] == "max_micro_batch"
    assert "1000000 is contradicted by trial 4: m=27" in error["message"]
    assert error["details"][0] == {
        "field": "max_micro_batch",
        "message": "1000000 is contradicted by trial 4: m=27 peaked at 22692988 bytes, over the limit of 22649241",
        "trial": 4,
        "micro_batch": 27,
    }
    # /suggest still answers from what the trials say.
    got = Suggestion.model_validate(client.get(SUGGEST, params=_query(body, target_batch=4096)).json())
    assert got.max_micro_batch == 26 and got.micro_batch <= 26


def test_make_run_gpt_profile_answers_target_256_in_10_balanced_steps(client: TestClient) -> None:
    body = make_run_payload()  # stored by an older version: plan 16 x 16, no micro_batches, no labels
    assert client.post(PROFILES, json=body, headers=WRITE).status_code == 201
    got = Suggestion.model_validate(client.get(SUGGEST, params=_query(body, target_batch=256)).json())
    assert (got.source, got.max_micro_batch, got.accumulation_steps) == ("measured", 26, 10)
    assert got.micro_batches == [(26, 6), (25, 4)] and got.micro_batch == 26
    assert sum(size * count for size, count in got.micro_batches) == got.effective_batch == 256 and got.exact
    assert got.peak_bytes == 21933692  # measured at the largest size
    divisor = Suggestion.model_validate(
        client.get(SUGGEST, params=_query(body, target_batch=256, plan="divisor")).json()
    )
    assert (divisor.micro_batch, divisor.accumulation_steps, divisor.micro_batches) == (16, 16, [(16, 16)])
    bad = client.get(SUGGEST, params=_query(body, target_batch=256, plan="round"))
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "plan"


def test_a_stored_inconsistent_profile_is_served_with_a_warning_and_never_suggested(client: TestClient) -> None:
    good = make_run_payload()
    good_id = client.post(PROFILES, json=good, headers=WRITE).json()["id"]
    tampered = make_run_payload()
    tampered["max_micro_batch"] = 1_000_000
    tampered["created_at"] = "2026-02-01T00:00:00Z"  # newer than the good one
    bad_id = store_unchecked(client, tampered)

    stored = client.get(f"{PROFILES}/{bad_id}")
    assert stored.status_code == 200
    assert stored.json()["profile"]["max_micro_batch"] == 1_000_000  # served as it was sent
    warnings = stored.json()["warnings"]
    assert warnings and "never used by /suggest" in warnings[0] and "trial 4: m=27" in warnings[0]
    assert client.get(f"{PROFILES}/{good_id}").json()["warnings"] == []

    # The newer, inconsistent profile is passed over for the older consistent one, and said so.
    got = Suggestion.model_validate(client.get(SUGGEST, params=_query(good, target_batch=4096)).json())
    assert (got.profile_id, got.max_micro_batch) == (good_id, 26)
    assert any(f"profile(s) {bad_id}" in w and "contradict" in w for w in got.warnings)
    # Nothing is deleted.
    assert {item["id"] for item in client.get(PROFILES).json()["items"]} == {good_id, bad_id}
    # Alone, it answers nothing: a 404, never its million.
    assert client.delete(f"{PROFILES}/{good_id}", headers=WRITE).status_code == 204
    assert client.get(SUGGEST, params=_query(good, target_batch=4096)).status_code == 404


def test_a_stored_inconsistent_profile_is_not_predicted_from(client: TestClient) -> None:
    elsewhere = profile_payload(device_name="NVIDIA H100 80GB HBM3")
    elsewhere["trials"][-1]["fits"] = True  # m_max + 1 "fits" with a peak over the limit
    store_unchecked(client, elsewhere)
    params = {"fingerprint": elsewhere["fingerprint"], "device_name": "NVIDIA A100-SXM4-80GB"}
    response = client.get(SUGGEST, params={**params, "target_batch": 64, "budget_bytes": 40 * 2**30})
    assert response.status_code == 404
    good = profile_payload(device_name="NVIDIA H100 80GB HBM3", seed=1)
    assert client.post(PROFILES, json=good, headers=WRITE).status_code == 201
    got = Suggestion.model_validate(
        client.get(SUGGEST, params={**params, "target_batch": 64, "budget_bytes": 40 * 2**30}).json()
    )
    assert got.source == "predicted" and any("contradict" in w for w in got.warnings)
