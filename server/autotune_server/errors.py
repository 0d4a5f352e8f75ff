"""Domain errors and the one JSON shape every error response has.

    {"error": {"code": "profile_not_found", "message": "...", "field": null, "details": null}}

Routes raise domain exceptions (``ProfileNotFound``, ``NoProfileForSuggestion``, ...) and the
handlers installed by :func:`install_error_handlers` turn them, FastAPI's validation errors,
Starlette's 404/405 and any unexpected exception into that shape. An unexpected exception becomes
a bare 500 whose message says nothing about the code: no stack trace ever leaves the server.

A database that cannot be reached, times out, is locked past the busy timeout or is read-only is
not a bug: it answers ``503 database_unavailable`` with a short ``Retry-After`` (a full disk:
``507 database_full``), and the log gets a few lines from ``outage.OutageMonitor``, not a traceback
per request. A server whose database slots are all taken with a full queue answers ``503
server_busy`` (``autotune_server.gate``): the database is fine, this server is saturated.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from sqlalchemy.exc import DataError
from starlette.exceptions import HTTPException as StarletteHTTPException

from autotune_server.outage import DATABASE_ERRORS, RETRY_AFTER_SECONDS, OutageMonitor, classify

__all__ = [
    "AuthenticationRequired",
    "BodyTooLarge",
    "BudgetTooSmall",
    "DomainError",
    "ContextNotMeasured",
    "ErrorBody",
    "ErrorDetail",
    "InconsistentProfileError",
    "InvalidCursor",
    "InvalidPlanRequest",
    "NoProfileForSuggestion",
    "PermissionDenied",
    "ProfileNotFound",
    "ServerBusy",
    "SetupMismatch",
    "UnstorableValue",
    "database_error_response",
    "error_response",
    "install_error_handlers",
]

log = logging.getLogger(__name__)


class ErrorDetail(BaseModel):
    """What went wrong: a stable code for programs, a sentence for people, the field at fault."""

    model_config = ConfigDict(extra="forbid")

    code: str
    message: str
    field: str | None = None
    details: dict[str, Any] | list[Any] | None = None


class ErrorBody(BaseModel):
    """The body of every error response."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


class DomainError(Exception):
    """Base of the errors routes raise; each subclass fixes its status and code."""

    status_code = 400
    code = "bad_request"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        details: dict[str, Any] | list[Any] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.details = details
        self.headers = headers


class ProfileNotFound(DomainError):
    """No profile has this id (never stored, or deleted)."""

    status_code = 404
    code = "profile_not_found"


class ContextNotMeasured(DomainError):
    """No measured CUDA profile of this card (and torch version) records memory outside the allocator."""

    status_code = 404
    code = "context_not_measured"


class NoProfileForSuggestion(DomainError):
    """Nothing stored matches a /suggest query; the details say what was looked for and how to probe."""

    status_code = 404
    code = "no_matching_profile"


class InvalidPlanRequest(DomainError):
    """The plan arithmetic refused the request (e.g. target_batch < world_size)."""

    status_code = 422
    code = "invalid_plan_request"


class SetupMismatch(DomainError):
    """Every stored profile of the fingerprint was measured under another setup than the query's in a field that
    changes memory or D (the mesh, the host budget, the offload, the compile mode): named, with the stored setups."""

    status_code = 422
    code = "setup_mismatch"


class BudgetTooSmall(DomainError):
    """The given budget does not fit even one sample by the stored fit."""

    status_code = 422
    code = "budget_too_small"


class InconsistentProfileError(DomainError):
    """A profile whose claims its own trials contradict (``autotune.core.consistency``); the field and the
    trial are named, every problem is in the details."""

    status_code = 422
    code = "inconsistent_profile"


class ObservationMismatch(DomainError):
    """An observation from another device model or world size than its profile's (the field is named)."""

    status_code = 422
    code = "observation_mismatch"


class UnstorableValue(DomainError):
    """A value pydantic accepts but the database cannot keep (NUL in text, NaN, a too-wide integer)."""

    status_code = 422
    code = "validation_error"


class InvalidCursor(DomainError):
    """A pagination cursor that this server did not hand out."""

    status_code = 422
    code = "invalid_cursor"


class AuthenticationRequired(DomainError):
    """No bearer token where one is needed (401)."""

    status_code = 401
    code = "authentication_required"

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class PermissionDenied(DomainError):
    """A bearer token that is not one of the configured tokens for this action (403)."""

    status_code = 403
    code = "permission_denied"


class ServerBusy(DomainError):
    """Every database slot is taken and the queue for them is full or too slow (``autotune_server.gate``):
    nothing was done, retry after ``Retry-After``. Not an outage: the database is fine, this server is full."""

    status_code = 503
    code = "server_busy"


class BodyTooLarge(StarletteHTTPException):
    """Raised while the body streams in past the cap.

    A Starlette HTTPException on purpose: FastAPI re-raises those from its body reader, where any
    other exception would be turned into a generic 400.
    """

    def __init__(self, limit_bytes: int) -> None:
        super().__init__(status_code=413, detail=f"request body larger than {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


# Codes for the framework's own HTTP errors (unknown route, wrong method, ...).
_HTTP_CODES = {
    400: "bad_request",
    401: "authentication_required",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    413: "body_too_large",
    415: "unsupported_media_type",
    503: "database_unavailable",
    507: "database_full",
    422: "validation_error",
}


def error_response(
    status_code: int,
    code: str,
    message: str,
    *,
    field: str | None = None,
    details: dict[str, Any] | list[Any] | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """Build a response in the one error shape."""
    body = ErrorBody(error=ErrorDetail(code=code, message=message, field=field, details=details))
    return JSONResponse(body.model_dump(mode="json"), status_code=status_code, headers=headers)


def _field_of(loc: tuple[Any, ...] | list[Any]) -> str:
    # FastAPI prefixes the location ("body", "query", "path"); the field is what follows it.
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header", "cookie") and len(parts) > 1:
        parts = parts[1:]
    return ".".join(parts) if parts else "body"


def _json_invalid(err: dict[str, Any]) -> str | None:
    """The line for a body that is not JSON, or None for another error. FastAPI puts the decoder's character
    offset where a field's name goes (``loc: ("body", 5)``): it is said as a position, and no field is named."""
    if err.get("type") != "json_invalid":
        return None
    loc = list(err.get("loc", ()))
    position = loc[-1] if len(loc) > 1 and isinstance(loc[-1], int) else None
    ctx = err.get("ctx")
    # The decoder's own words ("Expecting value"), never the input: json.JSONDecodeError.msg holds no content.
    reason = str(ctx.get("error", "")) if isinstance(ctx, dict) else ""
    where = f" at character {position} (counting from 0)" if position is not None else ""
    return f"the body is not valid JSON: {reason or 'cannot decode'}{where}"


def _validation_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    problems: list[dict[str, Any]] = []
    for err in exc.errors():
        not_json = _json_invalid(err)
        if not_json is not None:
            problems.append({"field": None, "message": not_json})
            continue
        # "input" and "ctx" can echo back arbitrary (huge or hostile) request content: leave them out.
        problems.append({"field": _field_of(err.get("loc", ())), "message": str(err.get("msg", ""))})
    first = problems[0] if problems else {"field": None, "message": "invalid request"}
    message = f"{first['field']}: {first['message']}" if first["field"] else str(first["message"])
    if len(problems) > 1:
        message += f" (and {len(problems) - 1} more)"
    return error_response(422, "validation_error", message, field=first["field"], details=problems)


def _domain_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, DomainError)
    return error_response(
        exc.status_code, exc.code, exc.message, field=exc.field, details=exc.details, headers=exc.headers
    )


def _http_handler(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400:
        # FastAPI's body reader says 400 for bytes that are not even text (invalid UTF-8), and 422
        # for text that is not JSON; to a client both are "the body is not valid JSON".
        return error_response(422, "validation_error", "the body is not valid JSON: not UTF-8 text")
    code = _HTTP_CODES.get(exc.status_code, "http_error")
    message = exc.detail if isinstance(exc.detail, str) else code.replace("_", " ")
    headers = dict(exc.headers) if exc.headers else None
    field = "body" if exc.status_code == 413 else None
    return error_response(exc.status_code, code, message, field=field, headers=headers)


def _data_error_handler(request: Request, exc: Exception) -> JSONResponse:
    # The safety net behind storable.py: the database refused a value (e.g. a NUL in a query string on
    # PostgreSQL). That is the client's input, so a 422 -- without the SQL or the value in the message.
    log.info("database refused a value on %s %s: %s", request.method, request.url.path, type(exc).__name__)
    return error_response(
        422, "unstorable_value", "a value cannot be stored or compared: out of range or containing NUL"
    )


def database_error_response(request: Request, exc: Exception) -> JSONResponse:
    """The answer to an exception of the database layer: 503/507 for an outage, else a 500.

    An outage is counted by the app's ``OutageMonitor`` (``app.state.outage``), which writes the log
    lines; anything else is a real error and is logged with its traceback.
    """
    failure = classify(exc)
    if failure is None:
        return _unexpected_handler(request, exc)
    monitor = getattr(request.app.state, "outage", None)
    if isinstance(monitor, OutageMonitor):
        monitor.failed(failure, exc)
    since = monitor.since() if isinstance(monitor, OutageMonitor) else None
    details: dict[str, Any] = {"kind": failure.kind}
    if since is not None:
        details["since"] = since.isoformat(timespec="seconds").replace("+00:00", "Z")
    if failure.status_code == 507:
        # A full disk is not over in seconds: no Retry-After, and the client does not retry it.
        return error_response(507, failure.code, failure.message, details=details)
    return error_response(
        failure.status_code,
        failure.code,
        f"{failure.message}; try again in {RETRY_AFTER_SECONDS} s",
        details=details,
        headers={"Retry-After": str(RETRY_AFTER_SECONDS)},
    )


def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    # Logged here with its trace for the operator; the client learns only that it was our fault.
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal_error", "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Map every error the app can raise to the one JSON error shape."""
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(DomainError, _domain_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(DataError, _data_error_handler)
    for database_error in DATABASE_ERRORS:
        app.add_exception_handler(database_error, database_error_response)
    app.add_exception_handler(Exception, _unexpected_handler)
