"""The long schemathesis run: every operation of a live server, positive and negative data.

    .venv/bin/python bench/api_fuzz.py                          # SQLite, 300 examples per operation and mode
    .venv/bin/python bench/api_fuzz.py --backend postgresql --examples 1000

Starts the service as ``autotune serve`` does (migrations, then uvicorn) on a free loopback port,
uploads one profile so reads and /suggest find something, then drives schemathesis from the live
/openapi.json with the same checks as tests/server/test_fuzz.py (no 5xx; status codes, content
types, headers and bodies as documented; invalid input rejected). Prints one line per operation and
mode and exits 1 when anything failed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.request
import uuid
from pathlib import Path

import schemathesis

# Run as a script: its own folder is on sys.path, so the load benchmark's helpers import directly.
from api_load import _free_port, _postgres_schema, _profile, _wait_ready  # noqa: E402
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

TOKEN = "fuzz-token"
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
    negative_data_rejection,
]


def fuzz(base: str, examples: int) -> int:
    """Run every operation in both modes; returns the number of failing (operation, mode) pairs."""
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    headers = {"Authorization": f"Bearer {TOKEN}"}
    failures = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            calls = 0

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck)
            )
            def run(case: schemathesis.Case) -> None:
                nonlocal calls
                calls += 1
                case.call_and_validate(base_url=base, headers=headers, checks=CHECKS)

            start = time.perf_counter()
            try:
                run()
                verdict = "ok"
            except Unsatisfiable:
                verdict = "nothing to negate" if mode is GenerationMode.NEGATIVE else "UNSATISFIABLE"
                failures += mode is GenerationMode.POSITIVE
            except Exception:  # noqa: BLE001 -- report every failure and go on to the next operation
                verdict = "FAILED"
                failures += 1
                traceback.print_exc(limit=3)
            seconds = time.perf_counter() - start
            print(
                f"{operation.label:<48} {mode.value:<8} {calls:5d} calls {seconds:6.1f} s  {verdict}",
                flush=True,
            )
    return failures


def main(argv: list[str] | None = None) -> int:
    """Start a server, fuzz it, stop it."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument("--examples", type=int, default=300, help="per operation and generation mode")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "AUTOTUNE_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    args = parser.parse_args(argv)
    schema_name = f"fuzz_{uuid.uuid4().hex[:12]}"
    if args.backend == "sqlite":
        url = f"sqlite:///{Path(tempfile.mkdtemp(prefix='autotune-fuzz-')) / 'fuzz.db'}"
    else:
        url = _postgres_schema(args.postgres_url, True, schema_name)
    port = _free_port()
    env = {
        **os.environ,
        "AUTOTUNE_DATABASE_URL": url,
        "AUTOTUNE_API_TOKENS": TOKEN,
        "AUTOTUNE_ACCESS_LOG": "false",
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "autotune_server", "serve", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process)
        upload = urllib.request.Request(
            f"{base}/api/v1/profiles",
            data=json.dumps(_profile()).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            method="POST",
        )
        urllib.request.urlopen(upload, timeout=10).close()
        failures = fuzz(base, args.examples)
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=20)
        if args.backend == "postgresql":
            _postgres_schema(args.postgres_url, False, schema_name)
    print("no failures" if failures == 0 else f"{failures} failing operation/mode pairs")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
