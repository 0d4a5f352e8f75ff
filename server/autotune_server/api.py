"""The REST API under /api/v1. Routes are thin: validate, call the repository, convert, answer."""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Depends, Path, Query, Request, Response, status
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from autotune.core.schemas import (
    FINGERPRINT_PATTERN,
    FULL_FINGERPRINT_CHARS,
    MAX_SEQ_LEN,
    MAX_WORLD_SIZE,
    ActivationCheckpointing,
    DeviceContext,
    Observation,
    Precision,
    Profile,
    Source,
    Strategy,
    Suggestion,
    SuggestQuery,
)
from autotune_server import drift, repository
from autotune_server.candidates import Lookup
from autotune_server.consistency import consistent_lookup, require_consistent
from autotune_server.convert import to_stored_observation, to_stored_profile, to_summary
from autotune_server.deps import GateDep, ReadAccess, WriteAccess
from autotune_server.errors import ContextNotMeasured, ErrorBody
from autotune_server.fingerprints import resolve_fingerprint
from autotune_server.gate import DatabaseGate
from autotune_server.outage import DATABASE_ERRORS, STALE_HEADER, Failure, classify
from autotune_server.storable import check_storable
from autotune_server.suggest import compute as compute_suggestion
from autotune_server.suggest_cache import LookupCache
from autotune_server.wire import ObservationPage, ProfilePage, ProfileRef, StoredObservation, StoredProfile

__all__ = ["API_PREFIX", "MAX_PAGE_SIZE", "router", "use_docstring_summaries"]

API_PREFIX = "/api/v1"
MAX_PAGE_SIZE = 500
# Ids are 32-bit on every database; a larger one cannot exist, and must not reach PostgreSQL as an overflow.
MAX_ID = 2**31 - 1


# Every route that reads or writes the store can meet an outage or a full queue: 503 (with
# Retry-After) or 507.
_OUTAGE = (503, 507)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {
        401: "No bearer token where one is needed",
        403: "A token that does not allow this",
        404: "Nothing stored matches",
        413: "Request body over the size cap",
        422: "A field is missing, unknown or out of range, or a profile's trials contradict it "
        "(the error names the field, and the trial)",
        503: "The database is unavailable (database_unavailable: unreachable, timed out, locked or "
        "read-only), or every database slot of this server is taken and its queue is full (server_busy): "
        "nothing was stored; retry after Retry-After seconds",
        507: "The database's disk is full: nothing was stored",
    }
    out: dict[int | str, dict[str, Any]] = {}
    for code in (*codes, *_OUTAGE):
        out[code] = {"model": ErrorBody, "description": text[code]}
        if code == 503:
            out[code]["headers"] = {
                "Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "string"}}
            }
    return out


router = APIRouter(prefix=API_PREFIX, tags=["api"])


async def _raw_body(request: Request) -> bytes:
    # Already read and cached by FastAPI for the typed parameter; this only hands the bytes over.
    return await request.body()


RawBody = Annotated[bytes, Depends(_raw_body)]


M = TypeVar("M", bound=BaseModel)


def _strict(model: type[M], raw: bytes) -> M:
    """Validate a body again in strict mode: lax mode would take ``true`` for an integer field.

    The typed parameter already validated it (and documents it in OpenAPI); this second pass makes
    the server as strict as the JSON schema it publishes.
    """
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_context=False)]
        raise RequestValidationError(errors) from None


ProfileId = Annotated[int, Path(ge=1, le=MAX_ID, description="The id POST /profiles answered with")]


@router.post(
    "/profiles",
    status_code=status.HTTP_201_CREATED,
    response_model=ProfileRef,
    responses={
        200: {"model": ProfileRef, "description": "An identical profile was already stored"},
        201: {
            "description": "Stored",
            "headers": {"Location": {"description": "URL of the profile", "schema": {"type": "string"}}},
        },
        **_errors(401, 403, 413, 422),
    },
)
async def upload_profile(
    profile: Annotated[Profile, Body()],
    raw: RawBody,
    uploader: WriteAccess,
    gate: GateDep,
    request: Request,
    response: Response,
) -> ProfileRef:
    """Store a profile (idempotent: the same body twice is one row, 201 then 200).

    A body the JSON schema accepts can still be refused with 422 ``inconsistent_profile``: the
    profile must say what its own trials measured (``max_micro_batch`` fits and the next size up
    does not, each trial's ``fits`` agrees with its peak and the limit, the plan adds up, the fit is
    finite, the budget is within the device). The error names the field and the trial at fault.
    During a database outage the answer is 503 (nothing stored; retry after ``Retry-After``) or 507
    (disk full): a retry of the same body never stores it twice.
    """


    def store(session: Session) -> tuple[int, str, bool]:
        # The checks are CPU work: in the gate's thread too, before the first query takes a connection.
        checked = _strict(Profile, raw)
        check_storable(checked)
        require_consistent(checked)
        row, created = repository.add_profile(session, checked, uploader=uploader)
        return row.id, row.content_hash, created

    profile_id, content_hash, created = await gate.run(store)
    request.app.state.suggest_cache.clear()
    url = str(request.url_for("get_profile", profile_id=profile_id).path)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    response.headers["Location"] = url
    return ProfileRef(id=profile_id, content_hash=content_hash, created=created, url=url)


@router.get("/profiles", response_model=ProfilePage, responses=_errors(401, 403, 422))
async def list_profiles(
    gate: GateDep,
    _reader: ReadAccess,
    fingerprint: Annotated[
        str | None,
        Query(pattern=FINGERPRINT_PATTERN, description="a fingerprint, or its first 16 or more hex digits"),
    ] = None,
    task: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    device_name: Annotated[str | None, Query(min_length=1, max_length=256)] = None,
    precision: Precision | None = None,
    strategy: Annotated[Strategy | None, Query(description="ddp or fsdp")] = None,
    world_size: Annotated[int | None, Query(ge=1, le=MAX_WORLD_SIZE)] = None,
    source: Annotated[Source | None, Query(description="measured or estimate")] = None,
    activation_checkpointing: Annotated[
        ActivationCheckpointing | None,
        Query(description="none, every-K (K >= 2), full, op or op:OP/OP/... (canonical spelling matched)"),
    ] = None,
    seq_len: Annotated[
        int | None, Query(ge=1, le=MAX_SEQ_LEN, description="a sequence-aware setup's sequence length")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)] = 50,
    cursor: Annotated[
        str | None, Query(max_length=64, description="next_cursor of the previous page")
    ] = None,
) -> ProfilePage:
    """List profiles, newest upload first, filtered and paginated by cursor."""
    before_id = repository.decode_cursor(cursor) if cursor is not None else None
    filters = repository.ProfileFilters(
        fingerprint=fingerprint,
        task=task,
        device_name=device_name,
        precision=precision,
        strategy=strategy,
        world_size=world_size,
        source=source,
        activation_checkpointing=activation_checkpointing,
        seq_len=seq_len,
    )


    def page(session: Session) -> ProfilePage:
        rows, next_before = repository.list_profiles(session, filters, limit=limit, before_id=before_id)
        return ProfilePage(
            items=[to_summary(r) for r in rows],
            next_cursor=repository.encode_cursor(next_before) if next_before is not None else None,
        )

    return await gate.run(page)


@router.get("/profiles/{profile_id}", response_model=StoredProfile, responses=_errors(401, 403, 404, 422))
async def get_profile(profile_id: ProfileId, gate: GateDep, _reader: ReadAccess) -> StoredProfile:
    """One stored profile with its trials."""

    def read(session: Session) -> StoredProfile:
        row = repository.get_profile(session, profile_id)
        return to_stored_profile(row, repository.observation_count(session, profile_id))

    return await gate.run(read)


@router.get("/devices/context", response_model=DeviceContext, responses=_errors(401, 403, 404, 422))
async def device_context(
    device_name: Annotated[str, Query(min_length=1, max_length=256, description="as NVML names the card")],
    gate: GateDep,
    _reader: ReadAccess,
    torch_version: Annotated[
        str | None, Query(max_length=64, pattern=r"^\d+\.\d+", description="only trials of this torch (major.minor)")
    ] = None,
) -> DeviceContext:
    """What measured CUDA profiles of a card record of the memory outside the caching allocator."""
    found = await gate.run(lambda session: repository.device_context(session, device_name, torch_version))
    if found is None:
        raise ContextNotMeasured(
            f"no measured CUDA profile of {device_name!r}"
            + (f" with torch {torch_version}" if torch_version else "")
            + " records memory outside the allocator: probe on that card first",
            field="device_name",
        )
    return found


@router.delete(
    "/profiles/{profile_id}",
    status_code=status.HTTP_204_NO_CONTENT,
    response_class=Response,
    responses=_errors(401, 403, 404, 422),
)
async def delete_profile(
    profile_id: ProfileId, _uploader: WriteAccess, gate: GateDep, request: Request
) -> Response:
    """Delete a profile with its trials and observations."""
    await gate.run(lambda session: repository.delete_profile(session, profile_id))
    _forget_answers(request)
    return Response(status_code=status.HTTP_204_NO_CONTENT)


@router.post(
    "/profiles/{profile_id}/observations",
    status_code=status.HTTP_201_CREATED,
    response_model=StoredObservation,
    responses=_errors(401, 403, 404, 413, 422),
)
async def add_observation(
    profile_id: ProfileId,
    observation: Annotated[Observation, Body()],
    raw: RawBody,
    uploader: WriteAccess,
    gate: GateDep,
    request: Request,
) -> StoredObservation:
    """Record what a training job really saw (its peak, or an OOM) against a profile."""

    def record(session: Session) -> StoredObservation:
        checked = _strict(Observation, raw)
        check_storable(checked)
        said = drift.check_observation(checked, repository.get_profile(session, profile_id))
        stored = to_stored_observation(repository.add_observation(session, profile_id, checked, uploader=uploader))
        stored.warnings = said
        return stored

    stored = await gate.run(record)
    request.app.state.suggest_cache.clear()  # the drift and the OOM cap answer from the next request on
    return stored


@router.get(
    "/profiles/{profile_id}/observations",
    response_model=ObservationPage,
    responses=_errors(401, 403, 404, 422),
)
async def list_observations(profile_id: ProfileId, gate: GateDep, _reader: ReadAccess) -> ObservationPage:
    """The observations recorded against a profile, oldest first."""

    def read(session: Session) -> ObservationPage:
        rows = repository.list_observations(session, profile_id)
        return ObservationPage(items=[to_stored_observation(r) for r in rows])

    return await gate.run(read)


_REMEMBERED_HEADERS = {
    "Age": {
        "description": "Only on an answer given from memory while the database is unavailable: "
        "seconds since the store was read for it",
        "schema": {"type": "string"},
    },
    STALE_HEADER: {
        "description": "Only on an answer given from memory: why (database_unavailable)",
        "schema": {"type": "string"},
    },
}


@router.get(
    "/suggest",
    response_model=Suggestion,
    responses={
        200: {
            "description": "The plan (from memory during an outage: see the headers)",
            "headers": _REMEMBERED_HEADERS,
        },
        **_errors(401, 403, 404, 422),
    },
)
async def suggest(_reader: ReadAccess, request: Request, query: Annotated[SuggestQuery, Query()]) -> Response:
    """The plan for a job: measured on this device model, else predicted, else estimated, else 404."""
    # The hot path of a sweep's start: async, no thread-pool hop at all on a cached answer; on a miss,
    # one hop for the database (shared by concurrent misses) and one for the plan arithmetic, which
    # never runs on the event loop. The Suggestion is serialized once here instead of re-validated
    # by the response model. The query itself (frozen, hashable) keys the finished answers.
    state = request.app.state
    cache = state.suggest_cache
    asked = query
    body = cache.get_answer(asked)
    if body is None:
        query = await _with_stored_fingerprint(query, state)
        key = (query.fingerprint, query.device_name)
        found = cache.get(key)
        remembered: _Remembered | None = None
        if found is None:
            found, remembered = await _lookup_or_remembered(cache, key, state)
        body = await run_in_threadpool(_answer, found, query, lambda: str(request.base_url).rstrip("/"))
        if remembered is not None:
            return _remembered_answer(body, remembered)
        cache.put_answer(asked, body)
    return Response(body, media_type="application/json")


async def _with_stored_fingerprint(query: SuggestQuery, state: Any) -> SuggestQuery:
    """The query with the stored fingerprint its prefix names (autotune_server.fingerprints); a whole one as it is,
    without a query."""
    if len(query.fingerprint) >= FULL_FINGERPRINT_CHARS:
        return query
    gate: DatabaseGate = state.gate
    text = query.fingerprint
    stored = await gate.run(lambda session: resolve_fingerprint(session.connection(), text))
    return query if stored == text else query.model_copy(update={"fingerprint": stored})


def _answer(found: Lookup, query: SuggestQuery, server_url: Callable[[], str]) -> bytes:
    # In a worker thread: the plan arithmetic and the serialization are CPU work that must not stall
    # the event loop (domain errors propagate to the route, and from there to the error handlers).
    return compute_suggestion(found, query, server_url=server_url).model_dump_json().encode()


async def _single_flight(cache: LookupCache, key: tuple[str, str], state: Any) -> Lookup:
    # When the cached lookup expires under load, every waiting request would query at once; the
    # first one queries and the others await its result (all on this one event loop).
    pending = cache.inflight.get(key)
    if pending is None:
        fingerprint, device_name = key
        gate: DatabaseGate = state.gate
        pending = asyncio.ensure_future(
            # Stored profiles that contradict their own trials never answer (autotune_server.consistency).
            gate.run(lambda session: consistent_lookup(session.connection(), fingerprint, device_name))
        )
        cache.inflight[key] = pending
        try:
            found: Lookup = await pending
        finally:
            cache.inflight.pop(key, None)
        cache.put(key, found)
        if found.here or found.elsewhere:
            state.remembered_lookups.remember(key, found)
        return found
    return await asyncio.shield(pending)


@dataclass(frozen=True)
class _Remembered:
    age_seconds: float
    failure: Failure


async def _lookup_or_remembered(
    cache: LookupCache, key: tuple[str, str], state: Any
) -> tuple[Lookup, _Remembered | None]:
    """The lookup from the database; while it is unavailable, the one remembered for ``key``.

    Raises the database's exception (a 503 from the error handlers) when it is not an outage or
    nothing recent is remembered. Lookups that found nothing are not remembered (``_single_flight``):
    "nothing stored" is not known while the store cannot be read, so that is a 503 too.
    """
    try:
        return await _single_flight(cache, key, state), None
    except DATABASE_ERRORS as exc:
        failure = classify(exc)
        recalled = state.remembered_lookups.recall(key) if failure is not None else None
        if failure is None or recalled is None:
            raise
        state.outage.failed(failure, exc, refused=False)
        found, age_seconds = recalled
        return found, _Remembered(age_seconds, failure)


def _remembered_answer(body: bytes, remembered: _Remembered) -> Response:
    # Said in the body (a warning, which every client shows) and in the headers (for proxies and logs).
    suggestion = json.loads(body)
    suggestion.setdefault("warnings", []).append(
        f"the store's database is unavailable ({remembered.failure.kind}): this answer comes from what "
        f"it read {remembered.age_seconds:.0f} s ago, from memory; profiles stored since are not in it"
    )
    headers = {"Age": str(int(remembered.age_seconds)), STALE_HEADER: "database_unavailable"}
    return Response(json.dumps(suggestion).encode(), media_type="application/json", headers=headers)


def _forget_answers(request: Request) -> None:
    # After a delete in this process: a deleted profile must answer neither from the cache nor from
    # memory. (Uploads clear only the cache: an answer from memory says it may miss newer profiles.)
    request.app.state.suggest_cache.clear()
    request.app.state.remembered_lookups.clear()


def use_docstring_summaries(target: APIRouter) -> None:
    """Make each route's one-line docstring its OpenAPI summary (FastAPI would title-case the name)."""
    for route in target.routes:
        if isinstance(route, APIRoute) and not route.summary:
            doc = inspect.getdoc(route.endpoint) or ""
            route.summary = doc.split("\n", 1)[0] or None


use_docstring_summaries(router)
