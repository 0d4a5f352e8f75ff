"""Fixtures shared by every test folder: databases (a SQLite file and PostgreSQL), migrated or empty.

PostgreSQL comes from ``AUTOTUNE_TEST_POSTGRES_URL`` (default: postgres@127.0.0.1:5432/test). Each
test session works in schemas of its own (``at_<random>``, dropped at the end), selected through
the connection's search_path, so that several developers and CI jobs can share one database.
When PostgreSQL is unreachable its tests are skipped with the reason -- except under ``CI=true``,
where they fail: CI must not pass by skipping the database it is meant to test.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest

DEFAULT_POSTGRES_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
BACKENDS = ("sqlite", "postgresql")

# One intra-op thread in the suite and in every process it starts (servers, gloo and Lightning
# workers, Ray, the CLI): on a 2-core machine those run side by side, and two OpenMP threads per
# process spin against each other (a tiny GPT trial took 4.7 s with two threads under load, 0.22 s
# with one). Set before torch is imported; no memory figure depends on it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Inductor compiles in this process, not in a pool of compile workers it would start in each process that compiles
# (the test process, each gloo rank, each CLI run): on two busy cores the pool's start-up is spent for no
# parallelism (test_compile from cold caches: 144 -> 132 CPU seconds). No figure depends on where it compiles.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor's CPU kernels scalar, not vectorized: a cold compile is mostly g++ over the vectorized headers
# (test_compile's truth 25.5 -> 8.8 s, torchao's 4-bit step 21.2 -> 9.3 s). The probe and every truth compile alike,
# and the allocator's peak is the same byte for byte either way (the wrapper allocates the buffers; the instruction
# set only computes them): bench/inductor_scalar_kernels.py prints both.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # the server's own environment: no torch to tune
        return
    torch.set_num_threads(1)


# The suite runs on two workers, a test file at a time each (pytest-xdist, --dist loadfile: a module's
# fixtures are built once). Files start in collection order, so the longest ones go first: started last,
# one of them kept a worker busy for minutes after the other had finished (longest first evens the two).
# The files above 20 s of summed test time in the fresh clone's whole run of 2026-12-06 (after the pipeline's
# compiled and torchao truths; cold caches), longest first.
LONGEST_FIRST = (
    "tests/autotune/test_depth.py",
    "tests/autotune/test_compile.py",
    "tests/autotune/test_pipeline.py",
    "tests/autotune/test_pipeline_fsdp.py",
    "tests/autotune/test_surface.py",
    "tests/fleet/test_fleet.py",
    "tests/autotune/test_experts.py",
    "tests/autotune/test_levers.py",
    "tests/autotune/test_tensor_parallel.py",
    "tests/autotune/test_finetune.py",
    "tests/autotune/test_losses.py",
    "tests/autotune/test_emulation.py",
    "tests/e2e/test_recipes_doc.py",
    "tests/autotune/test_fake_lanes.py",
    "tests/fleet/test_estimates.py",
    "tests/autotune/test_card_pipeline.py",
    "tests/autotune/test_card_estimate.py",
    "tests/autotune/test_context_parallel.py",
    "tests/autotune/test_cp_pipeline.py",
    "tests/autotune/test_optimizer_ranks.py",
    "tests/e2e/test_setup_path.py",
    "tests/autotune/test_breakdown.py",
)


# The files whose truths start real process groups (gloo ranks, torchrun, Lightning's workers): marked
# ``processes``, with every test that asks for the CUDA child (``cuda_python``) marked ``card``, so that
# ``make test-fast`` (-m "not processes and not card and not slow") leaves them to ``make test``.
REAL_PROCESS_FILES = (
    "tests/autotune/test_context_parallel.py",
    "tests/autotune/test_cp_pipeline.py",
    "tests/autotune/test_ddp.py",
    "tests/autotune/test_ddp_buckets_meshes.py",
    "tests/autotune/test_experts.py",
    "tests/autotune/test_experts_four_ranks.py",
    "tests/autotune/test_fsdp.py",
    "tests/autotune/test_multi.py",
    "tests/autotune/test_optimizer_ranks.py",
    "tests/autotune/test_pipeline.py",
    "tests/autotune/test_pipeline_fsdp.py",
    "tests/autotune/test_policy_ranks.py",
    "tests/autotune/test_sampler.py",
    "tests/autotune/test_tensor_parallel.py",
    "tests/autotune/test_tp_moe.py",
    "tests/client/test_client_distributed.py",
    "tests/client/test_integration_lightning.py",
    "tests/e2e/test_launch_path.py",
)


# The tests over 2 s in a whole run (scripts/slow_tests.py writes the list from var/junit.xml): marked slow.
SLOW_TESTS = Path(__file__).with_name("slow_tests.txt")


def _slow_tests() -> frozenset[str]:
    if not SLOW_TESTS.exists():
        return frozenset()
    lines = (line.strip() for line in SLOW_TESTS.read_text().splitlines())
    return frozenset(line for line in lines if line and not line.startswith("#"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = Path(str(config.rootpath))
    slow = _slow_tests()
    for item in items:
        relative = Path(str(item.fspath)).relative_to(root).as_posix()
        if relative in REAL_PROCESS_FILES:
            item.add_marker(pytest.mark.processes)
        if f"{relative}::{item.name}" in slow:
            item.add_marker(pytest.mark.slow)
        if "cuda_python" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.card)

    def order(item: pytest.Item) -> int:
        relative = Path(str(item.fspath)).relative_to(root).as_posix()
        return rank.get(relative, len(rank))

    items.sort(key=order)  # stable: the rest keep their collection order


@pytest.fixture(autouse=True)
def frozen_heap() -> Iterator[None]:
    """Every test starts with the heap that is alive frozen, as a probe's span does (autotune/core/heap.py): a
    meter's collection after each trial walks only what the test made, not torch's, transformers' and pytest's
    objects, which took a quarter of a second per trial and a fifth of the fake-trial tests' time. The probe's
    own spans are inner ones inside it. The test's own garbage is collected as before; the heap is unfrozen after
    it."""
    try:
        from autotune.core.heap import FrozenHeap
    except ImportError:  # the server's own environment: no trials to speed up
        yield
        return
    with FrozenHeap():
        yield


@pytest.fixture(scope="session")
def cuda_python() -> str:
    """The Python with a CUDA build of torch that emulated-card estimates run in (``make .venv-cuda``, which
    ``make test`` builds). Without one, its tests skip saying so, except under CI=true, where the suite
    installs it and a skip would hide a failure."""
    from autotune.emulation import CudaTorchMissing, find_cuda_python, keep_children_warm

    try:
        python = find_cuda_python()
    except CudaTorchMissing as exc:
        if os.environ.get("CI") == "true":
            raise AssertionError(f"CI builds .venv-cuda (make test): {exc}") from None
        pytest.skip(str(exc))
    # Each child forked from one that has imported torch (3 s less a child; each still a fresh process).
    keep_children_warm()
    return python


def postgres_base_url() -> str:
    """The PostgreSQL URL the tests use (without a schema)."""
    return os.environ.get("AUTOTUNE_TEST_POSTGRES_URL", DEFAULT_POSTGRES_URL)


def _with_search_path(url: str, schema: str) -> str:
    separator = "&" if "?" in url else "?"
    return f"{url}{separator}options={quote(f'-csearch_path={schema}')}"


class PostgresSchemas:
    """Creates throw-away schemas in the test database and drops them at the end of the session."""

    def __init__(self, base_url: str) -> None:
        from sqlalchemy import create_engine

        self.base_url = base_url
        self.engine = create_engine(base_url, isolation_level="AUTOCOMMIT", pool_size=2)
        self.created: list[str] = []

    def new(self) -> str:
        """A new empty schema; returns the URL whose connections use it."""
        from sqlalchemy import text

        schema = f"at_{uuid.uuid4().hex[:16]}"
        with self.engine.connect() as conn:
            conn.execute(text(f'CREATE SCHEMA "{schema}"'))
        self.created.append(schema)
        return _with_search_path(self.base_url, schema)

    def drop(self, url: str) -> None:
        """Drop the schema behind a URL handed out by ``new``."""
        from sqlalchemy import text

        schema = url.rsplit("search_path%3D", 1)[-1]
        with self.engine.connect() as conn:
            conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        if schema in self.created:
            self.created.remove(schema)

    def close(self) -> None:
        """Drop every schema still there and release the connections."""
        from sqlalchemy import text

        with self.engine.connect() as conn:
            for schema in self.created:
                conn.execute(text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        self.engine.dispose()


@pytest.fixture(scope="session")
def postgres_schemas() -> Iterator[PostgresSchemas]:
    """Schemas in the test PostgreSQL; skips (fails under CI=true) when it is unreachable."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    url = postgres_base_url()
    try:
        schemas = PostgresSchemas(url)
        with schemas.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except OperationalError as exc:
        reason = f"PostgreSQL not reachable at {url}: {type(exc).__name__}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: PostgreSQL tests must run)", pytrace=False)
        pytest.skip(reason)
    yield schemas
    schemas.close()


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Migrating once and copying the file is ~100x faster than migrating for every test.
    from autotune_server.migrate import upgrade_head

    path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
    upgrade_head(f"sqlite:///{path}")
    return path


@pytest.fixture(scope="session")
def _postgres_migrated(postgres_schemas: PostgresSchemas) -> str:
    from autotune_server.migrate import upgrade_head

    url = postgres_schemas.new()
    upgrade_head(url)
    return url


def _truncate_postgres(url: str) -> None:
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(text("TRUNCATE observations, trials, profiles RESTART IDENTITY CASCADE"))
    finally:
        engine.dispose()


@pytest.fixture(params=BACKENDS)
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A migrated, empty database for this test: a fresh SQLite file, or PostgreSQL truncated."""
    if request.param == "sqlite":
        path = tmp_path / "autotune.db"
        shutil.copyfile(request.getfixturevalue("_sqlite_template"), path)
        return f"sqlite:///{path}"
    url: str = request.getfixturevalue("_postgres_migrated")
    _truncate_postgres(url)
    return url


@pytest.fixture(params=BACKENDS)
def empty_database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database (no tables at all): a new SQLite file, or a new PostgreSQL schema."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    schemas: PostgresSchemas = request.getfixturevalue("postgres_schemas")
    url = schemas.new()
    yield url
    schemas.drop(url)
