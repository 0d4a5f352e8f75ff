"""Profile consistency: one failing input per rule, and the profiles the probe legitimately makes pass."""

from __future__ import annotations

from typing import Any

import pytest

import autotune.core.consistency as consistency_module
from autotune.core.consistency import InconsistentProfile, check_profile, device_kind_of_name, profile_problems
from autotune.core.plan import plan
from autotune.core.schemas import Profile, Trial
from tests.factories import inconsistent_payloads, make_profile, make_run_payload

CASES = inconsistent_payloads()


def test_all_is_exported() -> None:
    for name in consistency_module.__all__:
        assert hasattr(consistency_module, name), name


@pytest.mark.parametrize(("rule", "body", "field", "trial"), CASES, ids=[c[0] for c in CASES])
def test_each_rule_has_a_failing_input(rule: str, body: dict[str, Any], field: str, trial: int | None) -> None:
    profile = Profile.model_validate(body)
    problems = profile_problems(profile)
    assert problems, rule
    first = problems[0]
    assert (first.field, first.trial) == (field, trial), problems
    if trial is not None:
        assert first.micro_batch == profile.trials[trial].micro_batch
        assert f"trial {trial}" in first.message
    with pytest.raises(InconsistentProfile) as raised:
        check_profile(profile)
    assert raised.value.field == field and str(raised.value).startswith(f"{field}: ")
    assert raised.value.problems == problems


def test_the_tampered_upload_names_max_micro_batch_and_the_trial_over_the_limit() -> None:
    body = make_run_payload()
    body["max_micro_batch"] = 1_000_000
    with pytest.raises(InconsistentProfile) as raised:
        check_profile(Profile.model_validate(body))
    message = str(raised.value)
    assert message.startswith("max_micro_batch: 1000000 is contradicted by trial 4: m=27 peaked at 22692988 bytes")
    assert "over the limit of 22649241" in message


def test_make_run_profile_and_the_factory_pass() -> None:
    assert profile_problems(Profile.model_validate(make_run_payload())) == []
    assert profile_problems(make_profile()) == []
    balanced = Profile.model_validate(make_run_payload())
    balanced.plan = plan(26, 256)
    assert balanced.plan.micro_batches == [(26, 6), (25, 4)]
    assert profile_problems(balanced) == []


def _trials(limit: int, sizes: list[int], over: int | None = None, oom: int | None = None) -> list[Trial]:
    trials = [Trial(micro_batch=m, peak_bytes=limit // 2 + m, fits=True) for m in sizes]
    if over is not None:
        trials.append(Trial(micro_batch=over, peak_bytes=limit + 1, fits=False))
    if oom is not None:
        trials.append(Trial(micro_batch=oom, peak_bytes=0, fits=False, oom=True))
    return trials


def _profile(**update: Any) -> Profile:
    profile = Profile.model_validate(make_run_payload())
    return profile.model_copy(update=update)


def test_cap_multiple_of_oom_and_unreachable_plans_pass() -> None:
    base = Profile.model_validate(make_run_payload())
    limit = base.limit_bytes
    # m_max is the cap: nothing above it was tried.
    capped = _profile(max_micro_batch=26, micro_batch_cap=26, trials=_trials(limit, [1, 2, 26]))
    assert profile_problems(capped) == []
    # A cap that is not a multiple: m_max is the largest multiple under it.
    capped = _profile(max_micro_batch=24, micro_batch_cap=26, multiple_of=8, plan=plan(24, 256, multiple_of=8),
                      trials=_trials(limit, [8, 16, 24]))
    assert profile_problems(capped) == []
    # multiple_of: the failure is at m_max + multiple_of, and it was an OOM.
    multiple = _profile(max_micro_batch=24, multiple_of=8, plan=plan(24, 256, multiple_of=8),
                        trials=_trials(limit, [8, 16, 24], oom=32))
    assert profile_problems(multiple) == []
    # No plan (the target was not reachable): the measurement stands.
    assert profile_problems(_profile(plan=None)) == []
    # A nearest (not exact) plan is consistent when it says so.
    nearest = _profile(plan=plan(26, 255, 2), world_size=2)
    assert not nearest.plan.exact and profile_problems(nearest) == []


def test_non_monotone_declared_passes_and_only_deciding_trials_count() -> None:
    base = Profile.model_validate(make_run_payload())
    limit = base.limit_bytes
    trials = [*base.trials, Trial(micro_batch=30, peak_bytes=limit - 1, fits=True)]
    assert [p.field for p in profile_problems(_profile(trials=trials))] == ["non_monotone"]
    assert profile_problems(_profile(trials=trials, non_monotone=True)) == []
    # Fake pre-search points prove nothing either way: one "fitting" at 40 is ignored.
    guided = [Trial(micro_batch=40, peak_bytes=1, fits=True, fake=True), *base.trials]
    assert profile_problems(_profile(trials=guided)) == []
    # An estimate is judged by its fake trials.
    estimate = _profile(source="estimate", trials=[t.model_copy(update={"fake": True}) for t in base.trials])
    assert profile_problems(estimate) == []
    assert profile_problems(_profile(source="estimate"))[0].message == "no fake (estimate) trial measured m=26"


def test_device_kind_of_name() -> None:
    assert device_kind_of_name("cpu") == "cpu"
    assert device_kind_of_name("Intel(R) Xeon(R) Platinum 8480+") == "cpu"
    assert device_kind_of_name("NVIDIA H100 80GB HBM3") == "cuda"
    assert device_kind_of_name("Tesla V100-SXM2-16GB") == "cuda"
    assert device_kind_of_name("AMD Instinct MI300X") == "cuda"
    assert device_kind_of_name("Ascend 910B") is None  # cannot be told: no rule applies
    unknown = _profile().model_copy(deep=True)
    unknown.device.name = "Ascend 910B"
    unknown.device.kind = "cuda"
    assert profile_problems(unknown) == []


def test_an_estimates_throughput_is_predicted_and_its_parts_add_up() -> None:
    """An estimate's throughput is a prediction and says so (autotune/core/step_time.py): accepted, and refused where
    it claims to be timed, where a measurement claims to be predicted, or where its parts miss its seconds."""
    from autotune.core.schemas import PredictedParts, Throughput

    parts = PredictedParts(compute_seconds=0.8, exposed_communication_seconds=0.1, optimizer_seconds=0.1)
    timing = Throughput(micro_batch=24, samples_per_second=24.0, seconds_per_update=1.0, micro_batches=[(24, 1)],
                        micro_batch_seconds=[(24, 0.9)], step_seconds=0.1, predicted=True, parts=parts)  # fmt: skip
    estimate = make_profile(source="estimate").model_copy(update={"throughput": [timing]})
    assert profile_problems(estimate) == []
    timed = estimate.model_copy(update={"throughput": [timing.model_copy(update={"predicted": False})]})
    assert [p.field for p in profile_problems(timed)] == ["throughput.0"]
    measured = make_profile().model_copy(update={"throughput": [timing]})
    assert [p.field for p in profile_problems(measured)] == ["throughput.0.predicted"]
    short = parts.model_copy(update={"optimizer_seconds": 0.3})
    wrong = estimate.model_copy(update={"throughput": [timing.model_copy(update={"parts": short})]})
    assert [(p.field, p.message) for p in profile_problems(wrong)] == [
        ("throughput.0.parts", "add up to 1.2 s, not the update's 1.0 s")
    ]
