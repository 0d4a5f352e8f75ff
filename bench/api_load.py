"""Load on GET /api/v1/suggest beside a bare endpoint (/healthz) of the same server, in the same run.

    .venv/bin/python bench/api_load.py                       # SQLite and PostgreSQL, 10 s per phase
    .venv/bin/python bench/api_load.py --backends sqlite --seconds 5 --clients 64 --workers 2

For each database it starts the service the way ``autotune serve`` does (migrations, then uvicorn)
on a free loopback port, uploads one profile, then runs 64 concurrent keep-alive clients against
/healthz and then against /api/v1/suggest for the same time each, and prints requests/s, p50 and p99
latency and the ratio suggest / bare (the target is at least 0.5). The clients are a minimal
asyncio HTTP/1.1 loop in this process, so that the load generator costs far less CPU than the server.
Figures only: never part of the test run's pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TOKEN = "bench-token"
FINGERPRINT = "be" * 32
DEVICE = "NVIDIA H100 80GB HBM3"


@dataclass
class Phase:
    """What one phase measured."""

    path: str
    requests: int
    errors: int
    seconds: float
    latencies: list[float]

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _profile() -> dict[str, object]:
    # Consistent (the store refuses a profile its trials contradict): m = 64 peaks at 70 GiB, within
    # 80 GiB x 0.9, and m = 65 ran out of memory.
    per_sample = 2**30 * 15 // 16
    trials = [
        {"micro_batch": m, "peak_bytes": 10 * 2**30 + m * per_sample, "fits": True, "seconds": 0.4}
        for m in (1, 2, 32, 64)
    ]
    trials.append({"micro_batch": 65, "peak_bytes": 80 * 2**30, "fits": False, "oom": True})
    return {
        "fingerprint": FINGERPRINT,
        "task": "bench:task",
        "device": {"kind": "cuda", "name": DEVICE, "index": 0, "total_bytes": 80 * 2**30},
        "precision": "bf16",
        "budget_bytes": 80 * 2**30,
        "max_micro_batch": 64,
        "trials": trials,
        "fit": {"fixed_bytes": 10 * 2**30, "bytes_per_sample": per_sample},
        "created_at": "2026-01-01T00:00:00Z",
    }


async def _client(port: int, path: str, stop_at: float, phase: Phase) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()
    try:
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            phase.latencies.append(time.perf_counter() - start)
            phase.requests += 1
            if status != 200:
                phase.errors += 1
    finally:
        writer.close()


async def _run_phase(port: int, path: str, clients: int, seconds: float) -> Phase:
    phase = Phase(path=path, requests=0, errors=0, seconds=seconds, latencies=[])
    # A short warm-up so that connection set-up and first-request costs stay out of the figures.
    warm = Phase(path=path, requests=0, errors=0, seconds=1, latencies=[])
    await asyncio.gather(*(_client(port, path, time.perf_counter() + 1.0, warm) for _ in range(clients)))
    start = time.perf_counter()
    await asyncio.gather(*(_client(port, path, start + seconds, phase) for _ in range(clients)))
    phase.seconds = time.perf_counter() - start
    return phase


def _wait_ready(base: str, process: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{base}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("server did not become ready")


def _postgres_schema(base_url: str, create: bool, schema: str) -> str:
    from sqlalchemy import create_engine, text

    engine = create_engine(base_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            if create:
                conn.execute(text(f'CREATE SCHEMA "{schema}"'))
            else:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    finally:
        engine.dispose()
    separator = "&" if "?" in base_url else "?"
    return f"{base_url}{separator}options={quote(f'-csearch_path={schema}')}"


def bench_backend(backend: str, args: argparse.Namespace) -> tuple[Phase, Phase]:
    """Serve on one database, load it, stop it; returns (bare, suggest)."""
    workdir = Path(tempfile.mkdtemp(prefix="autotune-bench-"))
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    if backend == "sqlite":
        url = f"sqlite:///{workdir / 'bench.db'}"
    else:
        url = _postgres_schema(args.postgres_url, True, schema)
    port = _free_port()
    env = {
        **os.environ,
        "AUTOTUNE_DATABASE_URL": url,
        "AUTOTUNE_API_TOKENS": f"bench={TOKEN}",
        "AUTOTUNE_ACCESS_LOG": "false",
    }
    command = [sys.executable, "-m", "autotune_server", "serve", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--workers", str(args.workers)]
    process = subprocess.Popen(command, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(base, process)
        upload = urllib.request.Request(
            f"{base}/api/v1/profiles",
            data=json.dumps(_profile()).encode(),
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(upload, timeout=10) as response:
            assert response.status in (200, 201), response.status
        suggest_path = (
            f"/api/v1/suggest?fingerprint={FINGERPRINT}&device_name={quote(DEVICE)}"
            "&target_batch=1024&world_size=8"
        )
        with urllib.request.urlopen(base + suggest_path, timeout=10) as response:
            body = json.loads(response.read())
            assert body["source"] == "measured", body
        bare = asyncio.run(_run_phase(port, "/healthz", args.clients, args.seconds))
        suggest = asyncio.run(_run_phase(port, suggest_path, args.clients, args.seconds))
        return bare, suggest
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if backend == "postgresql":
            _postgres_schema(args.postgres_url, False, schema)


def _line(name: str, phase: Phase) -> str:
    return (
        f"  {name:<8} {phase.rps:9.0f} req/s   p50 {1000 * phase.percentile(0.50):7.2f} ms   "
        f"p99 {1000 * phase.percentile(0.99):7.2f} ms   ({phase.requests} requests, {phase.errors} errors)"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase (bare, then suggest)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument(
        "--postgres-url", default=os.environ.get("AUTOTUNE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    )
    args = parser.parse_args(argv)
    print(
        f"{args.clients} concurrent keep-alive clients, {args.seconds:g} s per phase, "
        f"{args.workers} uvicorn worker(s), {os.cpu_count()} CPUs (load generator on the same machine)"
    )
    for backend in args.backends.split(","):
        bare, suggest = bench_backend(backend.strip(), args)
        ratio = suggest.rps / bare.rps if bare.rps else float("nan")
        print(f"{backend}:")
        print(_line("/healthz", bare))
        print(_line("suggest", suggest))
        verdict = "meets" if ratio >= 0.5 else "BELOW"
        print(f"  ratio suggest/bare = {ratio:.2f} ({verdict} the 0.5 target)")
        print(f"  latency p50 {statistics.median(suggest.latencies) * 1000:.2f} ms (suggest)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
