"""Probes for orchestrators and Prometheus: /healthz, /readyz, /metrics (outside /api/v1)."""

from __future__ import annotations

from datetime import datetime, timezone

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from sqlalchemy import text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from autotune_server import repository
from autotune_server.api import use_docstring_summaries
from autotune_server.errors import ErrorBody, error_response
from autotune_server.gate import DatabaseGate
from autotune_server.outage import RETRY_AFTER_SECONDS, classify
from autotune_server.wire import Health, Readiness

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up (no database access: a liveness probe must not fail with the database)."""
    return Health()


def _revision(session: Session) -> str | None:
    session.execute(text("SELECT 1"))
    revision: str | None = session.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return revision


async def _readiness(request: Request) -> Readiness | JSONResponse:
    head = request.app.state.head_revision
    backend = request.app.state.engine.dialect.name
    gate: DatabaseGate = request.app.state.gate
    try:
        # Through the gate like every request that uses the database: a saturated server answers
        # 503 server_busy here too (not ready for more), never a stall on the pool.
        revision = await gate.run(_revision)
    except SQLAlchemyError as exc:
        # The exception's text can hold the URL (and a password): only its class goes out.
        failure = classify(exc)
        monitor = request.app.state.outage
        if failure is not None:
            monitor.failed(failure, exc)
        since = monitor.since()
        details = {"since": f"{since:%Y-%m-%dT%H:%M:%SZ}"} if since is not None else None
        return error_response(
            503,
            "database_unavailable",
            f"database not reachable or not migrated ({type(exc).__name__})",
            details=details,
            headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
        )
    if revision != head:
        return error_response(
            503,
            "schema_out_of_date",
            f"database schema at {revision}, server expects {head}: run the migrations",
        )
    return Readiness(database=backend, revision=revision)


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={
        503: {
            "model": ErrorBody,
            "description": "Database unreachable or not migrated",
            "headers": {
                "Retry-After": {"description": "Seconds to wait before asking again", "schema": {"type": "string"}}
            },
        }
    },
)
async def readyz(request: Request) -> Readiness | JSONResponse:
    """The database answers and its schema is at the migration head."""
    return await _readiness(request)


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request) -> PlainTextResponse:
    """Prometheus metrics: requests, latencies, profiles stored, the database gate's queue."""
    gauges: dict[str, tuple[str, float]] = {}
    gate: DatabaseGate = request.app.state.gate
    try:
        # Never shed: a scrape during a crowd waits its turn (Prometheus bounds it) rather than
        # reporting a healthy database as down.
        stored = await gate.run(repository.count_profiles, shed=False)
        gauges["autotune_profiles_stored"] = ("Profiles in the store.", stored)
        gauges["autotune_database_up"] = ("Whether the last scrape reached the database.", 1)
    except SQLAlchemyError:
        gauges["autotune_database_up"] = ("Whether the last scrape reached the database.", 0)
    since = request.app.state.outage.since()
    gauges["autotune_database_outage_seconds"] = (
        "How long requests have been meeting a database outage (0 while none).",
        (datetime.now(timezone.utc) - since).total_seconds() if since is not None else 0,
    )
    gauges["autotune_database_slots_busy"] = ("Requests using the database now.", gate.busy)
    gauges["autotune_database_queue_waiting"] = ("Requests waiting for a database slot now.", gate.waiting)
    gauges["autotune_server_busy_total"] = ("Requests answered 503 server_busy (the queue full).", gate.shed)
    body = request.app.state.metrics.render(gauges)
    return PlainTextResponse(body, media_type="text/plain; version=0.0.4; charset=utf-8")


use_docstring_summaries(router)
