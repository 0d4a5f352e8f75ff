"""The service when its database goes away: 503 (507 for a full disk), never 500; quiet logs; /suggest
from memory; nothing half-written or stored twice.

Real failures only: a SQLite file locked by another connection past the busy timeout, opened
read-only, capped by ``max_page_count`` or on a full tmpfs; a PostgreSQL cluster of the test's own
(``_pg_cluster.ThrowawayPostgres``) stopped and started again, and a TCP proxy that cuts the
connection around a COMMIT. The long run under load is ``bench/db_outage.py``.
"""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2 as httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, event, text
from sqlalchemy.pool import NullPool

from autotune_client import InternalServerError, TunerClient
from autotune_server import Settings, create_app
from autotune_server.db import make_engine
from autotune_server.migrate import upgrade_head
from autotune_server.outage import STALE_HEADER
from tests.factories import FINGERPRINT, fingerprint_for, profile_payload
from tests.server._pg_cluster import ThrowawayPostgres, postgres_bin
from tests.server._tcp_proxy import TcpProxy
from tests.server.conftest import WRITE, WRITE_TOKEN

PROFILES = "/api/v1/profiles"
SUGGEST = "/api/v1/suggest"
OUTAGE_LOGGER = "autotune_server.outage"
DEVICE = "NVIDIA A100-SXM4-80GB"
BASE = "http://testserver"


def _app(url: str, **overrides: Any) -> TestClient:
    settings = Settings(
        database_url=url, api_tokens=(f"ci={WRITE_TOKEN}",), access_log=False, suggest_cache_seconds=0, **overrides
    )
    app = create_app(settings)
    app.state.outage.settle_seconds = 0  # the back-line the moment the database answers (see test_outage_log)
    return TestClient(app)


def _count(url: str, table: str) -> int:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())
    finally:
        engine.dispose()


def _outage_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == OUTAGE_LOGGER]


def _assert_no_traceback(caplog: pytest.LogCaptureFixture) -> None:
    assert [r.getMessage() for r in caplog.records if r.exc_info] == []


def _assert_unavailable(response: Any, kind: str) -> None:
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["code"] == "database_unavailable"
    assert error["details"]["kind"] == kind
    assert response.headers["retry-after"] == "2"


def _big_profile(seed: int) -> dict[str, Any]:
    # ~60 KB of tags: needs new database pages, whatever room the last page had.
    return profile_payload(seed=seed, tags={f"tag{i}": "x" * 1000 for i in range(60)})


# ---------------------------------------------------------------------------------------------------
# SQLite


@pytest.fixture
def sqlite_url(_sqlite_template: Path, tmp_path: Path) -> str:
    path = tmp_path / "autotune.db"
    shutil.copyfile(_sqlite_template, path)
    return f"sqlite:///{path}"


def test_sqlite_locked_past_the_busy_timeout_refuses_writes_with_503_and_reads_go_on(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    with _app(sqlite_url, sqlite_busy_timeout_seconds=0.2) as client:
        assert client.get(PROFILES).status_code == 200  # the pool's connection is open (WAL set)
        other = sqlite3.connect(sqlite_url.removeprefix("sqlite:///"), isolation_level=None)
        other.execute("BEGIN IMMEDIATE")  # another process's write transaction holds the lock
        try:
            for seed in (1, 2, 3):
                _assert_unavailable(client.post(PROFILES, json=profile_payload(seed=seed), headers=WRITE), "locked")
            assert client.get(PROFILES).status_code == 200  # WAL: readers are not blocked by a writer
        finally:
            other.execute("ROLLBACK")
            other.close()
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
    assert _count(sqlite_url, "profiles") == 1
    lines = _outage_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[0].startswith("database unavailable (locked: OperationalError: database is locked)")
    # A read does not end a write-side failure; the write that succeeded does.
    assert lines[1].startswith("database back after") and "3 requests refused" in lines[1]
    _assert_no_traceback(caplog)


def test_sqlite_read_only_file_refuses_writes_with_503_and_serves_reads(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = sqlite_url.removeprefix("sqlite:///")
    with _app(sqlite_url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
    # Opened read-only, as SQLite opens a file it may not write (a chmod is no obstacle to root).
    read_only = f"sqlite:///file:{path}?mode=ro&uri=true"
    with _app(read_only) as client:
        response = client.post(PROFILES, json=profile_payload(seed=2), headers=WRITE)
        _assert_unavailable(response, "read_only")
        assert "read-only" in response.json()["error"]["message"]
        assert client.delete(f"{PROFILES}/1", headers=WRITE).status_code == 503
        assert len(client.get(PROFILES).json()["items"]) == 1
    assert _count(sqlite_url, "profiles") == 1
    assert any(line.startswith("database unavailable (read_only") for line in _outage_lines(caplog))
    _assert_no_traceback(caplog)


def test_sqlite_full_database_is_507_and_nothing_is_half_written(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _app(sqlite_url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        trials_before = _count(sqlite_url, "trials")

        # The database may not grow past what it has: every new page is SQLITE_FULL, as on a full disk.
        engine: Any = client.app.state.engine  # type: ignore[attr-defined]

        @event.listens_for(engine, "connect")
        def _cap(dbapi_connection: Any, _record: Any) -> None:
            pages = dbapi_connection.execute("PRAGMA page_count").fetchone()[0]
            dbapi_connection.execute(f"PRAGMA max_page_count={pages}")

        engine.dispose()
        response = client.post(PROFILES, json=_big_profile(2), headers=WRITE)
        assert response.status_code == 507, response.text
        assert response.json()["error"]["code"] == "database_full"
        assert "retry-after" not in response.headers  # a full disk is not over in two seconds
        assert client.get(PROFILES).status_code == 200
    assert _count(sqlite_url, "profiles") == 1
    assert _count(sqlite_url, "trials") == trials_before
    assert any(line.startswith("database unavailable (full") for line in _outage_lines(caplog))
    _assert_no_traceback(caplog)


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    """A 2 MiB tmpfs (mounting needs root with CAP_SYS_ADMIN; skipped where that is not allowed)."""
    where = Path(tempfile.mkdtemp(prefix="autotune-tiny-disk-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(where)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(
            "cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN); the max_page_count test covers SQLITE_FULL"
        )
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
        where.rmdir()


def test_sqlite_on_a_full_disk_is_507(_sqlite_template: Path, tiny_disk: Path) -> None:
    path = tiny_disk / "autotune.db"
    shutil.copyfile(_sqlite_template, path)
    url = f"sqlite:///{path}"
    with _app(url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        # Fill the disk but for a few KiB: the next big profile cannot be written.
        free = shutil.disk_usage(tiny_disk).free
        (tiny_disk / "filler").write_bytes(b"\0" * max(0, free - 8192))
        statuses = [client.post(PROFILES, json=_big_profile(seed), headers=WRITE).status_code for seed in (2, 3)]
        assert statuses == [507, 507]
        (tiny_disk / "filler").unlink()
        assert client.post(PROFILES, json=_big_profile(2), headers=WRITE).status_code == 201
    assert _count(url, "profiles") == 2


def test_a_real_database_error_is_a_500_with_its_traceback_not_an_outage(
    sqlite_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    with _app(sqlite_url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        with sqlite3.connect(sqlite_url.removeprefix("sqlite:///")) as conn:
            conn.execute("DROP TABLE observations")  # a broken schema is a bug to see, not an outage
        response = client.get(f"{PROFILES}/1/observations")
    assert response.status_code == 500
    assert response.json()["error"]["code"] == "internal_error"
    assert _outage_lines(caplog) == []
    assert any(r.exc_info for r in caplog.records)


# ---------------------------------------------------------------------------------------------------
# PostgreSQL: a cluster of our own, stopped and started


@pytest.fixture(scope="module")
def cluster() -> Iterator[ThrowawayPostgres]:
    """A migrated throw-away cluster; skipped without PostgreSQL's server binaries (fails under CI=true)."""
    if postgres_bin() is None:
        reason = "PostgreSQL server binaries (initdb, pg_ctl) not found; set AUTOTUNE_PG_BIN"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run)", pytrace=False)
        pytest.skip(reason)
    with ThrowawayPostgres.create() as pg:
        upgrade_head(pg.url)
        yield pg


@pytest.fixture
def pg(cluster: ThrowawayPostgres) -> ThrowawayPostgres:
    """The cluster, running, with empty tables."""
    if not cluster.running():
        cluster.start()
    engine = create_engine(cluster.url, poolclass=NullPool)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE observations, trials, profiles RESTART IDENTITY CASCADE"))
    engine.dispose()
    return cluster


def _suggest(client: TestClient, fingerprint: str = FINGERPRINT, **params: Any) -> Any:
    query = {"fingerprint": fingerprint, "device_name": DEVICE, "target_batch": 48, **params}
    return client.get(SUGGEST, params=query)


def test_postgres_stopped_and_started(pg: ThrowawayPostgres, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with _app(pg.url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        answered = _suggest(client)
        assert answered.status_code == 200
        assert STALE_HEADER not in answered.headers
        # Other jobs go on uploading: that must not make the store forget what it answered.
        other = profile_payload(seed=3, fingerprint=fingerprint_for("another job"))
        assert client.post(PROFILES, json=other, headers=WRITE).status_code == 201

        pg.stop()
        _assert_unavailable(client.get(PROFILES), "unreachable")
        _assert_unavailable(client.get(f"{PROFILES}/1"), "unreachable")
        _assert_unavailable(client.post(PROFILES, json=profile_payload(seed=2), headers=WRITE), "unreachable")
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"] == "2"

        # A setup answered a moment ago is answered from memory, and says so.
        remembered = _suggest(client)
        assert remembered.status_code == 200
        assert remembered.headers[STALE_HEADER] == "database_unavailable"
        assert int(remembered.headers["age"]) >= 0
        body = remembered.json()
        assert body["micro_batch"] == answered.json()["micro_batch"]
        assert any("from memory" in w for w in body["warnings"])
        # The same setup at another target batch: the remembered lookup answers that too.
        other_target = _suggest(client, target_batch=96)
        assert other_target.status_code == 200 and STALE_HEADER in other_target.headers
        # A setup never asked about: nothing to remember, 503.
        _assert_unavailable(_suggest(client, fingerprint=fingerprint_for("never asked")), "unreachable")

        page = client.get("/", headers={"Accept": "text/html"})
        assert page.status_code == 503
        assert page.headers["content-type"].startswith("text/html")
        assert "Store unreachable" in page.text and page.headers["retry-after"] == "2"

        metrics = client.get("/metrics").text
        assert "autotune_database_up 0" in metrics
        outage_seconds = [line for line in metrics.splitlines() if line.startswith("autotune_database_outage_seconds")]
        assert len(outage_seconds) == 1 and float(outage_seconds[0].split()[1]) > 0

        lines = _outage_lines(caplog)
        assert len(lines) == 1, lines
        assert lines[0].startswith("database unavailable (unreachable: OperationalError:")

        pg.start()
        assert client.get("/readyz").status_code == 200
        assert client.post(PROFILES, json=profile_payload(seed=2), headers=WRITE).status_code == 201
        assert client.post(PROFILES, json=profile_payload(seed=2), headers=WRITE).status_code == 200
        fresh = _suggest(client)
        assert fresh.status_code == 200 and STALE_HEADER not in fresh.headers
        assert "autotune_database_outage_seconds 0" in client.get("/metrics").text
    assert _count(pg.url, "profiles") == 3
    lines = _outage_lines(caplog)
    assert len(lines) == 2, lines
    assert lines[1].startswith("database back after")
    assert "2 answered from memory" in lines[1]
    _assert_no_traceback(caplog)


def test_the_memory_of_answers_is_bounded_in_age(pg: ThrowawayPostgres) -> None:
    with _app(pg.url, suggest_stale_seconds=0) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        assert _suggest(client).status_code == 200
        pg.stop()
        _assert_unavailable(_suggest(client), "unreachable")
        pg.start()


def test_a_deleted_profile_never_answers_from_memory(pg: ThrowawayPostgres) -> None:
    with _app(pg.url) as client:
        assert client.post(PROFILES, json=profile_payload(seed=1), headers=WRITE).status_code == 201
        assert _suggest(client).status_code == 200
        assert client.delete(f"{PROFILES}/1", headers=WRITE).status_code == 204
        pg.stop()
        _assert_unavailable(_suggest(client), "unreachable")
        pg.start()


@pytest.mark.parametrize("cut", ["before_commit", "after_commit"])
def test_a_retried_upload_is_stored_once_whether_or_not_the_503_had_committed(pg: ThrowawayPostgres, cut: str) -> None:
    # The connection to PostgreSQL is cut at the COMMIT: before it reaches the server (nothing
    # stored) or after the server committed but before its answer came back (stored, and the
    # server cannot know). Either way the upload gets a 503, and the client's retry finds it.
    with TcpProxy("127.0.0.1", pg.port) as proxy:
        url = pg.url.replace(f":{pg.port}/", f":{proxy.port}/")
        with _app(url) as server:
            tuner = TunerClient(base_url=BASE, token=WRITE_TOKEN, http_client=_through(server))
            sleeps: list[float] = []
            stored_at_the_503: list[int] = []

            def sleep(seconds: float) -> None:
                sleeps.append(seconds)
                stored_at_the_503.append(_count(pg.url, "profiles"))

            tuner._sleep = sleep
            tuner._random = lambda: 0.0  # no jitter on top of Retry-After
            proxy.cut_at_commit(after=(cut == "after_commit"))
            profile_id = tuner.upload(_profile(seed=7))
            assert proxy.cuts == 1
            assert sleeps == [2.0]  # one 503, its Retry-After honoured, then the retry
            assert stored_at_the_503 == [1 if cut == "after_commit" else 0]
            again = server.post(PROFILES, json=profile_payload(seed=7), headers=WRITE)
            assert again.status_code == 200 and again.json()["id"] == profile_id
    assert _count(pg.url, "profiles") == 1
    assert _count(pg.url, "trials") == len(profile_payload(seed=7)["trials"])


def test_a_database_that_never_answers_is_a_503_after_the_connect_timeout(
    pg: ThrowawayPostgres, caplog: pytest.LogCaptureFixture
) -> None:
    with TcpProxy("127.0.0.1", pg.port) as proxy:
        proxy.silent = True
        url = pg.url.replace(f":{pg.port}/", f":{proxy.port}/") + "?connect_timeout=2"
        with _app(url) as client:
            # The kind "timeout" (and the log's ConnectionTimeout below) says the connect timeout
            # ended the wait; a request that hung instead would never come back to be asserted on.
            _assert_unavailable(client.get(PROFILES), "timeout")
            proxy.silent = False
            assert client.get(PROFILES).status_code == 200
    lines = _outage_lines(caplog)
    assert len(lines) == 2 and lines[0].startswith("database unavailable (timeout: ConnectionTimeout:")
    _assert_no_traceback(caplog)


def test_postgres_connections_carry_timeouts_and_keepalives_the_url_can_override(pg: ThrowawayPostgres) -> None:
    engine = make_engine(pg.url + "?connect_timeout=3&tcp_user_timeout=2000")
    try:
        with engine.connect() as conn:
            dsn = conn.connection.dbapi_connection.info.dsn  # type: ignore[union-attr]
    finally:
        engine.dispose()
    settings = dict(part.split("=", 1) for part in dsn.split())
    assert settings["connect_timeout"] == "3" and settings["tcp_user_timeout"] == "2000"
    assert settings["keepalives"] == "1" and settings["keepalives_idle"] == "30"


def test_the_client_gives_up_on_a_down_store_within_its_timeout(pg: ThrowawayPostgres) -> None:
    with _app(pg.url) as server:
        tuner = TunerClient(base_url=BASE, token=WRITE_TOKEN, http_client=_through(server), max_retries=2)
        sleeps: list[float] = []
        tuner._sleep = sleeps.append
        tuner._random = lambda: 0.0
        pg.stop()
        with pytest.raises(InternalServerError) as info:
            tuner.upload(_profile(seed=8))
        pg.start()
    assert info.value.status_code == 503 and info.value.code == "database_unavailable"
    assert sleeps == [2.0, 2.0]


def _through(server: TestClient) -> httpx.Client:
    # The real client over the real app: each request goes through the TestClient as it is.
    def handler(request: httpx.Request) -> httpx.Response:
        got = server.request(
            request.method,
            request.url.path,
            params=request.url.params,
            content=request.content,
            headers=request.headers,
        )
        return httpx.Response(got.status_code, headers=got.headers, content=got.content)

    return httpx.Client(transport=httpx.MockTransport(handler))


def _profile(seed: int) -> Any:
    from autotune.core.schemas import Profile

    return Profile.model_validate(profile_payload(seed=seed))
