"""One local Ray cluster for the fleet tests (2 CPUs, loopback only, one pretend T4 GPU) and a live
``autotune serve``.

    def test_something(ray_cluster: RayCluster, fleet_server: LiveServer) -> None:
        done = run_fleet_cli([..., "--ray-address", ray_cluster.address, "--server", fleet_server.url],
                             env=fleet_env(ray_cluster, fleet_server))

The cluster is started once per session with ``ray start --head --block`` and stopped by signalling
that one process (it takes its raylet, GCS and workers down with it), so the tests share its start-up
cost. Its workers see ``AUTOTUNE_FLEET_TEST_DIR``, where the test tasks of tests/fleet/_tasks.py
keep their markers. Without Ray installed the tests skip -- except under ``CI=true``, where they fail.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest

from tests import warm_cli
from tests.e2e.conftest import REPO, LiveServer, autotune_command, child_env, free_port, start_server

# A loaded 2-core CI machine (the suite runs two pytest workers beside the cluster) has taken over a
# minute to bring a Ray node up: these are waits that end when it is up, not retries.
RAY_START_TIMEOUT_SECONDS = 300.0
RAY_GCS_PORT_WAIT_SECONDS = 180
RAY_STOP_TIMEOUT_SECONDS = 30.0
FLEET_TIMEOUT_SECONDS = 300.0
RAY_CPUS = 2
# Ray starts an idle worker per CPU as the first driver connects, without a runtime environment; every fleet task
# and board has one (the shipped working directory), so they are never used: two Pythons importing Ray, on the
# CPUs the first test's workers start on. (The fleet's own local instance sets the same: autotune/fleet/runner.py.)
RAY_HEAD_ENV = {"RAY_prestart_worker_first_driver": "0"}
FAKE_ACCELERATOR = "T4"


@dataclass
class RayCluster:
    """A running local Ray cluster: its address, the environment that reaches it, and the folder
    its test tasks keep markers in."""

    address: str
    env: dict[str, str]
    marker_dir: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    deadline: float  # for ``ray start`` to come up


def ray_env() -> dict[str, str]:
    """What the cluster and its drivers share: Ray's token authentication with a token of this
    session's own (an explicit address needs RAY_AUTH_MODE=token on the driver too; nothing is read
    from or written to ~/.ray), and Ray's single-node mode, which keeps every address on loopback
    (otherwise Ray turns 127.0.0.1 into this machine's network address). Ray waits 30 s by default for
    a new GCS server to write its port (``ray start`` here, and the local instance a driver without
    --ray-address starts), and counts its connection attempts to an existing one by the same setting:
    both get RAY_GCS_PORT_WAIT_SECONDS."""
    return {
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_gcs_server_port_wait_time_s": str(RAY_GCS_PORT_WAIT_SECONDS),
    }


def _require_ray() -> None:
    # Looked up, not imported: the fleet's drivers and workers import Ray, the test process never does.
    if importlib.util.find_spec("ray") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("ray is not installed: `make test` installs the fleet extra (pip install -e '.[fleet]')")
        pytest.skip("ray is not installed (pip install -e '.[fleet]')")


def ray_command() -> list[str]:
    """The ``ray`` CLI beside this Python."""
    script = Path(sys.executable).with_name("ray")
    return [str(script)] if script.exists() else [sys.executable, "-m", "ray.scripts.scripts"]


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM to ``ray start --block`` stops the processes it started; SIGKILL to its process group
    (only what it started: it runs in a session of its own) if it lingers."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=RAY_STOP_TIMEOUT_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=RAY_STOP_TIMEOUT_SECONDS)


@pytest.fixture(scope="session")
def _ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    """``ray start --head`` on 127.0.0.1 with 2 CPUs, for the whole session, started but not waited for:
    :func:`fleet_server` starts while it comes up, and :func:`ray_cluster` waits for it."""
    _require_ray()
    marker_dir = tmp_path_factory.mktemp("fleet-markers")
    log_path = tmp_path_factory.mktemp("ray-head") / "ray-start.log"
    port = free_port()
    env = ray_env()
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *ray_command(),
                "start",
                "--head",
                "--block",
                "--node-ip-address=127.0.0.1",
                f"--port={port}",
                f"--num-cpus={RAY_CPUS}",
                # One GPU of kind T4 as Ray resources only (no CUDA here): --accelerators T4 pairs
                # are placed by Ray as on a real cluster, and then fail on the CPU build of torch.
                "--num-gpus=1",
                f"--resources={json.dumps({f'accelerator_type:{FAKE_ACCELERATOR}': 1})}",
                "--include-dashboard=false",
                "--disable-usage-stats",
                f"--object-store-memory={100 * 1024**2}",
            ],
            cwd=REPO,
            env=child_env({**env, "AUTOTUNE_FLEET_TEST_DIR": str(marker_dir), **RAY_HEAD_ENV}),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + RAY_START_TIMEOUT_SECONDS
    yield RayCluster(f"127.0.0.1:{port}", env, marker_dir, log_path, process, deadline)
    _stop(process)


@pytest.fixture(scope="session")
def ray_cluster(_ray_head: RayCluster, fleet_server: LiveServer) -> RayCluster:
    """The session's Ray cluster, up (every test that drives it also asks for :func:`fleet_server`, which
    starts while Ray comes up)."""
    cluster = _ray_head
    while "Ray runtime started" not in cluster.log_path.read_text(errors="replace"):
        if cluster.process.poll() is not None or time.monotonic() > cluster.deadline:
            _stop(cluster.process)
            pytest.fail(f"ray start did not come up; its log:\n{cluster.log_path.read_text(errors='replace')[-4000:]}")
        time.sleep(0.2)
    return cluster


@pytest.fixture(scope="session")
def fleet_server(_ray_head: RayCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real ``autotune serve`` on a fresh SQLite file, for the session's fleet tests (each looks at the store
    filtered by its own tasks, or by the ids it got). It starts while the Ray cluster comes up."""
    server = start_server(tmp_path_factory.mktemp("fleet-server"))
    yield server
    server.stop()


def fleet_env(cluster: RayCluster, server: LiveServer | None, **extra: str) -> dict[str, str]:
    """A driver's environment: the server's write token, the cluster's Ray settings, and the
    marker folder (which a local Ray instance started by the driver passes on to its workers)."""
    base = server.env() if server else child_env()
    base.pop("AUTOTUNE_URL", None)  # the fleet is told its server with --server
    return {**base, **cluster.env, "AUTOTUNE_FLEET_TEST_DIR": str(cluster.marker_dir), **extra}


def run_fleet_cli(args: Sequence[str], *, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``autotune fleet ARGS`` from the repository root (the working directory shipped to Ray)."""
    return warm_cli.run(
        [*autotune_command(), "fleet", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=FLEET_TIMEOUT_SECONDS,
    )


def stored_profiles(server: LiveServer, **filters: str) -> list[dict[str, Any]]:
    """The profiles the server lists (filters: task, fingerprint, device_name, precision)."""
    response = httpx.get(f"{server.url}/api/v1/profiles", params={"limit": 100, **filters}, timeout=10.0)
    response.raise_for_status()
    items: list[dict[str, Any]] = response.json()["items"]
    return items
