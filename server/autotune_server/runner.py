"""``autotune serve``: migrate, then uvicorn.

Workers are separate processes that each build the app from the environment (uvicorn's factory
mode), so they share the database and nothing else; uniqueness and idempotency live in the database.
"""

from __future__ import annotations

import os

from autotune_server.migrate import upgrade_head
from autotune_server.settings import Settings

__all__ = ["APP_FACTORY", "serve"]

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
    uvicorn.run(
        APP_FACTORY,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        access_log=settings.access_log,
        # Behind a proxy a client's slow upload must not hold a worker forever.
        timeout_keep_alive=5,
    )
