"""tests/e2e/test_crowd.py's two crowds at their full size: a real ``autotune_server serve`` per run.

    .venv/bin/python bench/crowd.py                      # 200 clients, SQLite
    .venv/bin/python bench/crowd.py --clients 300 --postgres-url postgresql+psycopg://postgres@127.0.0.1/test

The suite runs them with 100 clients (more than the 80 concurrent requests that stalled the service in issue
31); here the clients of issue 31's 200 (or --clients), on a fresh migrated SQLite file and, given
--postgres-url, on a new schema of that PostgreSQL (dropped at the end). For each database: the default gate
(every client makes two calls of the mix) and a saturated one (1 database slot, 4 waiting; one call each).
Prints, per run, the seconds the crowd took, the calls done by kind, the failed calls, the server's busy
answers (autotune_server_busy_total) and the 5xx statuses it answered. Figures only: never part of the tests.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.e2e import test_crowd as crowd  # noqa: E402

RUNS = (("default", {}, 2), ("saturated", {"AUTOTUNE_DB_SLOTS": "1", "AUTOTUNE_DB_QUEUE_LIMIT": "4"}, 1))


def _databases(args: argparse.Namespace, directory: Path) -> list[tuple[str, str, object]]:
    """(name, URL, what to drop afterwards) of each database, migrated and empty."""
    from autotune_server.migrate import upgrade_head

    found: list[tuple[str, str, object]] = []
    path = directory / "crowd.db"
    upgrade_head(f"sqlite:///{path}")
    found.append(("sqlite", f"sqlite:///{path}", None))
    if args.postgres_url:
        from tests.conftest import PostgresSchemas

        schemas = PostgresSchemas(args.postgres_url)
        url = schemas.new()
        upgrade_head(url)
        found.append(("postgresql", url, schemas))
    return found


def _empty(name: str, url: str, directory: Path, template: Path | None) -> None:
    """A fresh copy of the migrated SQLite file, or the PostgreSQL tables truncated."""
    if name == "sqlite":
        assert template is not None
        shutil.copyfile(template, Path(url.removeprefix("sqlite:///")))
    else:
        from tests.conftest import _truncate_postgres

        _truncate_postgres(url)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--postgres-url", default="", help="also run on a new schema of this PostgreSQL")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="crowd-") as folder:
        directory = Path(folder)
        databases = _databases(args, directory)
        template = directory / "template.db"
        shutil.copyfile(directory / "crowd.db", template)
        print(
            f"{'database':<11} {'gate':<10} {'clients':>7} {'seconds':>8} {'calls':>6} {'failed':>6} {'busy':>5}  5xx"
        )
        try:
            for name, url, _ in databases:
                for gate, settings, calls_each in RUNS:
                    _empty(name, url, directory, template)
                    server = crowd._start(url, directory, **settings)
                    try:
                        started = time.monotonic()
                        done, failures = crowd._crowd(server.url, kinds_per_client=calls_each, clients=args.clients)
                        seconds = time.monotonic() - started
                        busy = server.metric("autotune_server_busy_total")
                        try:
                            statuses = crowd._only_busy_answers(server)
                        except AssertionError as exc:  # a 5xx but busy, or the log says unavailable
                            statuses = {f"not only busy: {exc}"}
                    finally:
                        server.process.terminate()
                        server.process.wait(timeout=10)
                    print(
                        f"{name:<11} {gate:<10} {args.clients:>7} {seconds:>8.1f} {sum(done.values()):>6} "
                        f"{len(failures):>6} {busy:>5.0f}  {','.join(sorted(statuses)) or '-'}"
                    )
                    if failures:
                        print(f"  first failure: {failures[0]!r}")
        finally:
            for _, _, schemas in databases:
                if schemas is not None:
                    schemas.close()  # type: ignore[attr-defined]
    return 0


if __name__ == "__main__":
    sys.exit(main())
