"""ASGI middleware: the request body cap (413), and the methods of a resource (Allow, OPTIONS, HEAD)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from autotune_server.errors import BodyTooLarge, error_response

__all__ = ["METHOD_ORDER", "AllowMiddleware", "BodyLimitMiddleware"]

METHOD_ORDER = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
"""The order methods are listed in ``Allow``."""


class BodyLimitMiddleware:
    """Refuse bodies over ``limit_bytes``.

    A declared Content-Length over the cap is refused before a byte of the body is read. A chunked
    body (or one that lies about its length) is counted as it streams; past the cap, reading raises
    BodyTooLarge, which FastAPI passes to the error handlers as the 413 it is.
    """

    def __init__(self, app: ASGIApp, limit_bytes: int) -> None:
        self.app = app
        self.limit_bytes = limit_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit_bytes
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > limit:
                    response = error_response(
                        413, "body_too_large", f"request body larger than {limit} bytes", field="body"
                    )
                    await response(scope, receive, send)
                    return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            # Only reached where the body was read outside FastAPI's handlers (e.g. by a middleware).
            if started:
                raise
            response = error_response(413, "body_too_large", f"request body larger than {limit} bytes")
            await response(scope, receive, send)


def _routes(routes: Sequence[Any]) -> Iterator[tuple[re.Pattern[str], frozenset[str]]]:
    for route in routes:
        # FastAPI keeps an included router whole (its routes carry their full paths); look inside.
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _routes(inner.routes)
            continue
        regex = getattr(route, "path_regex", None)
        methods = getattr(route, "methods", None)
        if isinstance(regex, re.Pattern) and methods:
            yield regex, frozenset(m.upper() for m in methods)


class AllowMiddleware:
    """Every method of a resource, said exactly (RFC 9110).

    Starlette answers a method a path does not take with the ``Allow`` of the first route that
    matched the path, while a resource here is often several routes (GET and POST /profiles). This
    lists the union of every route's methods in a 405's ``Allow``, answers ``OPTIONS`` with 204 and
    that ``Allow``, and answers ``HEAD`` wherever ``GET`` is answered (the GET's status and headers,
    no body). Paths no route has (and mounts such as /static, which answer for themselves) pass through.

    Args:
        app: the ASGI app.
        routes_of: returns the app's routes (read once, at the first request that needs them).
    """

    def __init__(self, app: ASGIApp, routes_of: Callable[[], Sequence[BaseRoute]]) -> None:
        self.app = app
        self._routes_of = routes_of
        self._index: list[tuple[re.Pattern[str], frozenset[str]]] | None = None

    def allowed(self, path: str) -> list[str] | None:
        """The methods the resource at ``path`` answers, in :data:`METHOD_ORDER`; None when no route has it."""
        if self._index is None:
            self._index = list(_routes(self._routes_of()))
        methods: set[str] = set()
        for regex, route_methods in self._index:
            if regex.match(path):
                methods |= route_methods
        if not methods:
            return None
        if "GET" in methods:
            methods.add("HEAD")
        methods.add("OPTIONS")
        return [m for m in METHOD_ORDER if m in methods] + sorted(methods.difference(METHOD_ORDER))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope["method"]
        if method in ("OPTIONS", "HEAD"):
            allowed = self.allowed(scope["path"])
            if allowed is not None and method == "OPTIONS":
                await send({"type": "http.response.start", "status": 204, "headers": [(b"allow", _join(allowed))]})
                await send({"type": "http.response.body", "body": b""})
                return
            if allowed is not None and "GET" in allowed:
                await self.app({**scope, "method": "GET"}, receive, _without_body(send))
                return

        async def send_with_allow(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] == 405:
                allowed = self.allowed(scope["path"])
                if allowed is not None:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"allow"]
                    message = {**message, "headers": [*headers, (b"allow", _join(allowed))]}
            await send(message)

        await self.app(scope, receive, send_with_allow)


def _join(methods: list[str]) -> bytes:
    return ", ".join(methods).encode("latin-1")


def _without_body(send: Send) -> Send:
    # HEAD: the GET's status and headers (Content-Length included, as RFC 9110 allows), no body.
    async def send_head(message: Message) -> None:
        if message["type"] == "http.response.body":
            message = {**message, "body": b""}
        await send(message)

    return send_head
