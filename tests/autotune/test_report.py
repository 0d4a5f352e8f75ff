"""The datasheet's text: strategy and world size, source, real trials apart from fake ones."""

from __future__ import annotations

from typing import Any

import pytest

from autotune.cli.parser import build_parser
from autotune.cli.report import datasheet, trial_counts
from tests.factories import make_profile


def _line(sheet: str, key: str) -> str:
    (line,) = [line for line in sheet.splitlines() if line.strip().startswith(key)]
    return line


def test_a_ddp_measurement_with_fake_pre_search_points_counts_them_apart() -> None:
    profile = make_profile(fake_micro_batches=(8, 30))
    profile.trials[-1] = profile.trials[-1].model_copy(update={"oom": True})
    sheet = datasheet(profile)
    assert _line(sheet, "strategy").split(None, 1)[1] == "ddp, world size 1"
    assert _line(sheet, "source").split(None, 1)[1] == "measured"
    assert "5 real (1 OOM), 2 fake in" in _line(sheet, "trials")


def test_an_fsdp_estimate_says_what_its_figures_are() -> None:
    profile = make_profile(strategy="fsdp", world_size=8, source="estimate")
    sheet = datasheet(profile)
    assert "fsdp over 8 ranks" in _line(sheet, "strategy") and "one rank's" in _line(sheet, "strategy")
    assert "estimate (fake-tensor trials only" in _line(sheet, "source")
    assert trial_counts(profile) == "0 real, 5 fake"
    assert _line(sheet, "peak at").endswith("estimated)")


def test_ddp_over_several_replicas_is_named() -> None:
    assert "ddp over 4 replicas" in datasheet(make_profile(world_size=4))


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["profiles", "ls", "--strategy", "fsdp", "--world-size", "8"], {"strategy": "fsdp", "world_size": 8}),
        (["profiles", "ls", "--source", "estimate"], {"source": "estimate"}),
    ],
)
def test_profiles_ls_passes_the_new_filters(
    argv: list[str], expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from autotune.cli import client_commands

    seen: dict[str, Any] = {}
    monkeypatch.setattr(client_commands, "profiles_command", lambda **kwargs: seen.update(kwargs) or 0)
    args = build_parser().parse_args(argv)
    assert args.run(args) == 0
    assert seen["filters"] == expected


def test_suggest_passes_the_strategy_and_refuses_an_unknown_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.cli import client_commands

    seen: dict[str, Any] = {}
    monkeypatch.setattr(client_commands, "suggest_command", lambda **kwargs: seen.update(kwargs) or 0)
    base = ["suggest", "--fingerprint", "ab" * 32, "--target-batch", "64", "--device-name", "cpu"]
    args = build_parser().parse_args([*base, "--strategy", "fsdp", "--world-size", "8"])
    assert args.run(args) == 0 and (seen["strategy"], seen["world_size"]) == ("fsdp", 8)
    args = build_parser().parse_args(base)
    args.run(args)
    assert seen["strategy"] == "ddp"
    with pytest.raises(SystemExit):
        build_parser().parse_args([*base, "--strategy", "zero3"])


def test_the_step_phase_recorded_by_a_real_trial_is_the_floor_of_predictions() -> None:
    from autotune.core.schemas import Fit, Profile

    gib = 2**30
    profile = Profile.model_validate(
        {
            "fingerprint": "ab" * 16,
            "task": "t",
            "device": {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"},
            "budget_bytes": 80 * gib,
            "headroom": 0.0,
            "max_micro_batch": 24,
            "fit": Fit(fixed_bytes=gib, bytes_per_sample=gib).model_dump(),
            "trials": [
                {"micro_batch": 1, "peak_bytes": 2 * gib, "fits": True, "fake": True},
                {"micro_batch": 24, "peak_bytes": 25 * gib, "fits": True, "step_bytes": 20 * gib},
                {"micro_batch": 25, "peak_bytes": 81 * gib, "fits": False, "oom": True},
            ],
        }
    )
    assert profile.step_floor_bytes == 20 * gib
    assert profile.predicted_peak(3) == 20 * gib  # the step phase, not the line's 4 GiB
    assert profile.predicted_peak(22) == 23 * gib  # the line above it
