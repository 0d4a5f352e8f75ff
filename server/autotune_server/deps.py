"""FastAPI dependencies: the database gate, the app's settings, and bearer-token checks."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from autotune_server.errors import AuthenticationRequired, PermissionDenied
from autotune_server.gate import DatabaseGate
from autotune_server.settings import Settings

__all__ = ["GateDep", "ReadAccess", "SettingsDep", "WriteAccess", "get_gate", "get_settings"]

# auto_error=False: a missing token must become our 401 in the one error shape, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="A write token from AUTOTUNE_API_TOKENS")


# The auth and settings dependencies are async on purpose: they do no I/O, and a sync dependency
# costs a hop through the thread pool on every request.
async def get_settings(request: Request) -> Settings:
    """The settings the app was created with."""
    settings: Settings = request.app.state.settings
    return settings


async def get_gate(request: Request) -> DatabaseGate:
    """The app's database gate: routes run their database work through ``gate.run(work)``.

    Not a per-request session: a session held across the route would keep its connection while the
    response is serialized, which is how a crowd deadlocked threads against connections (issue 31).
    """
    gate: DatabaseGate = request.app.state.gate
    return gate


SettingsDep = Annotated[Settings, Depends(get_settings)]
GateDep = Annotated[DatabaseGate, Depends(get_gate)]


def _match(token: str, named: dict[str, str]) -> str | None:
    # Compare against every configured token (no early exit) in constant time, so neither timing nor
    # the position of a match in the list tells an attacker anything.
    found: str | None = None
    given = token.encode()
    for candidate, name in named.items():
        if hmac.compare_digest(given, candidate.encode()):
            found = name
    return found


async def require_write(
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    """The uploader's name for a valid write token.

    Raises:
        AuthenticationRequired: no bearer token (401).
        PermissionDenied: a token that is not a write token (403).
    """
    if credentials is None or not credentials.credentials:
        raise AuthenticationRequired(
            "this request writes: send a write token as 'Authorization: Bearer TOKEN'"
        )
    named = settings.write_token_names()
    if not named:
        raise PermissionDenied("this server accepts no writes: it has no AUTOTUNE_API_TOKENS configured")
    name = _match(credentials.credentials, named)
    if name is None:
        raise PermissionDenied("the bearer token is not a write token of this server")
    return name


def _bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


async def require_read(settings: SettingsDep, request: Request) -> str | None:
    """The reader's name, or None where reads are open (the default).

    Reads read the header themselves instead of declaring HTTPBearer: that would mark the token as
    required in the OpenAPI schema, which is false on a server with open reads.

    Raises:
        AuthenticationRequired: reads need a token here and none was sent (401).
        PermissionDenied: a token that is neither a read nor a write token (403).
    """
    if not settings.read_token_required:
        return None
    token = _bearer_token(request)
    if token is None:
        raise AuthenticationRequired("this server requires a token for reads: 'Authorization: Bearer TOKEN'")
    name = _match(token, settings.read_token_names())
    if name is None:
        raise PermissionDenied("the bearer token is not a token of this server")
    return name


WriteAccess = Annotated[str, Depends(require_write)]
ReadAccess = Annotated[str | None, Depends(require_read)]
