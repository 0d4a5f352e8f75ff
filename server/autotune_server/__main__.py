"""``python -m autotune_server upgrade|serve``: the service without the probe's CLI (used by the image).

python -m autotune_server upgrade [--database-url URL]
python -m autotune_server serve [--host 127.0.0.1] [--port 8000] [--workers 1] [--database-url URL]
"""

from __future__ import annotations

import argparse
import sys

from autotune_server.migrate import upgrade_head
from autotune_server.runner import serve
from autotune_server.settings import Settings

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Parse the arguments and run the command; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m autotune_server", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("upgrade", help="upgrade the database to the newest migration")
    up.add_argument(
        "--database-url", default=None, help="default: $AUTOTUNE_DATABASE_URL or ./var/autotune.db"
    )
    run = commands.add_parser("serve", help="upgrade, then serve the API with uvicorn")
    run.add_argument("--host", default="127.0.0.1")
    run.add_argument("--port", type=int, default=8000)
    run.add_argument("--workers", type=int, default=1)
    run.add_argument("--database-url", default=None)
    args = parser.parse_args(argv)
    if args.command == "upgrade":
        upgrade_head(args.database_url or Settings().database_url)
        return 0
    serve(host=args.host, port=args.port, workers=args.workers, database_url=args.database_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
