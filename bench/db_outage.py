"""The database goes away under load: `autotune serve` on a PostgreSQL of its own, stopped and started.

    .venv/bin/python bench/db_outage.py                     # 75 req/s, DB down 8 s
    .venv/bin/python bench/db_outage.py --rate 150 --down 20 --access-log

Makes a throw-away PostgreSQL cluster (a temporary directory, a free port; as the postgres user when
run as root), serves it as `autotune serve` does (migrations, then uvicorn) with its stderr in a
file, and drives it open-loop at ``--rate`` requests a second: half uploads of distinct profiles,
half /suggest (nine in ten for setups answered before, one in ten for a setup never asked). After
``--before`` seconds the database is stopped (pg_ctl -m fast), ``--down`` seconds later started
again, and the load runs ``--after`` seconds more. Then every upload that was refused is sent once
more (as a client's retry would) and the store is read directly.

Prints the response codes per phase and kind, acknowledged uploads against stored ones (no
duplicates, none half-written), seconds from the database's start to the first good answers, and
the server's log lines written while the database was down. Figures only: never part of the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# Run as a script: its own folder is on sys.path, so the load benchmark's helpers import directly.
from api_load import _free_port, _profile, _wait_ready  # noqa: E402

from tests.server._pg_cluster import ThrowawayPostgres  # noqa: E402

TOKEN = "bench-token"
KNOWN_SETUPS = 5


@dataclass
class Record:
    """One request: when it was sent, what it was, what came back."""

    sent: float
    kind: str
    status: int
    stale: bool = False
    body: dict[str, object] | None = None
    seconds: float = 0.0


@dataclass
class Run:
    """Timestamps of the outage and everything the loader saw."""

    stopped_at: float = 0.0
    started_at: float = 0.0
    log_lines_at_stop: int = 0
    log_lines_after_start: int = 0
    records: list[Record] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    ready: list[tuple[float, int]] = field(default_factory=list)


def _upload_body(n: int) -> dict[str, object]:
    body = _profile()
    body["tags"] = {"bench": "db_outage", "n": n}
    return body


def _setup_body(k: int) -> dict[str, object]:
    body = _profile()
    body["fingerprint"] = f"{k:02x}" * 32
    return body


def _suggest_params(fingerprint: str) -> dict[str, object]:
    return {"fingerprint": fingerprint, "device_name": "NVIDIA H100 80GB HBM3", "target_batch": 256}


async def _one(client: httpx.AsyncClient, run: Run, kind: str, n: int) -> None:
    sent = time.monotonic()
    try:
        if kind == "upload":
            response = await client.post("/api/v1/profiles", json=_upload_body(n))
        else:
            fingerprint = f"{n % KNOWN_SETUPS:02x}" * 32 if kind == "suggest known" else f"{n:064x}"
            response = await client.get("/api/v1/suggest", params=_suggest_params(fingerprint))
        status = response.status_code
        stale = "x-autotune-stale" in response.headers
        body = response.json() if kind == "upload" else None
    except httpx.HTTPError as exc:
        status, stale, body = 0, False, None
        run.errors[type(exc).__name__] += 1
    record = Record(sent, kind, status, stale, body, time.monotonic() - sent)
    record.body = body if body is not None else {"n": n}
    if kind == "upload":
        record.body["n"] = n
    run.records.append(record)


async def _readiness(client: httpx.AsyncClient, run: Run, until: float) -> None:
    while time.monotonic() < until:
        try:
            status = (await client.get("/readyz")).status_code
        except httpx.HTTPError:
            status = 0
        run.ready.append((time.monotonic(), status))
        await asyncio.sleep(0.1)


async def _load(base: str, pg: ThrowawayPostgres, args: argparse.Namespace, log_path: Path) -> Run:
    run = Run()
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, limits=limits, timeout=30) as client:
        for k in range(KNOWN_SETUPS):  # the setups the fleet has asked about before
            assert (await client.post("/api/v1/profiles", json=_setup_body(k))).status_code in (200, 201)
            assert (await client.get("/api/v1/suggest", params=_suggest_params(f"{k:02x}" * 32))).status_code == 200
        start = time.monotonic()
        stop_at = start + args.before
        end = stop_at + args.down + args.after
        tasks: set[asyncio.Task[None]] = set()
        ready = asyncio.create_task(_readiness(client, run, end))
        loop = asyncio.get_running_loop()
        outage = loop.run_in_executor(None, _outage, pg, run, stop_at, args.down, log_path)
        n = 0
        while (now := time.monotonic()) < end:
            kind = "upload" if n % 2 == 0 else ("suggest new" if n % 20 == 1 else "suggest known")
            task = asyncio.create_task(_one(client, run, kind, n))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            n += 1
            await asyncio.sleep(max(0.0, start + n / args.rate - now))
        await asyncio.gather(*tasks)
        await ready
        await outage
    return run


def _count_lines(path: Path) -> int:
    return len(path.read_text(errors="replace").splitlines())


def _outage(pg: ThrowawayPostgres, run: Run, stop_at: float, down_seconds: float, log_path: Path) -> None:
    time.sleep(max(0.0, stop_at - time.monotonic()))
    run.log_lines_at_stop = _count_lines(log_path)
    run.stopped_at = time.monotonic()
    pg.stop("fast")
    time.sleep(max(0.0, run.stopped_at + down_seconds - time.monotonic()))
    pg.start()
    run.started_at = time.monotonic()
    time.sleep(2.0)
    run.log_lines_after_start = _count_lines(log_path)


def _phase(run: Run, t: float) -> str:
    if t < run.stopped_at:
        return "before"
    return "outage" if t < run.started_at else "after"


def _stored(pg: ThrowawayPostgres) -> tuple[Counter[int], Counter[int]]:
    """Rows per upload number, and profiles per trial count, read straight from the database."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(pg.url, poolclass=NullPool)
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT p.tags, (SELECT count(*) FROM trials t WHERE t.profile_id = p.id) "
                "FROM profiles p WHERE p.task = 'bench:task'"
            )
        ).all()
    engine.dispose()
    stored = Counter[int]()
    trial_counts = Counter[int]()
    for tags, trials in rows:
        tags = tags if isinstance(tags, dict) else json.loads(tags)
        if tags.get("bench") == "db_outage":
            stored[int(tags["n"])] += 1
            trial_counts[int(trials)] += 1
    return stored, trial_counts


def _report(run: Run, pg: ThrowawayPostgres, base: str, log_path: Path) -> None:
    codes: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    latencies: dict[tuple[str, str], list[float]] = defaultdict(list)
    for r in run.records:
        label = f"{r.status}{' from memory' if r.stale else ''}" if r.status else "no answer"
        codes[(_phase(run, r.sent), r.kind)][label] += 1
        latencies[(_phase(run, r.sent), r.kind)].append(r.seconds)
    print(f"\nload: {len(run.records)} requests; database stopped for {run.started_at - run.stopped_at:.1f} s")
    if run.errors:
        print(f"no answer (the loader's HTTP errors): {dict(run.errors)}")
    print("(a request's phase is when it was sent; p50/p99: seconds to its answer)")
    print(f"{'phase':<8} {'kind':<14} {'requests':>8} {'p50':>6} {'p99':>6}  codes")
    for phase in ("before", "outage", "after"):
        for kind in ("upload", "suggest known", "suggest new"):
            counter = codes.get((phase, kind), Counter())
            text = ", ".join(f"{code}: {count}" for code, count in sorted(counter.items()))
            times = sorted(latencies.get((phase, kind), [])) or [float("nan")]
            p50, p99 = times[len(times) // 2], times[min(len(times) - 1, int(0.99 * len(times)))]
            print(f"{phase:<8} {kind:<14} {sum(counter.values()):>8} {p50:6.2f} {p99:6.2f}  {text}")

    uploads = [r for r in run.records if r.kind == "upload"]
    acknowledged = {int(r.body["n"]) for r in uploads if r.status in (200, 201) and r.body}  # type: ignore[call-overload]
    refused = [int(r.body["n"]) for r in uploads if r.status not in (200, 201) and r.body]  # type: ignore[call-overload]
    stored_before, _ = _stored(pg)
    # A client's retry of each refused upload, once the database is back.
    retried = Counter[int]()
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
        for n in refused:
            retried[client.post("/api/v1/profiles", json=_upload_body(n)).status_code] += 1
    stored, trial_counts = _stored(pg)
    expected_trials = len(_profile()["trials"])  # type: ignore[arg-type]
    print(
        f"\nuploads: {len(uploads)} sent, {len(acknowledged)} acknowledged, "
        f"{sum(1 for n in acknowledged if stored_before[n])} of those stored; {len(refused)} refused, "
        f"{sum(1 for n in refused if stored_before[n])} of those stored all the same; "
        f"each refused one sent again after the outage: {dict(retried)}"
    )
    duplicates = sum(count - 1 for count in stored.values() if count > 1)
    half = sum(count for trials, count in trial_counts.items() if trials != expected_trials)
    sent = {r.body["n"] for r in uploads if r.body}
    print(
        f"store: {len(stored)} distinct uploads, {duplicates} stored twice, {half} without all "
        f"{expected_trials} trials; every upload sent is stored now: {set(stored) == sent}"
    )

    def first_ok(kinds: tuple[str, ...], *, fresh: bool = True) -> float | None:
        times = [
            r.sent
            for r in run.records
            if r.kind in kinds and r.sent >= run.started_at and r.status in (200, 201) and not (fresh and r.stale)
        ]
        return min(times) - run.started_at if times else None

    ready_times = [t for t, status in run.ready if t >= run.started_at and status == 200]
    recover = {
        "/readyz 200": (min(ready_times) - run.started_at) if ready_times else None,
        "first stored upload": first_ok(("upload",)),
        "first fresh /suggest": first_ok(("suggest known", "suggest new")),
    }
    print(
        "recovery after the database's start: "
        + ", ".join(f"{k} {v:.2f} s" if v is not None else f"{k} never" for k, v in recover.items())
    )
    lines = log_path.read_text(errors="replace").splitlines()
    during = lines[run.log_lines_at_stop : run.log_lines_after_start]
    print(
        f"\nserver log: {len(during)} lines from the stop to 2 s after the start; tracebacks in the whole log: "
        f"{sum('Traceback' in line for line in lines)}"
    )
    for line in during:
        print(f"  | {line[:200]}")


def main(argv: list[str] | None = None) -> int:
    """Cluster, server, load, outage, report."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=75.0, help="requests a second (open loop)")
    parser.add_argument("--before", type=float, default=5.0, help="seconds of load before the stop")
    parser.add_argument("--down", type=float, default=8.0, help="seconds the database stays down")
    parser.add_argument("--after", type=float, default=8.0, help="seconds of load after the start")
    parser.add_argument("--access-log", action="store_true", help="keep uvicorn's per-request log line")
    args = parser.parse_args(argv)

    with ThrowawayPostgres.create() as pg:
        port = _free_port()
        log_path = Path(tempfile.mkdtemp(prefix="autotune-outage-")) / "server.log"
        env = {
            **os.environ,
            "AUTOTUNE_DATABASE_URL": pg.url,
            "AUTOTUNE_API_TOKENS": TOKEN,
            "AUTOTUNE_ACCESS_LOG": "true" if args.access_log else "false",
        }
        with log_path.open("w") as log:
            process = subprocess.Popen(
                [sys.executable, "-m", "autotune_server", "serve", "--host", "127.0.0.1", "--port", str(port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(base, process)
            run = asyncio.run(_load(base, pg, args, log_path))
            _report(run, pg, base, log_path)
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(timeout=20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
