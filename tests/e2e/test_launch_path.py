"""The job-launch path end to end, with a real ``autotune serve`` and separate processes.

1. ``autotune probe examples/mlp.py:task --server URL`` measures and stores a profile;
2. a training job (its own process) calls ``suggest(model, T)`` for that model and gets the stored
   plan with no measurement at all (every entry into a trial is a failing sentinel there);
3. ``autotune suggest --fingerprint ...`` gives launch scripts the same plan;
4. a job with a model nobody probed measures it locally and uploads the profile;
5. a third job with that model gets it from the store, measured, again with no trial.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from autotune.core.schemas import Profile, Suggestion
from autotune_client import TunerClient
from tests import warm_cli
from tests.e2e.conftest import REPO, LiveServer, autotune_command

JOB = str(REPO / "tests" / "e2e" / "_launch_job.py")
TARGET_BATCH = 256
PROCESS_TIMEOUT_SECONDS = 240


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return warm_cli.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_SECONDS, check=False
    )


def launch_job(server: LiveServer, *args: str, **env: str) -> tuple[Suggestion, int]:
    import sys

    done = run([sys.executable, JOB, *args], server.env(**env))
    assert done.returncode == 0, f"job failed:\n{done.stderr[-3000:]}"
    answer: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return Suggestion.model_validate(answer["suggestion"]), int(answer["trials_attempted"])


@pytest.fixture(scope="module")
def probed_mlp(live_server: LiveServer) -> Profile:
    """Step 1: the CLI probes the MLP example on the CPU and uploads it."""
    done = run(
        [
            *autotune_command(),
            "probe",
            "examples/mlp.py:task",
            "--device",
            "cpu",
            "--budget",
            "64MiB",
            "--target-batch",
            str(TARGET_BATCH),
            "--json",
            "--server",
            live_server.url,
        ],
        live_server.env(),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "uploaded as profile" in done.stderr
    return Profile.model_validate_json(done.stdout)


def stored(server: LiveServer) -> list[Any]:
    with TunerClient(base_url=server.url) as client:
        return client.profiles()


def test_the_probe_cli_stores_the_profile(live_server: LiveServer, probed_mlp: Profile) -> None:
    rows = stored(live_server)
    assert [(r.fingerprint, r.task, r.device_name) for r in rows] == [(probed_mlp.fingerprint, "mlp", "cpu")]
    with TunerClient(base_url=live_server.url) as client:
        assert client.profile(rows[0].id).profile.trials == probed_mlp.trials


def test_a_job_gets_the_stored_plan_without_measuring(live_server: LiveServer, probed_mlp: Profile) -> None:
    (row,) = stored(live_server)
    # WORLD_SIZE=2, as torchrun sets it: two replicas share the target batch.
    suggestion, trials = launch_job(live_server, "mlp", str(TARGET_BATCH), "--forbid-trials", WORLD_SIZE="2")
    assert trials == 0
    assert suggestion.source == "measured"
    assert suggestion.profile_id == row.id
    assert suggestion.fingerprint == probed_mlp.fingerprint
    assert suggestion.world_size == 2
    assert suggestion.max_micro_batch == probed_mlp.max_micro_batch
    assert suggestion.micro_batch <= probed_mlp.max_micro_batch
    assert (
        suggestion.micro_batch * suggestion.accumulation_steps * 2
        == suggestion.effective_batch
        == TARGET_BATCH
    )
    assert len(stored(live_server)) == 1  # nothing was uploaded


def test_a_launch_script_gets_the_same_plan_from_the_cli(
    live_server: LiveServer, probed_mlp: Profile
) -> None:
    done = run(
        [
            *autotune_command(),
            "suggest",
            "--server",
            live_server.url,
            "--fingerprint",
            probed_mlp.fingerprint,
            "--target-batch",
            str(TARGET_BATCH),
            "--world-size",
            "1",
            "--device-name",
            "cpu",
            "--json",
        ],
        live_server.env(),
    )
    assert done.returncode == 0, done.stderr
    suggestion = Suggestion.model_validate_json(done.stdout)
    assert probed_mlp.plan is not None
    assert (suggestion.source, suggestion.micro_batch, suggestion.accumulation_steps) == (
        "measured",
        probed_mlp.plan.micro_batch,
        probed_mlp.plan.accumulation_steps,
    )


def test_an_unknown_model_is_probed_uploaded_and_then_served(
    live_server: LiveServer, probed_mlp: Profile
) -> None:
    before = {r.id for r in stored(live_server)}
    first, _ = launch_job(live_server, "wide", "64", "--budget", "8MiB")
    assert first.source == "probed"
    assert first.profile_id is not None and first.profile_id not in before
    assert first.fingerprint != probed_mlp.fingerprint
    rows = {r.id: r for r in stored(live_server)}
    assert set(rows) == before | {first.profile_id}
    uploaded = rows[first.profile_id]
    assert (uploaded.fingerprint, uploaded.device_name, uploaded.budget_bytes) == (
        first.fingerprint,
        "cpu",
        8 << 20,
    )

    # A third process, same model: from the store, measured, and nothing run.
    again, trials = launch_job(live_server, "wide", "64", "--budget", "8MiB", "--forbid-trials")
    assert trials == 0
    assert again.source == "measured"
    assert again.profile_id == first.profile_id
    assert (again.micro_batch, again.accumulation_steps) == (first.micro_batch, first.accumulation_steps)
    assert {r.id for r in stored(live_server)} == set(rows)


def test_the_sentinel_would_catch_a_measurement(live_server: LiveServer) -> None:
    # The proof above is only as good as the sentinel: a job that must measure, with trials
    # forbidden, fails and reports the attempt.
    import sys

    args = [sys.executable, JOB, "wide", "48", "--budget", "4MiB", "--tag", "never-probed", "--forbid-trials"]
    done = run(args, live_server.env())
    assert done.returncode != 0
    assert '"trials_attempted": 1' in done.stderr
    assert "a measurement was started" in done.stderr


DOC_SECTION = "## Use it from a training script"


def documented_script(path: Path) -> str | None:
    """The first python block under the section heading, or None when the file has no such section."""
    text = path.read_text()
    if DOC_SECTION not in text:
        return None
    rest = text.split(DOC_SECTION, 1)[1]
    match = re.search(r"```python\n(.*?)```", rest, re.DOTALL)
    assert match, f"{path.name}: no python block under {DOC_SECTION!r}"
    return match.group(1)


def test_the_documented_training_script_runs_as_written(live_server: LiveServer, tmp_path: Path) -> None:
    import sys

    example = (REPO / "examples" / "train_with_suggest.py").read_text()
    blocks = {"docs/client.md": documented_script(REPO / "docs" / "client.md")}
    if (REPO / "README.md").exists():
        blocks["README.md"] = documented_script(REPO / "README.md")
    assert blocks["docs/client.md"] is not None
    for where, block in blocks.items():
        if block is not None:
            assert block == example, f"the script in {where} differs from examples/train_with_suggest.py"

    script = tmp_path / "train.py"  # run from elsewhere, as a user's own script
    script.write_text(blocks["docs/client.md"] or "")
    outputs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=live_server.env(),
            capture_output=True,
            text=True,
            timeout=PROCESS_TIMEOUT_SECONDS,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        outputs.append(done.stdout)
    first = re.search(r"plan: (\d+) x (\d+) x 1 = 256 \((\w+), profile (\d+)\)", outputs[0])
    second = re.search(r"plan: (\d+) x (\d+) x 1 = 256 \((\w+), profile (\d+)\)", outputs[1])
    assert first and second, outputs
    assert first.group(3) == "probed" and second.group(3) == "measured"  # stored by the first run
    assert first.group(4) == second.group(4)
    assert first.groups()[:2] == second.groups()[:2]
    losses = [float(x) for x in re.findall(r"epoch \d+: loss ([0-9.]+)", outputs[1])]
    assert len(losses) == 3 and losses[-1] < losses[0] / 2  # it trains
    updates = re.search(r"updates=(\d+)", outputs[1])
    assert updates and int(updates.group(1)) == 3 * 4096 // 256  # one update per 256 samples
