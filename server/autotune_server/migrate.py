"""Alembic, driven from code: the migration scripts ship inside this package.

``autotune_server/migrations`` holds env.py and versions/, so ``autotune serve`` finds them from any
working directory and from an installed wheel; the repository's ``alembic.ini`` points at the same
place (``script_location = autotune_server:migrations``) for ``alembic revision --autogenerate``.
"""

from __future__ import annotations

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from autotune_server.db import ensure_sqlite_parent

__all__ = ["SCRIPT_LOCATION", "alembic_config", "head_revision", "upgrade_head"]

SCRIPT_LOCATION = "autotune_server:migrations"


def alembic_config(database_url: str) -> Config:
    """An Alembic config for this package's migrations against ``database_url`` (no ini file needed)."""
    config = Config()
    config.set_main_option("script_location", SCRIPT_LOCATION)
    # ConfigParser interpolation would read a '%' in a URL-encoded password as a reference.
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    config.attributes["database_url"] = database_url
    return config


def upgrade_head(database_url: str) -> None:
    """Upgrade the database at ``database_url`` to the newest migration (creating a SQLite file).

    Safe to run from several processes at once on PostgreSQL: env.py holds an advisory lock.

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached.
    """
    ensure_sqlite_parent(database_url)
    command.upgrade(alembic_config(database_url), "head")


def head_revision() -> str | None:
    """The newest migration's revision id."""
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()
