"""The long schemathesis run, every check on: a live server on each database, through schemathesis' own CLI.

    .venv/bin/python bench/api_fuzz.py                               # SQLite and PostgreSQL, 100 examples
    .venv/bin/python bench/api_fuzz.py --backends postgresql --max-examples 500

For each database it starts the service as ``autotune serve`` does (migrations, then uvicorn) on a
free loopback port, uploads one profile so reads and /suggest find something, then runs

    schemathesis run http://.../openapi.json --checks all --exclude-checks positive_data_acceptance

with a write token: every phase (examples, coverage, fuzzing, stateful) and every check, among them
the ones about HTTP itself (an undocumented method is a 405 whose ``Allow`` lists the resource's
methods, OPTIONS, missing headers, auth that is not ignored). The one check left out expects every
schema-valid body to be accepted; the store refuses some on purpose (a profile its own trials
contradict: 422 ``inconsistent_profile``, documented on POST /profiles). Prints schemathesis'
summary per database and exits 1 when any check failed. Runs in a temporary folder, so that
schemathesis' own files (.schemathesis/) stay out of the repository.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

# Run as a script: its own folder is on sys.path, so the load benchmark's helpers import directly.
from api_load import _free_port, _postgres_schema, _profile, _wait_ready  # noqa: E402

TOKEN = "fuzz-token"
EXCLUDED_CHECK = "positive_data_acceptance"
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")


def _serve(url: str) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {**os.environ, "AUTOTUNE_DATABASE_URL": url, "AUTOTUNE_API_TOKENS": TOKEN, "AUTOTUNE_ACCESS_LOG": "false"}
    process = subprocess.Popen(
        [sys.executable, "-m", "autotune_server", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, f"http://127.0.0.1:{port}"


def _fuzz(base: str, args: argparse.Namespace, workdir: Path) -> tuple[int, str]:
    command = [
        str(SCHEMATHESIS),
        "--no-color",
        "run",
        f"{base}/openapi.json",
        "--checks",
        "all",
        "--exclude-checks",
        EXCLUDED_CHECK,
        "-H",
        f"Authorization: Bearer {TOKEN}",
        "--max-examples",
        str(args.max_examples),
        "--workers",
        str(args.workers),
    ]
    if args.seed is not None:
        command += ["--seed", str(args.seed)]
    result = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=False)
    return result.returncode, result.stdout + result.stderr


def _summary(output: str) -> str:
    # From schemathesis' SUMMARY (or FAILURES, when there are some) to the end.
    for marker in ("= FAILURES =", "= SUMMARY ="):
        at = output.find(marker)
        if at >= 0:
            return output[output.rfind("\n", 0, at) + 1 :].strip()
    return output.strip()[-4000:]


def run_backend(backend: str, args: argparse.Namespace) -> bool:
    """Serve one database, fuzz it, print the summary; True when every check passed."""
    schema_name = f"fuzz_{uuid.uuid4().hex[:12]}"
    workdir = Path(tempfile.mkdtemp(prefix="autotune-fuzz-"))
    if backend == "sqlite":
        url = f"sqlite:///{workdir / 'fuzz.db'}"
    else:
        url = _postgres_schema(args.postgres_url, True, schema_name)
    process, base = _serve(url)
    started = time.perf_counter()
    try:
        _wait_ready(base, process)
        upload = urllib.request.Request(
            f"{base}/api/v1/profiles",
            data=json.dumps(_profile()).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(upload, timeout=10).close()
        code, output = _fuzz(base, args, workdir)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
        if backend == "postgresql":
            _postgres_schema(args.postgres_url, False, schema_name)
    seconds = time.perf_counter() - started
    cases = re.search(r"(\d+) generated", output)
    print(
        f"\n===== {backend}: schemathesis --checks all --exclude-checks {EXCLUDED_CHECK} "
        f"(exit {code}, {seconds:.0f} s, {cases.group(1) if cases else '?'} test cases) ====="
    )
    print(_summary(output), flush=True)
    return code == 0


def main(argv: list[str] | None = None) -> int:
    """Fuzz each database in turn."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql")
    parser.add_argument("--max-examples", type=int, default=100, help="per operation and phase")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("AUTOTUNE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    )
    args = parser.parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(backends) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    results = {backend: run_backend(backend, args) for backend in backends}
    print("\n" + ", ".join(f"{b}: {'passed' if ok else 'FAILED'}" for b, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
