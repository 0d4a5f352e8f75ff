"""Service settings, read from the environment (prefix ``AUTOTUNE_``) or passed explicitly by tests.

AUTOTUNE_DATABASE_URL        sqlite:///./var/autotune.db (default) or postgresql+psycopg://...
AUTOTUNE_API_TOKENS          comma-separated write tokens; an entry may be ``name=token`` so the
                             store records who uploaded a profile without ever storing the token
AUTOTUNE_READ_TOKENS         comma-separated read-only tokens
AUTOTUNE_READ_TOKEN_REQUIRED reads need a (read or write) token too; default false
AUTOTUNE_MAX_BODY_BYTES      request body cap, 413 past it; default 8 MiB
AUTOTUNE_DB_POOL_SIZE, AUTOTUNE_DB_MAX_OVERFLOW  the connection pool (10 + 20)
AUTOTUNE_DB_SLOTS            requests using the database at once (default: pool + overflow, at most that)
AUTOTUNE_DB_QUEUE_LIMIT, AUTOTUNE_DB_QUEUE_SECONDS  requests waiting for a slot (2000) and how long
                             one waits (5 s) before it is answered 503 server_busy
AUTOTUNE_SUGGEST_STALE_SECONDS  during a database outage, /suggest answers setups it read within
                             this many seconds from memory (marked so); default 900, 0 turns it off
"""

from __future__ import annotations

import hashlib
from typing import Annotated

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

__all__ = ["DEFAULT_DATABASE_URL", "Settings"]

DEFAULT_DATABASE_URL = "sqlite:///./var/autotune.db"


def _split_tokens(value: object) -> object:
    # Environment values arrive as one string; NoDecode keeps pydantic-settings from parsing it as JSON.
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class Settings(BaseSettings):
    """Everything the app factory needs; tests build one per test instead of patching globals."""

    model_config = SettingsConfigDict(env_prefix="AUTOTUNE_", extra="ignore", frozen=True)

    database_url: str = DEFAULT_DATABASE_URL
    api_tokens: Annotated[tuple[str, ...], NoDecode] = ()
    read_tokens: Annotated[tuple[str, ...], NoDecode] = ()
    read_token_required: bool = False
    # A profile with 10,000 trials is about 2 MB of JSON; 8 MiB leaves room without inviting abuse.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # SQLite waits this long for another writer's lock before giving up (several processes may write).
    sqlite_busy_timeout_seconds: float = Field(default=30.0, ge=0)
    db_pool_size: int = Field(default=10, ge=1)
    db_max_overflow: int = Field(default=20, ge=0)
    # Requests that use the database at once, each in a thread of its own (autotune_server.gate);
    # None: the pool's size plus its overflow. Never more than that: a thread must never wait for a
    # connection, or a crowd could stall the pool as in issue 31.
    db_slots: int | None = Field(default=None, ge=1)
    # Requests that may wait for a slot, and for how long, before one is answered 503 server_busy.
    # Waiting costs a coroutine each; past these bounds the client's retry after Retry-After does
    # better than a wait that would run out its timeout (the client's default is 10 s in all).
    db_queue_limit: int = Field(default=2000, ge=0)
    db_queue_seconds: float = Field(default=5.0, gt=0)
    # /suggest caches its database lookup per (fingerprint, device) this long; a write in this
    # process clears it at once, other workers' writes show within this time. 0 turns it off.
    suggest_cache_seconds: float = Field(default=1.0, ge=0)
    # While the database is unavailable, /suggest answers a setup it read within this many seconds
    # from memory (saying so); older or unknown setups get 503. 0 turns it off.
    suggest_stale_seconds: float = Field(default=900.0, ge=0)
    # uvicorn's per-request log line; off for load tests, on by default for operators.
    access_log: bool = True

    _split_api = field_validator("api_tokens", "read_tokens", mode="before")(_split_tokens)

    @model_validator(mode="after")
    def _slots_within_the_pool(self) -> Settings:
        connections = self.db_pool_size + self.db_max_overflow
        if self.db_slots is not None and self.db_slots > connections:
            raise ValueError(
                f"db_slots ({self.db_slots}) must be at most db_pool_size + db_max_overflow ({connections}): "
                "a request holding a slot must never wait for a connection"
            )
        return self

    @property
    def database_slots(self) -> int:
        """Requests that use the database at once: ``db_slots``, else every connection of the pool."""
        return self.db_slots if self.db_slots is not None else self.db_pool_size + self.db_max_overflow

    def write_token_names(self) -> dict[str, str]:
        """Map each write token to the name recorded as the uploader (never the token itself)."""
        return _named(self.api_tokens)

    def read_token_names(self) -> dict[str, str]:
        """Tokens accepted for reads: the write tokens and the read-only ones."""
        return {**_named(self.read_tokens), **_named(self.api_tokens)}


def _named(entries: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, token = entry.partition("=")
        if sep and name and token:
            out[token] = name
        else:
            # An unnamed token is recorded by a short digest, enough to tell uploaders apart.
            out[entry] = "token-" + hashlib.sha256(entry.encode()).hexdigest()[:8]
    return out
