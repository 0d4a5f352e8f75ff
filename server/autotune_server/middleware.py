"""The request body cap: 413 in the one error shape, by Content-Length and by streamed size."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from autotune_server.errors import BodyTooLarge, error_response

__all__ = ["BodyLimitMiddleware"]


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
