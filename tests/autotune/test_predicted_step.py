"""The predicted step time of `autotune estimate --gpu` (issue 65): every throughput entry of an emulated estimate
says it is predicted, its parts add up, the datasheet prints "predicted", `recommend` ranks by it and says its
margin, and a card without the figures a prediction needs answers memory and names the missing figure in one line.

How close a prediction comes to a real step is bench/step_time.py's question (published runs) and
bench/card_calibration.py's (a card's own step, when one is lent); here the prediction's bookkeeping."""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.schemas import Profile

GPT = "examples/gpt.py:task"


@pytest.fixture(scope="module")
def two_policies(cuda_python: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Profile], str]:
    """The GPT example under fsdp over 2 ranks on an emulated H100, with no checkpointing and with full, for a target
    of 96: the profiles and what the command printed."""
    out = tmp_path_factory.mktemp("predicted") / "gpt.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(
            ["estimate", GPT, "--gpu", "h100", "--budget", "8GiB", "--strategy", "fsdp", "--world-size", "2",
             "--target-batch", "96", "--max-micro-batch", "32", "--ac", "none,full", "--objective", "throughput",
             "--output", str(out)]
        )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    return [Profile.model_validate(item) for item in data], printed.getvalue()


def test_every_entry_of_an_emulated_estimate_is_predicted_and_adds_up(two_policies: tuple[list[Profile], str]) -> None:
    profiles, _ = two_policies
    for profile in profiles:
        assert profile.source == "estimate" and profile.throughput
        assert profile.plan is not None
        # One micro-batch of m_max, then the plan's update (32 x 3 over D = 2 holds 96 with m_max 32: one entry).
        assert [t.micro_batches for t in profile.throughput][0] == [(profile.max_micro_batch, 1)]
        for timing in profile.throughput:
            assert timing.predicted and timing.parts is not None
            parts = timing.parts
            total = (parts.compute_seconds + parts.exposed_communication_seconds + parts.bubble_seconds
                     + parts.optimizer_seconds)  # fmt: skip
            assert math.isclose(total, timing.seconds_per_update, rel_tol=1e-4)
            samples = timing.world_size * sum(size * count for size, count in timing.micro_batches)
            assert math.isclose(timing.samples_per_second, samples / timing.seconds_per_update, rel_tol=1e-3)
            # The example's samples are 64 tokens (its seq_len tag), over the job's 2 GPUs.
            assert timing.tokens_per_second_per_gpu == pytest.approx(timing.samples_per_second * 64 / 2, rel=1e-3)
            assert timing.mfu is not None and 0 < timing.mfu < 1
            assert parts.bubble_seconds == 0  # no pipeline
        assert any(w.startswith("predicted step time: ") and "a prediction, not a measurement" in w
                   for w in profile.warnings)  # fmt: skip
    none, full = profiles
    assert none.activation_checkpointing == "none" and full.activation_checkpointing == "full"
    assert none.throughput and full.throughput
    assert none.throughput[0].parts and none.throughput[0].parts.recompute_seconds == 0
    # Full checkpointing recomputes each block's forward inside backward: said, and part of compute.
    assert full.throughput[0].parts and full.throughput[0].parts.recompute_seconds > 0


def test_the_datasheet_says_predicted_and_recommend_ranks_by_it_with_its_margin(
    two_policies: tuple[list[Profile], str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profiles, printed = two_policies
    assert "(predicted)" in printed and "parts          compute " in printed
    per_gpu = {p.activation_checkpointing: _per_gpu(p) for p in profiles}
    best = max(per_gpu, key=lambda policy: per_gpu[policy])
    other = min(per_gpu, key=lambda policy: per_gpu[policy])
    ahead = per_gpu[best] / per_gpu[other] - 1
    line = next(line for line in printed.splitlines() if line.startswith("recommended:"))
    assert line.startswith(f"recommended: --ac {best}: ") and "predicted" in line
    assert f"predicted {ahead:.1%} faster than --ac {other}" in line
    # `autotune recommend` over the written profiles says the same.
    paths = []
    for profile in profiles:
        path = tmp_path / f"{profile.activation_checkpointing}.json"
        path.write_text(profile.model_dump_json())
        paths.append(str(path))
    assert main(["recommend", *paths]) == 0
    said = capsys.readouterr().out
    assert said.startswith(f"recommended: --ac {best}: ") and f"{ahead:.1%} faster than --ac {other}" in said


def _per_gpu(profile: Profile) -> float:
    """Samples per second per GPU of the profile's plan, from its predicted entry of that plan."""
    assert profile.plan is not None and profile.throughput
    (timing,) = [t for t in profile.throughput if t.micro_batches == profile.plan.micro_batches]
    return timing.samples_per_second / profile.world_size


def test_a_card_without_peaks_answers_memory_and_names_the_missing_figure(
    cuda_python: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The A10G is AWS's card: NVIDIA publishes no peaks of it, so the catalog has none, and nothing is guessed."""
    code = main(["estimate", GPT, "--gpu", "a10g", "--budget", "4GiB", "--max-micro-batch", "8", "--json"])
    assert code == 0
    profile = Profile.model_validate(json.loads(capsys.readouterr().out))
    assert profile.max_micro_batch == 8 and profile.throughput is None
    missing = [w for w in profile.warnings if w.startswith("no predicted step time")]
    assert missing == [
        "no predicted step time: the a10g's dense fp32 peak and memory bandwidth are not in the catalog (give "
        "--peak-tflops and --memory-tbytes-per-s); the memory figures stand"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--budget", "8GiB", "--peak-tflops", "900"],
            "--peak-tflops is a figure of the predicted step time on a card",
        ),
        (["--gpu", "h100", "--peak-tflops", "0"], "argument --peak-tflops: '0' must be above 0"),
        (["--gpu", "h100", "--network-gbits-per-s", "nan"], "'nan' is not a finite number"),
        (["--gpu", "h100", "--gpus-per-node", "0"], "--gpus-per-node"),
    ],
)
def test_bad_figures_are_one_line_and_exit_2(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(["estimate", GPT, *args])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_pipelines_prediction_takes_its_slowest_stage_and_the_schedules_bubble(
    cuda_python: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each stage's replay is recorded; the update is K micro-batches of the slowest stage plus the schedule's
    bubble, (pp - 1) / V of a micro-batch's forward and backward: here 1F1B over 2 stages, K = 4."""
    code = main(
        ["estimate", "hf:examples/configs/tiny-llama.json", "--gpu", "h100", "--seq-len", "64", "--max-seq-len", "64",
         "--world-size", "2", "--pp", "2", "--pp-microbatches", "4", "--max-micro-batch", "8", "--target-batch", "32",
         "--no-breakdown", "--json"]
    )  # fmt: skip
    assert code == 0
    (data,) = json.loads(capsys.readouterr().out)
    profile = Profile.model_validate(data)
    assert profile.throughput is not None
    (timing,) = profile.throughput  # m_max 8 in K = 4 micro-batches is the plan of 32 over D = 1
    assert timing.predicted and timing.micro_batches == [(8, 4)] and timing.parts is not None
    forward_backward = timing.parts.compute_seconds + timing.parts.exposed_communication_seconds
    assert timing.parts.bubble_seconds == pytest.approx(forward_backward / 4, rel=1e-3)
    assert timing.per_update_seconds == pytest.approx(timing.parts.bubble_seconds, rel=1e-3)
    assert timing.micro_batch_seconds == [(8, pytest.approx(forward_backward / 4, rel=1e-3))]
