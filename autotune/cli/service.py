"""`autotune serve` and `autotune db`: the store's process and its schema (no torch imported)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from autotune.cli.common import port, positive_int

__all__ = ["add_parsers", "run_db", "run_serve"]


def add_parsers(sub: Any) -> None:
    s = sub.add_parser("serve", help="run the profile store and REST API")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port, default=8000)
    s.add_argument("--workers", type=positive_int, default=1)
    s.add_argument("--database-url", help="default: AUTOTUNE_DATABASE_URL or a SQLite file")
    s.set_defaults(run=run_serve)

    d = sub.add_parser("db", help="database maintenance")
    d.add_argument("action", choices=["upgrade"])
    d.add_argument("--database-url")
    d.set_defaults(run=run_db)


def run_serve(args: argparse.Namespace) -> int:
    from autotune_server.runner import serve

    serve(host=args.host, port=args.port, workers=args.workers, database_url=args.database_url)
    return 0


def run_db(args: argparse.Namespace) -> int:
    from autotune_server.migrate import upgrade_head

    url = args.database_url or os.environ.get("AUTOTUNE_DATABASE_URL")
    if url is None:
        from autotune_server.settings import Settings

        url = Settings().database_url
    upgrade_head(url)
    print(f"database at head: {url.split('@')[-1]}", file=sys.stderr)
    return 0
