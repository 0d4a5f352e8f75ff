"""autotune_server: the profile store and REST API (FastAPI, SQLAlchemy 2, Alembic).

Imports ``autotune.core.schemas`` and ``autotune.core.plan`` (with ``autotune.core.split`` below them) and nothing
else of autotune: the service image has no torch.
"""

from autotune_server.app import create_app
from autotune_server.settings import Settings

__all__ = ["Settings", "create_app"]
