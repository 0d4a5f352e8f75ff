"""The image's entry point script, run here as it runs in the container (no Docker engine needed)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs a POSIX shell")
def test_entrypoint_migrates_then_serves(tmp_path: Path) -> None:
    port = _free_port()
    db = tmp_path / "data" / "autotune.db"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "AUTOTUNE_DATABASE_URL": f"sqlite:///{db}",
        "AUTOTUNE_API_TOKENS": "ci=entrypoint-token",
        "AUTOTUNE_HOST": "127.0.0.1",
        "AUTOTUNE_PORT": str(port),
    }
    process = subprocess.Popen(
        ["sh", str(ENTRYPOINT), "--log-level", "warning"],
        env=env,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        health = None
        while time.monotonic() < deadline:
            if process.poll() is not None:
                break
            try:
                health = httpx.get(f"{base}/healthz", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert health is not None, process.stdout.read().decode() if process.stdout else ""
        assert health.json() == {"status": "ok"}
        ready = httpx.get(f"{base}/readyz", timeout=5)
        assert ready.status_code == 200
        assert ready.json()["status"] == "ready"
        assert db.exists()  # the script ran the migrations into the configured file
        # Tokens come from the environment: writes need the configured one.
        assert httpx.post(f"{base}/api/v1/profiles", json={}, timeout=5).status_code == 401
    finally:
        # exec in the script makes uvicorn the process itself; SIGTERM is what a container stop sends.
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
        if process.stdout:
            process.stdout.close()
    # A graceful stop: uvicorn exits 0 or, as recent versions do, re-raises SIGTERM after shutting down;
    # never SIGKILL (which would mean it hung).
    assert process.returncode in (0, -signal.SIGTERM)


def test_dockerfile_installs_the_server_extra_only_and_runs_as_non_root() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert 'pip install --quiet ".[server]"' in text
    assert "torch" not in text.lower().replace("no torch", "")
    assert "\nUSER autotune" in text
    assert "HEALTHCHECK" in text and "/healthz" in text
    assert "autotune-entrypoint" in text and "docker/entrypoint.sh" in text
