"""A reader that closes the output early (issue 62, item 4): `autotune profiles show 1 | head -1` printed
``BrokenPipeError`` and exited 1. Every command that writes to stdout stops without a word and exits 141
(``ExitCode.PIPE_CLOSED``, 128 + SIGPIPE), as a Unix tool ended by SIGPIPE does.

The pipe's reading end is closed before the command writes anything, so that its first write meets a closed pipe
whatever the size of its output (``head`` closes after the first line; a short output written in one piece can
outrun it, a closed pipe cannot).
"""

from __future__ import annotations

import subprocess

import httpx2 as httpx
import pytest

from autotune.core.errors import ExitCode
from tests.e2e.conftest import REPO, LiveServer, autotune_command
from tests.factories import make_profile

FINGERPRINT = "c0ffee" * 10 + "c0ff"


@pytest.fixture(scope="module")
def stored(live_server: LiveServer) -> int:
    """One profile in the live server's store: its id."""
    profile = make_profile(
        fingerprint=FINGERPRINT,
        device_kind="cpu",
        device_name="cpu",
        precision="fp32",
        budget_bytes=64 << 20,
        fixed_bytes=1 << 20,
        bytes_per_sample=1 << 20,
        max_micro_batch=20,
    )
    answer = httpx.post(
        f"{live_server.url}/api/v1/profiles",
        content=profile.model_dump_json(),
        headers={"Authorization": f"Bearer {live_server.token}", "Content-Type": "application/json"},
        timeout=30,
    )
    assert answer.status_code == 201, answer.text
    return int(answer.json()["id"])


def _closed_early(live_server: LiveServer, *args: str) -> subprocess.CompletedProcess[str]:
    process = subprocess.Popen(
        [*autotune_command(), *args],
        cwd=REPO,
        env=live_server.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    process.stdout.close()  # the reader is gone before the first line
    _, err = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, "", err)


@pytest.mark.parametrize(
    "command",
    [
        ["gpus"],
        ["profiles", "show", "{id}"],
        ["suggest", "--fingerprint", FINGERPRINT, "--device-name", "cpu", "--target-batch", "64"],
        ["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "2MiB", "--max-micro-batch", "8"],
    ],
    ids=lambda command: " ".join(command[:2]),
)
def test_a_closed_pipe_ends_the_command_quietly(live_server: LiveServer, stored: int, command: list[str]) -> None:
    done = _closed_early(live_server, *[part.format(id=stored) for part in command])
    assert done.returncode == ExitCode.PIPE_CLOSED == 141, done.stderr
    # Nothing about the pipe: no traceback, no "BrokenPipeError", no "Exception ignored" at the interpreter's exit
    # (the probe's trial lines go to stderr as they always do).
    assert "BrokenPipe" not in done.stderr and "Traceback" not in done.stderr and "Exception" not in done.stderr
    assert "error" not in done.stderr, done.stderr
