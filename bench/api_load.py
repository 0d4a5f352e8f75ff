"""Load on the service from a crowd of clients: req/s, p50 and p99, 5xx and timeouts, on each database.

    .venv/bin/python bench/api_load.py                       # SQLite and PostgreSQL, 64 and 500 clients
    .venv/bin/python bench/api_load.py --backends sqlite --seconds 5 --clients 64 --workers 2

For each database it starts the service the way ``autotune serve`` does (migrations, then uvicorn)
on a free loopback port, uploads one profile, then for each client count runs three phases of the
same length against the one server:

- ``/healthz``: the bare endpoint (no database), keep-alive clients: the ceiling of this machine;
- ``suggest``: ``GET /api/v1/suggest`` of the stored setup, keep-alive clients (the ratio suggest /
  bare is the hot path's target: at least 0.5);
- ``mix``: each client in turn asks ``/suggest``, ``GET /profiles/{id}``, ``GET /profiles`` (a page of
  20), uploads a profile nobody stored yet, and uploads one already stored; half the clients keep
  their connection alive, the other half open a fresh one per request (``Connection: close``).

and last a burst: ``--burst`` clients (200) upload one and the same new profile at once, each on a
fresh connection (one 201, the rest 200).

Every request has ``--request-timeout`` seconds (30) to be answered; one that is not counts as a
timeout and its client reconnects. A 503 whose error code is ``server_busy`` is the server shedding
load: counted apart from other 5xx ("busy") and retried as ``TunerClient`` does (after its
Retry-After, lengthened by up to as much again at random); the request's latency includes the
waits. The clients are a minimal asyncio HTTP/1.1 loop in this process, so that the load generator
costs far less CPU than the server, but it shares the machine's cores with it. Figures only: never
part of the test run's pass/fail.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
TOKEN = "bench-token"
FINGERPRINT = "be" * 32
DEVICE = "NVIDIA H100 80GB HBM3"
BUSY_CODE = b'"server_busy"'


@dataclass
class Phase:
    """What one phase measured."""

    name: str
    clients: int
    requests: int = 0
    seconds: float = 0.0
    latencies: list[float] = field(default_factory=list)
    by_kind: dict[str, list[float]] = field(default_factory=dict)
    statuses: Counter[int] = field(default_factory=Counter)
    busy: int = 0
    timeouts: int = 0
    connection_errors: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")

    @property
    def server_errors(self) -> int:
        """5xx answers (a busy 503 is retried, and counted in ``busy`` instead)."""
        return sum(n for status, n in self.statuses.items() if status >= 500)

    def percentile(self, q: float) -> float:
        return _quantile(self.latencies, q)


def _quantile(latencies: list[float], q: float) -> float:
    if not latencies:
        return float("nan")
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Request:
    """One HTTP request: a label for the figures, and what is sent."""

    kind: str
    method: str
    path: str
    body: bytes = b""

    def encode(self, *, close: bool) -> bytes:
        """The request's bytes (``close``: ask the server to close the connection after answering)."""
        head = f"{self.method} {self.path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if close:
            head += "Connection: close\r\n"
        if self.method == "POST":
            head += (
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(self.body)}\r\n"
            )
        return (head + "\r\n").encode() + self.body


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _profile(task: str = "bench:task") -> dict[str, object]:
    # Consistent (the store refuses a profile its trials contradict): m = 64 peaks at 70 GiB, within
    # 80 GiB x 0.9, and m = 65 ran out of memory. The task name makes its content (hash) distinct.
    per_sample = 2**30 * 15 // 16
    trials = [
        {"micro_batch": m, "peak_bytes": 10 * 2**30 + m * per_sample, "fits": True, "seconds": 0.4}
        for m in (1, 2, 32, 64)
    ]
    trials.append({"micro_batch": 65, "peak_bytes": 80 * 2**30, "fits": False, "oom": True})
    return {
        "fingerprint": FINGERPRINT,
        "task": task,
        "device": {"kind": "cuda", "name": DEVICE, "index": 0, "total_bytes": 80 * 2**30},
        "precision": "bf16",
        "budget_bytes": 80 * 2**30,
        "max_micro_batch": 64,
        "trials": trials,
        "fit": {"fixed_bytes": 10 * 2**30, "bytes_per_sample": per_sample},
        "created_at": "2026-01-01T00:00:00Z",
    }


SUGGEST_PATH = (
    f"/api/v1/suggest?fingerprint={FINGERPRINT}&device_name={quote(DEVICE)}&target_batch=1024&world_size=8"
)


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, payload: bytes
) -> tuple[int, float | None, bool]:
    """Send one request, read its answer: (status, a busy answer's Retry-After, the connection stays open)."""
    writer.write(payload)
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    keep = True
    retry_after = 1.0
    for line in head.split(b"\r\n"):
        lowered = line.lower()
        if lowered.startswith(b"content-length:"):
            length = int(line[15:])
        elif lowered.startswith(b"connection:") and b"close" in lowered:
            keep = False
        elif lowered.startswith(b"retry-after:"):
            retry_after = float(line[12:])
    body = await reader.readexactly(length)
    return status, retry_after if status == 503 and BUSY_CODE in body else None, keep


async def _client(
    port: int, requests: Iterator[Request], stop_at: float, phase: Phase, *, fresh: bool, timeout: float
) -> None:
    """Ask one request after the other until ``stop_at`` or ``requests`` ends, each answered or timed out.

    A busy answer (503 server_busy) is retried as the client does: after its Retry-After lengthened
    by up to as much again at random; the request's latency runs from its first attempt.
    """
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    try:
        for request in requests:
            if time.perf_counter() >= stop_at:
                break
            start = time.perf_counter()
            while True:
                busy_wait: float | None = None
                try:
                    if connection is None:
                        connection = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
                    status, busy_wait, keep = await asyncio.wait_for(
                        _exchange(*connection, request.encode(close=fresh)), timeout
                    )
                except asyncio.TimeoutError:
                    phase.timeouts += 1
                    keep = False
                except (OSError, asyncio.IncompleteReadError):
                    phase.connection_errors += 1
                    keep = False
                else:
                    phase.busy += busy_wait is not None
                    if busy_wait is None:
                        phase.latencies.append(time.perf_counter() - start)
                        phase.by_kind.setdefault(request.kind, []).append(phase.latencies[-1])
                        phase.requests += 1
                        phase.statuses[status] += 1
                if not keep or fresh:
                    if connection is not None:
                        connection[1].close()
                    connection = None
                if busy_wait is None:
                    break
                await asyncio.sleep(busy_wait * (1.0 + random.random()))
    finally:
        if connection is not None:
            connection[1].close()


def _mix(client: str, offset: int, profile_id: int) -> Iterator[Request]:
    """Client ``client``'s rounds: suggest, read one, list, upload a new profile, upload a stored one."""
    stored = Request("stored", "POST", "/api/v1/profiles", json.dumps(_profile()).encode())
    rounds = (
        [
            Request("suggest", "GET", SUGGEST_PATH),
            Request("get", "GET", f"/api/v1/profiles/{profile_id}"),
            Request("list", "GET", "/api/v1/profiles?limit=20"),
            Request("new", "POST", "/api/v1/profiles", json.dumps(_profile(f"bench:{client}-{upload}")).encode()),
            stored,
        ]
        for upload in itertools.count()
    )
    # Each client starts its rounds at another kind, so that every kind is asked from the first second.
    skip = offset % 5
    for round_ in rounds:
        yield from round_[skip:]
        skip = 0


async def _run_phase(
    port: int, name: str, clients: int, seconds: float, timeout: float, profile_id: int
) -> Phase:
    tag = uuid.uuid4().hex[:8]

    def requests_of(client: int) -> Iterator[Request]:
        if name == "/healthz":
            return itertools.repeat(Request("bare", "GET", "/healthz"))
        if name == "suggest":
            return itertools.repeat(Request("suggest", "GET", SUGGEST_PATH))
        # Distinct per phase and client, so that a "new" upload is new (warm-up phases included).
        return _mix(f"{tag}-c{client}", client, profile_id)

    # Fresh connections in the mix only: the bare and suggest phases keep the old ratio's meaning.
    def fresh(client: int) -> bool:
        return name == "mix" and client % 2 == 1

    # A short warm-up so that connection set-up and first-request costs stay out of the figures.
    warm = Phase(name=name, clients=clients)
    warm_stop = time.perf_counter() + 1.0
    await asyncio.gather(
        *(_client(port, requests_of(c), warm_stop, warm, fresh=fresh(c), timeout=timeout) for c in range(clients))
    )
    phase = Phase(name=name, clients=clients)
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _client(port, requests_of(c), start + seconds, phase, fresh=fresh(c), timeout=timeout)
            for c in range(clients)
        )
    )
    phase.seconds = time.perf_counter() - start
    return phase


async def _burst(port: int, clients: int, timeout: float) -> Phase:
    """``clients`` uploads of one new profile at once, each on its own fresh connection."""
    phase = Phase(name=f"burst x{clients}", clients=clients)
    body = json.dumps(_profile(f"bench:burst-{uuid.uuid4().hex}")).encode()
    request = Request("burst", "POST", "/api/v1/profiles", body)
    start = time.perf_counter()
    await asyncio.gather(
        *(
            _client(port, iter([request]), start + 3600, phase, fresh=True, timeout=timeout)
            for _ in range(clients)
        )
    )
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


def _upload_first(base: str) -> int:
    upload = urllib.request.Request(
        f"{base}/api/v1/profiles",
        data=json.dumps(_profile()).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(upload, timeout=30) as response:
        assert response.status in (200, 201), response.status
        profile_id = int(json.loads(response.read())["id"])
    with urllib.request.urlopen(base + SUGGEST_PATH, timeout=30) as response:
        body = json.loads(response.read())
        assert body["source"] == "measured", body
    return profile_id


def bench_backend(backend: str, args: argparse.Namespace) -> list[Phase]:
    """Serve on one database, load it, stop it; returns every phase measured."""
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
    log_path = workdir / "server.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    phases: list[Phase] = []
    try:
        _wait_ready(base, process)
        profile_id = _upload_first(base)
        for clients in args.clients:
            for name in args.phases:
                phases.append(
                    asyncio.run(_run_phase(port, name, clients, args.seconds, args.request_timeout, profile_id))
                )
        if args.burst:
            phases.append(asyncio.run(_burst(port, args.burst, args.request_timeout)))
        return phases
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        if backend == "postgresql":
            _postgres_schema(args.postgres_url, False, schema)
        if args.show_log:
            print(log_path.read_text(errors="replace")[-3000:])


def _line(phase: Phase) -> str:
    statuses = " ".join(f"{status}x{n}" for status, n in sorted(phase.statuses.items()))
    return (
        f"  {phase.clients:>4} {phase.name:<10} {phase.rps:8.0f} req/s  p50 {1000 * phase.percentile(0.50):8.1f} ms"
        f"  p99 {1000 * phase.percentile(0.99):8.1f} ms  5xx {phase.server_errors}  busy {phase.busy}"
        f"  timeouts {phase.timeouts}  conn-errors {phase.connection_errors}  ({phase.requests} answers: {statuses};"
        f" {phase.seconds:.1f} s)"
    )


def _int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--seconds", type=float, default=10.0, help="per phase")
    parser.add_argument("--clients", type=_int_list, default=[64, 500], help="client counts, comma-separated")
    parser.add_argument(
        "--phases",
        type=lambda text: [p for p in text.split(",") if p],
        default=["/healthz", "suggest", "mix"],
        help="of /healthz, suggest, mix",
    )
    parser.add_argument("--burst", type=int, default=200, help="concurrent uploads of one profile (0: none)")
    parser.add_argument("--request-timeout", type=float, default=30.0, help="seconds one request may take")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--show-log", action="store_true", help="print the tail of each server's log")
    parser.add_argument(
        "--postgres-url", default=os.environ.get("AUTOTUNE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)
    )
    args = parser.parse_args(argv)
    print(
        f"clients {','.join(map(str, args.clients))}, {args.seconds:g} s per phase, {args.workers} uvicorn "
        f"worker(s), {os.cpu_count()} CPUs (load generator on the same machine), request timeout "
        f"{args.request_timeout:g} s"
    )
    for backend in args.backends.split(","):
        phases = bench_backend(backend.strip(), args)
        print(f"{backend}:")
        for phase in phases:
            print(_line(phase))
            if len(phase.by_kind) > 1:
                print("       " + "  ".join(
                    f"{kind} p50 {1000 * _quantile(lat, 0.5):.0f} / p99 {1000 * _quantile(lat, 0.99):.0f} ms"
                    for kind, lat in phase.by_kind.items()
                ))
        for clients in args.clients:
            by_name = {p.name: p for p in phases if p.clients == clients}
            if "/healthz" in by_name and "suggest" in by_name:
                ratio = by_name["suggest"].rps / by_name["/healthz"].rps
                verdict = "meets" if ratio >= 0.5 else "BELOW"
                print(f"  {clients:>4} ratio suggest/bare = {ratio:.2f} ({verdict} the 0.5 target)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
