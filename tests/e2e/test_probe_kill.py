"""SIGKILL of `autotune probe --server` in mid-search leaves nothing in the store.

The CLI uploads only after the probe has finished, so a probe killed between trials must leave no
profile, partial or whole, behind; the control runs the same command to completion and stores one.
Both use the module's real ``autotune serve`` on a fresh SQLite file (tests/e2e/conftest.py) and compare
the store before and after, so they hold in either order.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable

import httpx2 as httpx

from .conftest import REPO, LiveServer, autotune_command

# The GPT example at 24 MiB runs 5 trials: after the first line there is a whole search left to kill.
PROBE_ARGS = ["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "24MiB"]
TRIAL_LINE_TIMEOUT_SECONDS = 120.0
RUN_TIMEOUT_SECONDS = 240


def stored_profiles(server: LiveServer) -> list[dict[str, object]]:
    """Every profile the server lists (the store as an API client sees it)."""
    response = httpx.get(f"{server.url}/api/v1/profiles", params={"limit": 100}, timeout=10.0)
    response.raise_for_status()
    items: list[dict[str, object]] = response.json()["items"]
    return items


def wait_for_line(stream: object, predicate: Callable[[str], bool], timeout: float) -> tuple[str | None, list[str]]:
    """Read lines from stream on a thread until one satisfies predicate; (that line or None, lines read)."""
    lines: list[str] = []
    found: list[str] = []
    done = threading.Event()

    def read() -> None:
        for raw in stream:  # type: ignore[attr-defined]
            line = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            lines.append(line)
            if predicate(line):
                found.append(line)
                done.set()
                return
        done.set()

    threading.Thread(target=read, daemon=True).start()
    done.wait(timeout)
    return (found[0] if found else None), lines


def test_sigkill_mid_search_stores_nothing(live_server: LiveServer) -> None:
    server = live_server
    before = stored_profiles(server)
    process = subprocess.Popen(
        [*autotune_command(), *PROBE_ARGS, "--server", server.url],
        cwd=REPO,
        env=server.env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        is_trial = lambda text: text.startswith("trial m=")  # noqa: E731 - a one-line predicate
        line, lines = wait_for_line(process.stderr, is_trial, TRIAL_LINE_TIMEOUT_SECONDS)
        assert line is not None, f"no trial line in time; stderr so far:\n{''.join(lines)}"
        os.kill(process.pid, signal.SIGKILL)
        returncode = process.wait(timeout=30)
        assert process.stderr is not None
        stderr = "".join(lines) + process.stderr.read().decode(errors="replace")
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
        if process.stderr is not None:
            process.stderr.close()
    # Killed, not finished: a probe that had already completed would prove nothing.
    assert returncode == -signal.SIGKILL
    # Mid-search: the datasheet (printed once the search is over) never came, nor any upload.
    assert "autotune datasheet" not in stderr and "uploaded as profile" not in stderr
    time.sleep(0.5)  # anything in flight would have landed by now; nothing should be
    assert stored_profiles(server) == before
    assert server.process.poll() is None, "the server must outlive its client's death"


def test_control_run_to_completion_stores_exactly_one(live_server: LiveServer) -> None:
    server = live_server
    before = {p["id"] for p in stored_profiles(server)}
    done = subprocess.run(
        [*autotune_command(), *PROBE_ARGS, "--server", server.url],
        cwd=REPO,
        env=server.env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "uploaded as profile" in done.stderr
    new = [p for p in stored_profiles(server) if p["id"] not in before]
    assert len(new) == 1
    assert new[0]["task"] == "gpt-small"
