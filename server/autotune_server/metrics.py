"""Prometheus metrics in the text exposition format, without a client library.

Counters and histograms are per process: with several workers, Prometheus scrapes each (or sums
what a load balancer spreads). Routes are labelled by their template ("/api/v1/profiles/{profile_id}"),
never by the raw path, so that label cardinality stays bounded whatever clients send.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["LATENCY_BUCKETS_SECONDS", "MetricsMiddleware", "Registry"]

LATENCY_BUCKETS_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Registry:
    """Request counts by (method, route, status) and latency histograms by (method, route)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str, str], int] = defaultdict(int)
        self._buckets: dict[tuple[str, str], list[int]] = {}
        self._sums: dict[tuple[str, str], float] = defaultdict(float)
        self._counts: dict[tuple[str, str], int] = defaultdict(int)

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        """Record one finished request."""
        key = (method, route)
        with self._lock:
            self._requests[(method, route, str(status))] += 1
            buckets = self._buckets.setdefault(key, [0] * len(LATENCY_BUCKETS_SECONDS))
            for i, bound in enumerate(LATENCY_BUCKETS_SECONDS):
                if seconds <= bound:
                    buckets[i] += 1
            self._sums[key] += seconds
            self._counts[key] += 1

    def render(self, gauges: dict[str, tuple[str, float]] | None = None) -> str:
        """The exposition text; ``gauges`` maps a metric name to (help, value) read at scrape time."""
        lines = [
            "# HELP autotune_http_requests_total HTTP requests served, by method, route and status.",
            "# TYPE autotune_http_requests_total counter",
        ]
        with self._lock:
            for (method, route, status), count in sorted(self._requests.items()):
                lines.append(
                    f'autotune_http_requests_total{{method="{_escape(method)}",route="{_escape(route)}",'
                    f'status="{status}"}} {count}'
                )
            lines += [
                "# HELP autotune_http_request_duration_seconds Time to serve a request, by method and route.",
                "# TYPE autotune_http_request_duration_seconds histogram",
            ]
            for (method, route), buckets in sorted(self._buckets.items()):
                labels = f'method="{_escape(method)}",route="{_escape(route)}"'
                for bound, count in zip(LATENCY_BUCKETS_SECONDS, buckets, strict=True):
                    lines.append(
                        f'autotune_http_request_duration_seconds_bucket{{{labels},le="{bound}"}} {count}'
                    )
                total = self._counts[(method, route)]
                lines.append(f'autotune_http_request_duration_seconds_bucket{{{labels},le="+Inf"}} {total}')
                lines.append(
                    f"autotune_http_request_duration_seconds_sum{{{labels}}} {self._sums[(method, route)]}"
                )
                lines.append(f"autotune_http_request_duration_seconds_count{{{labels}}} {total}")
        for name, (help_text, value) in sorted((gauges or {}).items()):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {value:g}"]
        return "\n".join(lines) + "\n"


def _route_template(app: ASGIApp, scope: Scope) -> str:
    # Starlette sets scope["route"] when a route matched; fall back to matching ourselves (404s, 405s).
    route = scope.get("route")
    path = getattr(route, "path", None)
    if isinstance(path, str):
        return path
    for candidate in getattr(app, "routes", []):
        match, _ = candidate.matches(scope)
        if match is Match.FULL:
            return str(getattr(candidate, "path", "unmatched"))
    return "unmatched"


class MetricsMiddleware:
    """Pure ASGI middleware timing every HTTP request into a Registry."""

    def __init__(self, app: ASGIApp, registry: Registry, routes_of: Callable[[], ASGIApp]) -> None:
        self.app = app
        self.registry = registry
        self._routes_of = routes_of

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_with_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            route = _route_template(self._routes_of(), scope)
            self.registry.observe(scope["method"], route, status, time.perf_counter() - start)
