"""The app factory.

    from autotune_server import create_app, Settings
    app = create_app(Settings(database_url="sqlite:///./var/dev.db", api_tokens=("secret",)))

Nothing touches the database at import or in ``create_app``: the engine and sessionmaker are made
in the lifespan and kept on ``app.state`` (``engine``, ``sessionmaker``, ``gate``: the one way requests
reach the database, ``autotune_server.gate``; ``settings``, ``metrics``, and for outages ``outage`` and
``remembered_lookups``: ``autotune_server.outage``).
The schema is not created here either; ``autotune_server.migrate.upgrade_head`` does that.

Other routers: pass them as ``routers=``, call ``app.include_router`` on the result, or give the
package a ``autotune_server.pages`` module with a ``router`` (and optionally ``install(app)``), which
``create_app`` includes when it exists -- that is where the dashboard goes.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI

from autotune import __version__
from autotune_server import api, health
from autotune_server.db import make_engine, make_sessionmaker
from autotune_server.errors import install_error_handlers
from autotune_server.gate import DatabaseGate
from autotune_server.metrics import MetricsMiddleware, Registry
from autotune_server.middleware import AllowMiddleware, BodyLimitMiddleware
from autotune_server.migrate import head_revision
from autotune_server.outage import OutageMonitor, RememberedLookups
from autotune_server.settings import Settings
from autotune_server.suggest_cache import LookupCache

__all__ = ["PAGES_MODULE", "create_app"]

PAGES_MODULE = "autotune_server.pages"


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    settings: Settings = app.state.settings
    engine = make_engine(
        settings.database_url,
        busy_timeout_seconds=settings.sqlite_busy_timeout_seconds,
        pool_size=settings.db_pool_size,
        max_overflow=settings.db_max_overflow,
    )
    app.state.engine = engine
    app.state.sessionmaker = make_sessionmaker(engine)
    app.state.gate = DatabaseGate(
        app.state.sessionmaker,
        slots=settings.database_slots,
        queue_limit=settings.db_queue_limit,
        queue_seconds=settings.db_queue_seconds,
        outage=app.state.outage,
    )
    app.state.head_revision = head_revision()
    try:
        yield
    finally:
        engine.dispose()


def _include_pages(app: FastAPI) -> None:
    if importlib.util.find_spec(PAGES_MODULE) is None:
        return
    pages = importlib.import_module(PAGES_MODULE)
    router = getattr(pages, "router", None)
    if isinstance(router, APIRouter):
        app.include_router(router)
    install = getattr(pages, "install", None)
    if callable(install):
        install(app)


def create_app(settings: Settings | None = None, *, routers: Sequence[APIRouter] = ()) -> FastAPI:
    """Build the service.

    Args:
        settings: explicit settings; None reads them from the environment (``AUTOTUNE_*``), which
            is what uvicorn's ``--factory`` and every worker process do.
        routers: extra routers to include after the API's.

    Returns:
        The FastAPI app; its lifespan opens the database.
    """
    settings = settings if settings is not None else Settings()
    app = FastAPI(
        title="autotune",
        version=__version__,
        summary="Measured micro-batch profiles and the plans that keep the effective batch.",
        lifespan=_lifespan,
    )
    app.state.settings = settings
    app.state.metrics = Registry()
    app.state.suggest_cache = LookupCache(settings.suggest_cache_seconds)
    app.state.outage = OutageMonitor()
    app.state.remembered_lookups = RememberedLookups(settings.suggest_stale_seconds)
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(api.router)
    for router in routers:
        app.include_router(router)
    _include_pages(app)
    # Added last = outermost: the cap applies before anything reads the body; metrics see every answer.
    app.add_middleware(AllowMiddleware, routes_of=lambda: app.router.routes)
    app.add_middleware(BodyLimitMiddleware, limit_bytes=settings.max_body_bytes)
    app.add_middleware(MetricsMiddleware, registry=app.state.metrics, routes_of=lambda: app.router)
    return app
