"""A real ``autotune serve`` process for end-to-end tests (the launch path, the browser tests).

    def test_something(live_server: LiveServer) -> None:
        httpx.get(f"{live_server.url}/healthz")          # a real uvicorn on a loopback port
        env = live_server.env()                          # AUTOTUNE_URL / AUTOTUNE_TOKEN for children

``live_server`` is one server per test module on a fresh SQLite file; ``start_live_server(...)`` starts
more (each with its own file and port) when a test needs its own or other settings, and every server
started is stopped at the end of the session at the latest.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
E2E_WRITE_TOKEN = "e2e-write-token"
STARTUP_TIMEOUT_SECONDS = 60.0  # migrations and uvicorn on a loaded 2-core machine
STOP_TIMEOUT_SECONDS = 10.0


def free_port() -> int:
    """A loopback port free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def autotune_command() -> list[str]:
    """How to run the ``autotune`` CLI of this checkout (the console script beside this Python)."""
    script = Path(sys.executable).with_name("autotune")
    return [str(script)] if script.exists() else [sys.executable, "-m", "autotune.cli"]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this one without ambient AUTOTUNE_* and WORLD_SIZE,
    with the checkout importable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOTUNE_") and k != "WORLD_SIZE"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    env.update(extra or {})
    return env


@dataclass
class LiveServer:
    """A running ``autotune serve``: its URL, write token, database file and log."""

    url: str
    port: int
    token: str
    database_path: Path
    log_path: Path
    process: subprocess.Popen[bytes] = field(repr=False)

    def env(self, **extra: str) -> dict[str, str]:
        """A child environment pointing at this server (AUTOTUNE_URL, AUTOTUNE_TOKEN)."""
        return child_env({"AUTOTUNE_URL": self.url, "AUTOTUNE_TOKEN": self.token, **extra})

    def log(self) -> str:
        """What the server printed so far (for assertion messages)."""
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        """Stop the server: SIGTERM (uvicorn shuts down gracefully), then SIGKILL if it lingers."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_TIMEOUT_SECONDS)


def _wait_healthy(server: LiveServer, deadline: float) -> bool:
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def start_server(
    directory: Path, *, env: Mapping[str, str] | None = None, attempts: int = 3, database_url: str | None = None
) -> LiveServer:
    """Start ``autotune serve`` on a free loopback port with a fresh SQLite file in ``directory`` (or on
    ``database_url``: a PostgreSQL schema of the test database).

    Args:
        directory: where the database file and the server log go (a tmp_path).
        env: extra environment for the server (``AUTOTUNE_READ_TOKEN_REQUIRED``, ...);
            ``AUTOTUNE_API_TOKENS`` defaults to :data:`E2E_WRITE_TOKEN`.
        attempts: another port is tried when one was taken between choosing and binding it.

    Raises:
        RuntimeError: the server did not answer /healthz in time; the message has its log.
    """
    directory.mkdir(parents=True, exist_ok=True)
    server_env = child_env({"AUTOTUNE_API_TOKENS": E2E_WRITE_TOKEN, **(env or {})})
    token = server_env["AUTOTUNE_API_TOKENS"].split(",")[0].split("=")[-1]
    last_log = ""
    for attempt in range(attempts):
        port = free_port()
        database_path = directory / f"autotune-{port}.db"
        log_path = directory / f"server-{port}.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    *autotune_command(),
                    "serve",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--database-url",
                    database_url or f"sqlite:///{database_path}",
                ],
                cwd=REPO,
                env=server_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = LiveServer(
            url=f"http://127.0.0.1:{port}",
            port=port,
            token=token,
            database_path=database_path,
            log_path=log_path,
            process=process,
        )
        if _wait_healthy(server, time.monotonic() + STARTUP_TIMEOUT_SECONDS):
            return server
        server.stop()
        last_log = server.log()
        if "address already in use" not in last_log.lower() or attempt == attempts - 1:
            break
    raise RuntimeError(f"autotune serve did not become healthy; its log:\n{last_log[-4000:]}")


@pytest.fixture(scope="session")
def start_live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., LiveServer]]:
    """A factory: ``start_live_server(env={...})`` starts another server; all stop at session end."""
    started: list[LiveServer] = []

    def start(*, env: Mapping[str, str] | None = None, database_url: str | None = None) -> LiveServer:
        server = start_server(tmp_path_factory.mktemp("live-server"), env=env, database_url=database_url)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def live_server(start_live_server: Callable[..., LiveServer]) -> Iterator[LiveServer]:
    """One ``autotune serve`` per test module, on a fresh SQLite file, writes with :data:`E2E_WRITE_TOKEN`."""
    server = start_live_server()
    yield server
    server.stop()
