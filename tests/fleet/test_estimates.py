"""`autotune fleet --gpu`: one emulated-card estimate per task × card × budget, each a Ray task on a CPU,
stored like the probes' profiles, and the one-line refusals made before any cluster time.

The emulated runs need a CUDA build of torch (``make .venv-cuda``, which ``make test`` builds); without one
they skip, saying so, except under CI=true, where a skip would hide a failure.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.cli.common import EXIT_USAGE
from autotune.core.cards import lookup
from autotune.emulation import CudaTorchMissing
from autotune.fleet import EstimateOptions, Pair, Progress, Stored, estimate_pair, make_pairs, parse_cards
from autotune.orchestrate.estimate import EstimateConfig
from tests.e2e.conftest import REPO, LiveServer, autotune_command

from .conftest import FLEET_TIMEOUT_SECONDS, RayCluster, fleet_env, stored_profiles

GPT = "examples/gpt.py:task"
CARDS = ("h100", "a100-80gb")
# 1 GiB less 10 % headroom, 845 MiB of it outside the allocator: the boundary lies inside the cap on both
# cards (m = 12 on the H100, whose cuBLAS workspaces take 64 MiB, and 61 on the A100), in a few fake trials.
ESTIMATE_FLAGS = ["--budget", "1GiB", "--context-bytes", "845MiB", "--max-micro-batch", "64", "--target-batch", "256"]
GiB = 1 << 30


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def _estimate_json(card: str, tmp_path: Path) -> dict[str, object]:
    """What `autotune estimate GPT --gpu CARD` answers for the fleet's flags."""
    out = tmp_path / f"{card}.json"
    assert main(["estimate", GPT, "--gpu", card, *ESTIMATE_FLAGS, "--output", str(out)]) == 0
    profile: dict[str, object] = json.loads(out.read_text())
    return profile


def test_two_cards_store_one_estimate_each_as_autotune_estimate_answers(
    cuda_python: str, ray_cluster: RayCluster, fleet_server: LiveServer, tmp_path: Path
) -> None:
    output = tmp_path / "profiles"
    # The fleet runs while this process makes the reference estimate: the machine has two cores.
    fleet = subprocess.Popen(
        [*autotune_command(), "fleet", GPT, "--gpu", ",".join(CARDS), *ESTIMATE_FLAGS, "--server", fleet_server.url,
         "--output", str(output), "--ray-address", ray_cluster.address, "--json"],
        cwd=REPO, env=fleet_env(ray_cluster, fleet_server, AUTOTUNE_CUDA_PYTHON=cuda_python),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        # One reference is enough to show the fleet runs what `autotune estimate` runs; the pinned answers
        # below (12 and 61) hold the other card (each emulated estimate costs a child's torch import).
        answers = {CARDS[0]: _estimate_json(CARDS[0], tmp_path)}
        out, err = fleet.communicate(timeout=FLEET_TIMEOUT_SECONDS)
    finally:
        if fleet.poll() is None:
            fleet.kill()
            fleet.communicate()
    done = subprocess.CompletedProcess(fleet.args, fleet.returncode, out, err)
    assert done.returncode == 0, _explain(done)
    rows = json.loads(out)
    assert [(row["on"], row["budget_bytes"], row["state"]) for row in rows] == [
        (f"{card} (emulated)", GiB, "done") for card in CARDS
    ], _explain(done)
    assert all(row["note"] is None for row in rows), _explain(done)  # emulated, not CPU semantics
    stored = {item["id"]: item for item in stored_profiles(fleet_server, task="gpt-small")}
    for row, card in zip(rows, CARDS, strict=True):
        item = stored[row["profile_id"]]
        assert item["device_name"] == lookup(card).nvml_name
        assert item["source"] == "estimate" and item["device_kind"] == "cuda"
        assert row["max_micro_batch"] == item["max_micro_batch"]
        if card in answers:
            answer = answers[card]
            assert answer["device"]["name"] == item["device_name"]  # type: ignore[index]
            assert row["max_micro_batch"] == answer["max_micro_batch"], (card, answer)
    # The boundary is inside the cap on both cards, and not the same one: each card was emulated as itself.
    assert [row["max_micro_batch"] for row in rows] == [12, 61]
    written = sorted(output.glob("*.json"))
    assert len(written) == 2 and {json.loads(f.read_text())["source"] for f in written} == {"estimate"}


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpu", "h100,v100"], "--gpu: unknown card 'v100': known cards are h100, h100-pcie, h200"),
        (["--gpu", "h100", "--accelerators", "H100"], "argument --accelerators: not allowed with argument --gpu"),
        (["--gpu", "h100", "--device", "cpu"], "argument --device: not allowed with argument --gpu"),
        (["--gpu", "h100", "--no-presearch"], "--no-presearch is a probe's option, not an estimate's (--gpu)"),
        (["--gpu", "h100", "--objective", "throughput"], "--objective throughput is a probe's option"),
        (["--gpu", "h100", "--seq-len", "64", "--target-tokens", "4096"], "--target-tokens is not planned"),
        (["--gpu", "l4", "--context-bytes", "30GiB"], "--context-bytes must be at least 0 and below the l4's memory"),
        (["--device", "cpu", "--budget", "8MiB", "--context-bytes", "1GiB"], "--context-bytes applies to estimates"),
    ],
)
def test_estimate_usage_errors_are_one_line_and_exit_2_before_any_cluster_time(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["fleet", GPT, "--output", "never-written", *argv])
    except SystemExit as exc:  # argparse's own errors (the parser prints one line and exits)
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and message in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and not Path("never-written").exists()


def _estimate_pairs(cards: list[str], budgets: list[int | None]) -> list[Pair]:
    def config_for(card: str, budget: int | None) -> EstimateConfig:
        return EstimateConfig.of(budget_bytes=budget, gpu=card, max_micro_batch=8)

    return make_pairs(
        [GPT], accelerators=None, device=None, cards=cards, budgets=budgets, config_for=config_for,
        working_dir=REPO, estimate=EstimateOptions(),
    )  # fmt: skip


def test_an_estimate_pair_asks_ray_for_one_cpu_and_no_gpu_with_the_cards_memory_as_its_budget() -> None:
    assert parse_cards(" H100,nvidia a100-sxm4-80gb ,h100") == ["h100", "a100-80gb"]
    h100, a100 = _estimate_pairs(parse_cards("h100,a100-80gb"), [None])
    assert h100.ray_options(3) == {"num_cpus": 1, "max_retries": 3} and not h100.needs_gpu
    assert (h100.on, h100.accelerator, h100.config.card.short_name) == ("h100 (emulated)", None, "h100")
    assert h100.budget_bytes == lookup("h100").device_total_bytes
    assert a100.budget_bytes == lookup("a100-80gb").memory_bytes  # no CUDA figure known: NVML's
    assert h100.label == f"{GPT} on h100 (emulated), budget {h100.budget_label}"


def test_a_card_not_emulated_on_its_node_is_an_estimate_with_cpu_semantics_and_the_row_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As `autotune estimate --gpu` does on a host without a CUDA build of torch; the store gets the weaker
    figure, so the fleet's row names why."""
    import autotune.emulation.runner as runner
    from autotune.core.schemas import Profile
    from autotune.fleet.runner import _not_emulated

    def missing() -> str:
        raise CudaTorchMissing("no Python with a CUDA build of torch here: make .venv-cuda")

    monkeypatch.setattr(runner, "find_cuda_python", missing)
    (pair,) = _estimate_pairs(["h100"], [2 * GiB])
    outcome = estimate_pair(pair.index, pair.worker_spec, pair.config, EstimateOptions())
    assert outcome.error is None and outcome.profile_json is not None, outcome.error
    profile = Profile.model_validate_json(outcome.profile_json)
    assert profile.source == "estimate" and profile.device.name == "NVIDIA H100 80GB HBM3"
    assert profile.budget_bytes == 2 * GiB and profile.max_micro_batch == 8  # the cap: on the CPU meter's figures
    note = _not_emulated(profile)
    assert note is not None and "no Python with a CUDA build of torch here" in note
    progress = Progress([pair], io.StringIO(), live=False)
    progress.done(0, attempt=1, max_micro_batch=8, plan=None, stored=Stored(3, None, None), seconds=1.0, host="h",
                  note=note)  # fmt: skip
    assert progress.rows[0].result.startswith("profile 3; not emulated, CPU semantics: ")
    assert progress.rows[0].ok  # a done estimate, stored: as autotune estimate, not a failure
