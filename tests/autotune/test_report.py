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


# -- issue 62, item 8: the lines said plainly ------------------------------------------------------------------


def test_an_over_the_card_fake_trial_says_so_without_a_peak_or_a_time() -> None:
    """Before: `trial m=2 peak 79.19 GiB fake OOM 0.00s`, the card's size read as a peak and a time of zero."""
    from autotune.cli.report import trial_line
    from autotune.core.schemas import Trial

    over = Trial(micro_batch=2, peak_bytes=85_000_000_001, fits=False, oom=True, fake=True)
    on_card = trial_line(over, 72 * 2**30, memory="the card")
    assert on_card == "trial m=2      over the card (a fake trial: out of memory)"
    assert trial_line(over, 72 * 2**30) == "trial m=2      over the budget (a fake trial: out of memory)"
    # A real trial that ran out keeps its reading and its time.
    real = Trial(micro_batch=3, peak_bytes=2**30, fits=False, oom=True, seconds=1.5)
    assert trial_line(real, 2**30) == "trial m=3      peak    1.00 GiB  OOM               1.50s"


def test_each_trial_line_of_a_run_over_lengths_names_its_length() -> None:
    from autotune.cli.report import trial_line
    from autotune.core.schemas import Trial
    from autotune.search.boundary import at_length

    trial = Trial(micro_batch=4, peak_bytes=2**20, fits=True, seconds=0.25)
    heard: list[Trial] = []
    report = at_length(heard.append, 512)
    assert report is not None
    report(trial)
    assert trial_line(heard[0], 2**21) == (
        "trial L=512    m=4      peak    1.00 MiB ( 50.0% of limit)  fits              0.25s"
    )
    # The label is the progress line's only: never on the wire, and the trial reported is a copy.
    assert "seq_len" not in heard[0].model_dump() and trial.reported_length is None
    assert at_length(heard.append, None) is not None and at_length(None, 512) is None


def test_the_device_is_named_once() -> None:
    from autotune.cli.report import device_text
    from autotune.core.schemas import Device

    assert device_text(Device(kind="cpu", name="cpu (estimate)")) == "cpu (estimate)"  # was "cpu (estimate) (cpu)"
    assert device_text(Device(kind="cpu", name="cpu")) == "cpu"
    assert device_text(Device(kind="cuda", name="NVIDIA H100 80GB HBM3", index=0)) == "NVIDIA H100 80GB HBM3 (cuda:0)"
    assert device_text(Device(kind="cuda", name="NVIDIA H100 80GB HBM3")) == "NVIDIA H100 80GB HBM3 (cuda)"


def test_a_run_over_lengths_heads_each_length_once_and_says_what_limits_the_longest() -> None:
    """Before: `at L=32:` twice (once over the levers, once over the breakdown), and "limited by the model refuses
    longer"."""
    from autotune.cli.report import lengths_datasheet, longest_line
    from autotune.core.schemas import Lever, LongestSeqLen, MemoryBreakdown

    profiles = []
    for seq_len in (16, 32):
        profile = make_profile(max_micro_batch=8)
        profile.seq_len = seq_len
        peak = profile.peak_at(8)
        assert peak is not None
        profile.levers = [Lever(flags="--ac full", at_micro_batch=8, peak_bytes=peak // 2, freed_bytes=peak // 2,
                                max_micro_batch=16)]  # fmt: skip
        profile.breakdown = [
            MemoryBreakdown(micro_batch=8, fits=True, peak_bytes=peak, parts={"activations": peak}, peak_event=0,
                            events=1, timeline=[[0]], phases=[])
        ]  # fmt: skip
        profiles.append(profile)
    sheet = lengths_datasheet(profiles)
    assert sheet.count("  at L=") == 1 and "  at L=32:" in sheet
    heading = sheet.splitlines().index("  at L=32:")
    assert sheet.splitlines()[heading + 1].startswith("  levers")
    assert any(line.startswith("  memory at peak") for line in sheet.splitlines()[heading:])
    longest = LongestSeqLen(micro_batch=1, seq_len=2048, peak_bytes=2**30, limited_by="model", cap=4096,
                            note="max_position_embeddings 2048")  # fmt: skip
    assert longest_line(longest) == (
        "  longest L at m=1: 2048 (1.00 GiB; limited by the model: it takes no longer sequence): "
        "max_position_embeddings 2048"
    )
