"""Every default of the client in one place, so that a reader (or a test) finds them at once."""

from __future__ import annotations

__all__ = [
    "API_PREFIX",
    "BUSY_ERROR_CODE",
    "BUSY_RETRY_JITTER_FRACTION",
    "DEFAULT_MAX_RETRIES",
    "DEFAULT_TIMEOUT_SECONDS",
    "ENV_TOKEN",
    "ENV_URL",
    "INITIAL_RETRY_DELAY_SECONDS",
    "MAX_RETRY_AFTER_SECONDS",
    "MAX_RETRY_DELAY_SECONDS",
    "NON_RETRYABLE_STATUS_CODES",
    "PAGE_SIZE",
    "RETRYABLE_STATUS_CODES",
    "RETRY_AFTER_JITTER_FRACTION",
    "RETRY_JITTER_FRACTION",
    "USER_AGENT",
]

ENV_URL = "AUTOTUNE_URL"
"""Environment variable holding the server's base URL (``http://host:port``)."""

ENV_TOKEN = "AUTOTUNE_TOKEN"
"""Environment variable holding the bearer token (needed for writes; reads are usually open)."""

API_PREFIX = "/api/v1"

DEFAULT_TIMEOUT_SECONDS = 10.0
"""Wall-clock limit of one client call, retries and back-off included.

A job asks the tuner once before launch; ten seconds is far more than a healthy server needs and
short enough that a dead one costs the job little before it falls back to a local probe.
"""

DEFAULT_MAX_RETRIES = 2
"""Retries after the first attempt (so three attempts at most)."""

INITIAL_RETRY_DELAY_SECONDS = 0.25
MAX_RETRY_DELAY_SECONDS = 4.0
RETRY_JITTER_FRACTION = 0.25
"""Each back-off is shortened by up to this fraction at random, so that the hundreds of jobs a sweep
starts at once do not retry in lock-step."""

MAX_RETRY_AFTER_SECONDS = 60.0
"""A server's Retry-After beyond this is not believed; the computed back-off is used instead."""

RETRY_AFTER_JITTER_FRACTION = 0.25
"""A Retry-After wait is lengthened by up to this fraction at random (never shortened: that is what
the server asked), so that a fleet refused together by a store that is down does not come back in
one burst the moment it returns."""

BUSY_ERROR_CODE = "server_busy"
"""The error code of a 503 from a saturated server (its database is fine; its queue is full).
Nothing was processed: it is retried after its Retry-After while the call's timeout allows, beyond
``max_retries`` (but never when ``max_retries`` is 0)."""

BUSY_RETRY_JITTER_FRACTION = 1.0
"""A busy server's Retry-After is lengthened by up to this fraction at random (up to twice the
wait): a crowd shed at once must not come back at once, or it is shed again."""

RETRYABLE_STATUS_CODES = frozenset({408, 429})
"""Statuses below 500 worth a retry (request timeout, rate limiting); every 5xx is retried too,
but for :data:`NON_RETRYABLE_STATUS_CODES`. 503 (the store's database is unavailable, or the server
is busy: nothing was processed) is retried whatever the method, after its Retry-After."""

NON_RETRYABLE_STATUS_CODES = frozenset({501, 505, 507})
"""5xx that a retry within seconds cannot change: not implemented, HTTP version, a full disk (507)."""

USER_AGENT = "autotune-client"

PAGE_SIZE = 200
"""Profiles asked for per page when listing (the server allows up to 500)."""
