"""/suggest on a profile with a single-step figure (Profile.single_step; issue 33, item 8), on SQLite and
PostgreSQL: one step per update (A = 1) where the single step holds the target exactly, the accumulating plan
otherwise, and the answer every other reader of the profile gives (autotune.core.plan.plan_profile)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from autotune.core.plan import plan, plan_profile
from autotune.core.schemas import Profile, SingleStep, Suggestion, Trial
from tests.factories import DEFAULT_DEVICE, FINGERPRINT, make_profile
from tests.server.conftest import WRITE

SUGGEST = "/api/v1/suggest"
GIB = 2**30
# make_profile's line: peak(m) = 10 GiB + 2.5 GiB x m against a limit of 72 GiB (80 GiB less 10 %): the
# accumulating job fits 24 (70 GiB), not 25. Without accumulation one gradient set (4 GiB here) less: 26 fits
# (71 GiB), 27 does not (73.5 GiB), searched up to the cap 32.
ACCUMULATING, SINGLE, CAP = 24, 26, 32


def _single_peak(m: int) -> int:
    return int(6 * GIB + 2.5 * GIB * m)


def single_step_profile() -> Profile:
    trials = [
        Trial(micro_batch=m, peak_bytes=_single_peak(m), fits=m <= SINGLE, seconds=0.5)
        for m in (ACCUMULATING, SINGLE, SINGLE + 1)
    ]
    profile = make_profile(max_micro_batch=ACCUMULATING)
    profile.single_step = SingleStep(max_micro_batch=SINGLE, cap=CAP, trials=trials)
    profile.plan = plan_profile(profile, CAP)  # a probe with target 32: one step does not hold it
    return profile


def _upload(client: TestClient, profile: Profile) -> int:
    response = client.post("/api/v1/profiles", json=profile.model_dump(mode="json"), headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def _suggest(client: TestClient, **params: Any) -> Suggestion:
    response = client.get(SUGGEST, params={"fingerprint": FINGERPRINT, "device_name": DEFAULT_DEVICE, **params})
    assert response.status_code == 200, response.text
    return Suggestion.model_validate(response.json())


def test_the_single_step_field_round_trips_through_the_store(client: TestClient) -> None:
    profile = single_step_profile()
    got = client.get(f"/api/v1/profiles/{_upload(client, profile)}").json()["profile"]
    assert got["single_step"] == profile.single_step.model_dump(mode="json")  # type: ignore[union-attr]
    assert Profile.model_validate(got).single_step == profile.single_step


def test_the_store_takes_the_plan_of_the_shared_rule_for_any_target(client: TestClient) -> None:
    """Whatever target a probe planned, its stored plan is plan_profile's, which the store's checks accept."""
    for seed, target in enumerate((ACCUMULATING - 4, ACCUMULATING, SINGLE, SINGLE + 1)):
        profile = single_step_profile()
        profile.plan, profile.created_at = plan_profile(profile, target), profile.created_at.replace(second=seed)
        response = client.post("/api/v1/profiles", json=profile.model_dump(mode="json"), headers=WRITE)
        assert response.status_code == 201, (target, response.text)


def test_a_target_the_single_step_holds_is_one_step(client: TestClient) -> None:
    _upload(client, single_step_profile())
    got = _suggest(client, target_batch=SINGLE)
    assert (got.micro_batch, got.accumulation_steps, got.exact, got.single_step) == (SINGLE, 1, True, True)
    assert got.max_micro_batch == ACCUMULATING  # the accumulating job's figure, for any other plan
    assert got.peak_bytes == _single_peak(SINGLE)  # the single-step trial's, not the accumulating line's
    assert any("one step per update (A = 1)" in w for w in got.warnings)
    # D replicas: T / D is what one step holds.
    two = _suggest(client, target_batch=2 * SINGLE, world_size=2)
    assert (two.micro_batch, two.accumulation_steps, two.world_size, two.single_step) == (SINGLE, 1, 2, True)


def test_a_target_the_single_step_does_not_hold_accumulates(client: TestClient) -> None:
    _upload(client, single_step_profile())
    for target in (SINGLE + 1, 2 * SINGLE + 1):
        got = _suggest(client, target_batch=target)
        expected = plan(ACCUMULATING, target)
        assert (got.micro_batches, got.accumulation_steps, got.single_step) == (
            expected.micro_batches,
            expected.accumulation_steps,
            False,
        )
        assert got.accumulation_steps >= 2 and got.micro_batch <= ACCUMULATING
    # Not exact in one step (3 replicas do not divide 77): planned from the accumulating m_max.
    odd = _suggest(client, target_batch=77, world_size=3)
    assert odd.single_step is False and odd.micro_batch <= ACCUMULATING
    # Within the accumulating m_max: one step already, and no single-step claim.
    small = _suggest(client, target_batch=ACCUMULATING)
    assert (small.micro_batch, small.accumulation_steps, small.single_step) == (ACCUMULATING, 1, False)


def test_every_target_gets_the_plan_of_the_shared_rule(client: TestClient) -> None:
    """The answer is a function of the profile and the target only: a target that changes between calls moves
    along one rule (one step up to the single step's m_max, then accumulating), the probe's and the client's."""
    profile = single_step_profile()
    _upload(client, profile)
    for world in (1, 2):
        for target in range(2 * world, 34 * world, world):
            got = _suggest(client, target_batch=target, world_size=world)
            expected = plan_profile(profile, target, world)
            assert (got.micro_batches, got.accumulation_steps, got.effective_batch) == (
                expected.micro_batches,
                expected.accumulation_steps,
                expected.effective_batch,
            ), (target, world)
            assert got.single_step is (expected.accumulation_steps == 1 and expected.micro_batch > ACCUMULATING)


def test_the_single_step_is_held_to_a_stricter_limit_and_to_reported_ooms(client: TestClient) -> None:
    profile_id = _upload(client, single_step_profile())
    # A limit of 70.5 GiB: the accumulating 24 (70 GiB) still fits, the single step's 26 (71 GiB) does not.
    stricter = _suggest(client, target_batch=SINGLE, budget_bytes=int(70.5 * GIB), headroom=0)
    assert stricter.single_step is False and stricter.accumulation_steps == 2
    assert _suggest(client, target_batch=SINGLE).single_step is True
    response = client.post(
        f"/api/v1/profiles/{profile_id}/observations", json={"micro_batch": SINGLE, "oom": True}, headers=WRITE
    )
    assert response.status_code == 201, response.text
    after = _suggest(client, target_batch=SINGLE)
    assert after.single_step is False and after.accumulation_steps == 2 and after.micro_batch <= ACCUMULATING


def test_a_profile_without_a_single_step_plans_as_before(client: TestClient) -> None:
    _upload(client, make_profile(max_micro_batch=ACCUMULATING))
    got = _suggest(client, target_batch=SINGLE)
    assert (got.accumulation_steps, got.single_step) == (2, False)


def test_the_datasheet_says_which_case_its_plan_is(client: TestClient) -> None:
    accumulates = single_step_profile()  # its plan is for 32, which one step does not hold
    page = client.get(f"/profiles/{_upload(client, accumulates)}").text
    assert f"without accumulation (A = 1): m max = {SINGLE}" in page
    assert f"accumulating (A ≥ 2, m ≤ {ACCUMULATING}): one step fits {SINGLE}, under the target's {CAP}" in page
    one_step = single_step_profile()
    one_step.plan = plan_profile(one_step, SINGLE)
    page = client.get(f"/profiles/{_upload(client, one_step)}").text
    assert f"one step per update (A = 1): m = {SINGLE} is within the single step's max micro-batch" in page
