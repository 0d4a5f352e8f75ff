"""`autotune fleet` end to end: real probes of the examples on the CPU meter as Ray tasks on a local
2-CPU cluster, uploaded to a live ``autotune serve``, and the faults the issue names: a worker killed
mid-probe, a task that raises, the server down, Ctrl-C.

Each test looks at the store through the API, filtered by its own tasks, so they hold in any order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx2 as httpx

from tests import warm_cli
from tests.e2e.conftest import REPO, LiveServer, autotune_command, free_port

from .conftest import FAKE_ACCELERATOR, FLEET_TIMEOUT_SECONDS, RayCluster, fleet_env, run_fleet_cli, stored_profiles

# Two examples at two budgets show the tasks x budgets product as well as more would: the cheapest
# (the MLP, and the CNN at small budgets, where its boundary is a micro-batch of 9 to 14). bench/fleet.py
# runs the three examples at 8 and 16 MiB, timed against `autotune probe` one after another.
EXAMPLES = ["examples/mlp.py:task", "examples/cnn.py:task"]
BUDGETS_MIB = (4, 6)
# No timed run after the search where a test is not about it: it adds seconds per pair. The probes'
# default (timed) runs in test_worker_killed_mid_probe_is_retried_and_stored_once, which checks it stored.
NO_THROUGHPUT = "--no-throughput"
CPU_ARGS = ["--device", "cpu", "--budget", ",".join(f"{b}MiB" for b in BUDGETS_MIB), "--target-batch", "256",
            NO_THROUGHPUT]  # fmt: skip
MiB = 1 << 20


def _rows(done: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = json.loads(done.stdout)
    return rows


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\nstdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-6000:]}"


def test_two_examples_at_two_budgets_store_four_profiles(ray_cluster: RayCluster, fleet_server: LiveServer) -> None:
    done = run_fleet_cli(
        [*EXAMPLES, *CPU_ARGS, "--server", fleet_server.url, "--ray-address", ray_cluster.address, "--json"],
        env=fleet_env(ray_cluster, fleet_server),
    )
    assert done.returncode == 0, _explain(done)
    rows = _rows(done)
    assert [(row["task"], row["budget_bytes"], row["state"]) for row in rows] == [
        (spec, budget * MiB, "done") for spec in EXAMPLES for budget in BUDGETS_MIB
    ]
    assert all(" = 256 (" in str(row["plan"]) for row in rows), _explain(done)  # --target-batch 256, planned
    ids = {row["profile_id"] for row in rows}
    stored = {item["id"]: item for item in stored_profiles(fleet_server)}
    assert len(ids) == 4 and ids <= set(stored), _explain(done)
    assert sorted((stored[i]["task"], stored[i]["budget_bytes"]) for i in ids) == sorted(
        (name, budget * MiB) for name in ("mlp", "cnn-bn") for budget in BUDGETS_MIB
    )
    # The live view's counterpart in a log: every pair went pending -> running -> done.
    assert done.stderr.count(": running") >= 4 and "4 done, 0 failed" in done.stderr, _explain(done)


def test_worker_killed_mid_probe_is_retried_and_stored_once(ray_cluster: RayCluster, fleet_server: LiveServer) -> None:
    spec = "tests/fleet/_tasks.py:killed_once"
    marker = ray_cluster.marker_dir / "killed_once.marker"
    marker.unlink(missing_ok=True)
    done = run_fleet_cli(
        [spec, "--device", "cpu", "--budget", "4MiB", "--server", fleet_server.url,
         "--ray-address", ray_cluster.address, "--json"],
        env=fleet_env(ray_cluster, fleet_server),
    )  # fmt: skip
    assert done.returncode == 0, _explain(done)
    assert marker.exists(), "the first attempt did not reach the kill: the test proves nothing"
    (row,) = _rows(done)
    assert row["state"] == "done" and row["attempts"] == 2, _explain(done)
    assert "running (attempt 2)" in done.stderr, _explain(done)
    stored = stored_profiles(fleet_server, task="fleet-killed-once")
    assert [item["id"] for item in stored] == [row["profile_id"]]
    # The probe's default timed run after the search happened in the worker and travelled with the profile.
    profile = httpx.get(f"{fleet_server.url}/api/v1/profiles/{row['profile_id']}", timeout=10.0).json()
    assert profile["profile"]["throughput"], profile


def test_a_task_that_raises_fails_alone_with_its_one_line_error(
    ray_cluster: RayCluster, fleet_server: LiveServer
) -> None:
    specs = ["tests/fleet/_tasks.py:broken", "examples/mlp.py:task"]
    done = run_fleet_cli(
        [*specs, "--device", "cpu", "--budget", "4MiB", NO_THROUGHPUT, "--server", fleet_server.url,
         "--ray-address", ray_cluster.address, "--json"],
        env=fleet_env(ray_cluster, fleet_server),
    )  # fmt: skip
    assert done.returncode == 1, _explain(done)
    broken, mlp = _rows(done)
    assert broken["state"] == "failed" and mlp["state"] == "done", _explain(done)
    error = str(broken["error"])
    assert "broken on purpose" in error and "\n" not in error, error
    assert broken["attempts"] == 1  # an error is an answer: not retried
    assert "1 of 2 pairs failed" in done.stderr
    summary_line = next(line for line in done.stderr.splitlines() if line.startswith("0 "))
    assert "failed" in summary_line and "broken on purpose" in summary_line
    assert stored_profiles(fleet_server, task="fleet-broken") == []
    assert mlp["profile_id"] in [item["id"] for item in stored_profiles(fleet_server, task="mlp")]


def test_server_down_keeps_the_profiles_for_a_later_upload(
    ray_cluster: RayCluster, fleet_server: LiveServer, tmp_path: Path
) -> None:
    """Also the local path: without --ray-address the fleet starts its own Ray instance."""
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    output = tmp_path / "profiles"
    before = {item["id"] for item in stored_profiles(fleet_server)}
    done = run_fleet_cli(
        ["examples/mlp.py:task", "--device", "cpu", "--budget", "4MiB,8MiB", NO_THROUGHPUT, "--server", down,
         "--output", str(output)],
        env=fleet_env(ray_cluster, fleet_server),
    )  # fmt: skip
    assert done.returncode == 1, _explain(done)
    assert "starting a local Ray instance" in done.stderr
    assert f"autotune profiles upload {output}" in done.stderr, _explain(done)
    files = sorted(output.glob("*.json"))
    assert len(files) == 2 and not list(output.glob("*.tmp")), _explain(done)
    assert sorted(json.loads(f.read_text())["budget_bytes"] for f in files) == [4 * MiB, 8 * MiB]

    upload = warm_cli.run(
        [*autotune_command(), "profiles", "upload", str(output), "--server", fleet_server.url],
        cwd=REPO, env=fleet_env(ray_cluster, fleet_server), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert upload.returncode == 0, _explain(upload)
    added = [item for item in stored_profiles(fleet_server) if item["id"] not in before]
    assert sorted(item["budget_bytes"] for item in added) == [4 * MiB, 8 * MiB]
    again = warm_cli.run(
        [*autotune_command(), "profiles", "upload", str(output), "--server", fleet_server.url],
        cwd=REPO, env=fleet_env(ray_cluster, fleet_server), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0 and again.stdout == upload.stdout  # the same ids: stored once
    assert len(stored_profiles(fleet_server)) == len(before) + 2


def _wait_for(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.2)
    return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_cancels_the_tasks_and_stores_nothing(ray_cluster: RayCluster, fleet_server: LiveServer) -> None:
    markers = ray_cluster.marker_dir
    for old in markers.glob("slow-*"):
        old.unlink()
    # Three pairs on two CPUs: two run (and sleep), one waits for a CPU.
    # Ctrl-C at a terminal reaches a process whose SIGINT has its default disposition; a suite started as a
    # background job of a non-interactive shell has SIGINT ignored, which every child would inherit (and
    # Python then installs no KeyboardInterrupt for it): the child gets the terminal's disposition back.
    process = subprocess.Popen(
        [*autotune_command(), "fleet", "tests/fleet/_tasks.py:slow", "--device", "cpu", "--budget", "4MiB,5MiB,6MiB",
         "--server", fleet_server.url, "--ray-address", ray_cluster.address],
        cwd=REPO, env=fleet_env(ray_cluster, fleet_server), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        started = _wait_for(lambda: len(list(markers.glob("slow-started-*"))) >= 2, FLEET_TIMEOUT_SECONDS / 2)
        assert started, "the slow tasks never started"
        pids = [int(path.read_text()) for path in markers.glob("slow-started-*")]
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()  # reaps it and closes its pipes
    assert process.returncode == 130, err
    assert err.rstrip().splitlines()[-1] == "autotune: interrupted", err
    assert "cancelled 3 unfinished task(s)" in err, err
    # ray.cancel(force=True) killed the running workers; the pending pair never started.
    assert _wait_for(lambda: not any(_alive(pid) for pid in pids), 30), "a cancelled probe's worker lives on"
    time.sleep(2)
    assert len(list(markers.glob("slow-started-*"))) == 2 and not list(markers.glob("slow-finished-*"))
    assert stored_profiles(fleet_server, task="fleet-slow") == []
    assert out == ""  # no summary of a run that was cut short


def test_an_accelerator_pair_gets_one_gpu_of_its_kind(ray_cluster: RayCluster, fleet_server: LiveServer) -> None:
    """The cluster's T4 is a Ray resource only: Ray places the pair on it with one GPU, and the probe
    then fails on this CPU-only torch, which is the pair's one-line error."""
    for old in ray_cluster.marker_dir.glob("assigned-*.json"):
        old.unlink()
    done = run_fleet_cli(
        ["tests/fleet/_gpu_task.py:where", "--accelerators", FAKE_ACCELERATOR, "--server", fleet_server.url,
         "--ray-address", ray_cluster.address, "--json"],
        env=fleet_env(ray_cluster, fleet_server),
    )  # fmt: skip
    assert done.returncode == 1, _explain(done)
    (row,) = _rows(done)
    assert row["state"] == "failed" and row["on"] == FAKE_ACCELERATOR and row["budget_bytes"] is None
    assert str(row["error"]).startswith("DeviceError: CUDA is not available"), _explain(done)
    assert "no node of this cluster has a GPU of kind" not in done.stderr
    (assigned_file,) = ray_cluster.marker_dir.glob("assigned-*.json")
    assigned = json.loads(assigned_file.read_text())
    assert assigned["resources"]["GPU"] == 1 and f"accelerator_type:{FAKE_ACCELERATOR}" in assigned["resources"]
    assert assigned["cuda_visible_devices"] == "0"


def test_a_pair_over_sequence_lengths_stores_a_profile_per_length(
    ray_cluster: RayCluster, fleet_server: LiveServer
) -> None:
    done = run_fleet_cli(
        ["tests/fleet/_tasks.py:tiny_seq", "--device", "cpu", "--budget", "8MiB", "--seq-len", "64,128",
         "--target-tokens", "4096", NO_THROUGHPUT, "--server", fleet_server.url,
         "--ray-address", ray_cluster.address, "--json"],
        env=fleet_env(ray_cluster, fleet_server),
    )  # fmt: skip
    assert done.returncode == 0, _explain(done)
    (row,) = _rows(done)
    assert row["state"] == "done" and "L=64: " in str(row["plan"]) and "L=128: " in str(row["plan"]), _explain(done)
    stored = [item for item in stored_profiles(fleet_server) if item["task"] == "tiny-seq"]
    assert sorted(item["seq_len"] for item in stored) == [64, 128], stored
    assert len({item["fingerprint"] for item in stored}) == 1
