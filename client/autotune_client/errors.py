"""The client's errors, one tree, each with a one-line message meant for the user as it is.

::

    autotune.core.errors.AutotuneError             (the probe's base: one CLI handler catches both)
     └── AutotuneClientError                  no server configured, bad arguments, ...
          ├── APIConnectionError              the server could not be reached
          │    └── APITimeoutError            no answer within the client's timeout
          └── APIStatusError(status_code, body)   the server answered with an error
               ├── BadRequestError            400
               ├── AuthenticationError        401 (no token where one is needed)
               ├── PermissionDeniedError      403 (a token that is not accepted)
               ├── NotFoundError              404 (unknown profile; nothing stored for /suggest)
               ├── ConflictError              409
               ├── UnprocessableEntityError   422 (the body names the field at fault)
               ├── RateLimitError             429
               └── InternalServerError        5xx

A status error keeps the server's error body (``{"error": {"code", "message", "field", "details"}}``)
in ``body`` and its parts in ``code`` and ``field``.
"""

from __future__ import annotations

from typing import Any

import httpx2 as httpx

from autotune.core.errors import AutotuneError

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "AutotuneClientError",
    "BadRequestError",
    "ConflictError",
    "InternalServerError",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "TunerUnavailableWarning",
    "UnprocessableEntityError",
    "status_error",
]


class AutotuneClientError(AutotuneError):
    """Base of every error raised by autotune_client."""


class APIConnectionError(AutotuneClientError):
    """The server could not be reached (refused, reset, DNS, TLS, ...)."""


class APITimeoutError(APIConnectionError):
    """The server did not answer within the client's timeout (retries included)."""


class APIStatusError(AutotuneClientError):
    """The server answered with a 4xx or 5xx status.

    Attributes:
        status_code: the HTTP status.
        body: the decoded JSON error body, or the raw text when it was not JSON.
        code: the server's stable error code (``"no_matching_profile"``, ...), when it sent one.
        field: the request field at fault, when the server named one.
    """

    def __init__(self, message: str, *, status_code: int, body: Any) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body
        detail = body.get("error") if isinstance(body, dict) else None
        self.code: str | None = detail.get("code") if isinstance(detail, dict) else None
        self.field: str | None = detail.get("field") if isinstance(detail, dict) else None


class BadRequestError(APIStatusError):
    """400."""


class AuthenticationError(APIStatusError):
    """401: a write (or a read on a closed server) without a token; set AUTOTUNE_TOKEN."""


class PermissionDeniedError(APIStatusError):
    """403: the token is not one the server accepts for this action."""


class NotFoundError(APIStatusError):
    """404: an unknown profile id, or nothing stored that answers a /suggest query."""


class ConflictError(APIStatusError):
    """409."""


class UnprocessableEntityError(APIStatusError):
    """422: the server rejected a field (the message names it)."""


class RateLimitError(APIStatusError):
    """429: still rate limited after the retries."""


class InternalServerError(APIStatusError):
    """5xx: still failing after the retries."""


class TunerUnavailableWarning(UserWarning):
    """suggest() could not use the server and fell back to a local probe (or could not upload)."""


_BY_STATUS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: UnprocessableEntityError,
    429: RateLimitError,
}

_MAX_TEXT_CHARS = 200


def _decode_body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def _server_message(body: Any) -> str:
    if isinstance(body, dict):
        detail = body.get("error")
        if isinstance(detail, dict) and isinstance(detail.get("message"), str):
            return detail["message"]
        if isinstance(body.get("detail"), str):  # a plain FastAPI/Starlette error
            return body["detail"]
    text = body if isinstance(body, str) else ""
    # A proxy's HTML error page must not become a hundred-line "one-line" message.
    text = " ".join(text.split())
    return text[:_MAX_TEXT_CHARS] + ("..." if len(text) > _MAX_TEXT_CHARS else "")


def status_error(response: httpx.Response) -> APIStatusError:
    """The typed error for an error response, with a one-line message naming the request."""
    body = _decode_body(response)
    status = response.status_code
    cls = _BY_STATUS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    request = response.request
    message = _server_message(body) or response.reason_phrase or "error"
    return cls(f"{request.method} {request.url.path}: {status} {message}", status_code=status, body=body)
