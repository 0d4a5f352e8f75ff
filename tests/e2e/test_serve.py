"""`autotune serve` says where it answers (issue 62, item 9): its first line names the dashboard's URL and the
API's, with the port the system gave where --port is 0, and the dashboard answers there."""

from __future__ import annotations

import doctest
import subprocess
import time
from pathlib import Path

import httpx2 as httpx

from autotune_server import runner
from tests.e2e.conftest import REPO, STARTUP_TIMEOUT_SECONDS, autotune_command, child_env


def test_serve_names_the_dashboards_url_and_the_dashboard_answers_there(tmp_path: Path) -> None:
    process = subprocess.Popen(
        [*autotune_command(), "serve", "--port", "0", "--database-url", f"sqlite:///{tmp_path / 'store.db'}"],
        cwd=REPO,
        env=child_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stderr is not None
        first = process.stderr.readline().strip()  # after the migrations, before uvicorn's own lines
        prefix, _, rest = first.partition("http://127.0.0.1:")
        assert prefix == "autotune: the dashboard at ", first
        port = int(rest.split("/", 1)[0])
        base = f"http://127.0.0.1:{port}"
        assert first == f"autotune: the dashboard at {base}/ and the API at {base}/api/v1 (its reference at /docs)"
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while True:
            try:
                page = httpx.get(f"{base}/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and process.poll() is None, "the server never answered"
                time.sleep(0.1)
        assert page.status_code == 200 and "<html" in page.text.lower()
        assert httpx.get(f"{base}/api/v1/profiles", timeout=5).status_code == 200
    finally:
        process.terminate()
        process.wait(timeout=20)
        if process.stderr is not None:
            process.stderr.close()


def test_the_addresses_line_holds_its_examples() -> None:
    failures, tried = doctest.testmod(runner)
    assert tried >= 2 and failures == 0
