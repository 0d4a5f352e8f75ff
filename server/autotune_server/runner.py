"""``autotune serve``: migrate, then uvicorn.

Workers are separate processes that each build the app from the environment (uvicorn's factory
mode), so they share the database and nothing else; uniqueness and idempotency live in the database.
"""

from __future__ import annotations

import os
import socket
import sys

from autotune_server.migrate import upgrade_head
from autotune_server.settings import Settings

__all__ = ["APP_FACTORY", "addresses", "serve"]

APP_FACTORY = "autotune_server.app:create_app"


def serve(*, host: str, port: int, workers: int, database_url: str | None = None) -> None:
    """Upgrade the database to head, then serve until interrupted.

    Args:
        host, port: where to listen.
        workers: uvicorn worker processes (>= 1).
        database_url: overrides ``AUTOTUNE_DATABASE_URL`` (and is exported to it, for the workers).

    Raises:
        ValueError: workers < 1.
        sqlalchemy.exc.OperationalError: the database cannot be reached for the migrations.
    """
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    import uvicorn  # here, not at import: the CLI imports this module for --help too

    if database_url is not None:
        # Worker processes rebuild the app from the environment: this is how they get the URL.
        os.environ["AUTOTUNE_DATABASE_URL"] = database_url
    settings = Settings()
    upgrade_head(settings.database_url)
    # Bound here, not by uvicorn, so that the line below can name the port the system gave for --port 0; uvicorn
    # serves the socket as it does one of its --fd (and shares it with its workers).
    listening = _bind(host, port)
    try:
        print(f"autotune: {addresses(host, listening.getsockname()[1])}", file=sys.stderr, flush=True)
        uvicorn.run(
            APP_FACTORY,
            factory=True,
            fd=listening.fileno(),
            workers=workers,
            access_log=settings.access_log,
            # Behind a proxy a client's slow upload must not hold a worker forever.
            timeout_keep_alive=5,
        )
    finally:
        listening.close()


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port as uvicorn binds one (IPv6 where the host has a colon, the address
    reusable at once after a restart)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=2048)


def addresses(host: str, port: int) -> str:
    """The line ``autotune serve`` starts with: where the dashboard and the API answer.

    >>> addresses("127.0.0.1", 8000)
    'the dashboard at http://127.0.0.1:8000/ and the API at http://127.0.0.1:8000/api/v1 (its reference at /docs)'
    >>> addresses("0.0.0.0", 8000).split(" and ")[0]
    'the dashboard at http://localhost:8000/ (every address of this host)'
    """
    everywhere = host in ("0.0.0.0", "::", "")
    name = "localhost" if everywhere else (f"[{host}]" if ":" in host else host)
    base = f"http://{name}:{port}"
    anywhere = " (every address of this host)" if everywhere else ""
    return f"the dashboard at {base}/{anywhere} and the API at {base}/api/v1 (its reference at /docs)"
