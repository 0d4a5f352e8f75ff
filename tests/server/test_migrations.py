"""Alembic is the schema of record: an upgraded empty database matches the models exactly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.pool import NullPool

from autotune_server.migrate import head_revision, upgrade_head
from autotune_server.models import Base


def _diff(url: str) -> list[object]:
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={"compare_type": True})
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_upgrade_of_an_empty_database_matches_the_models(empty_database_url: str) -> None:
    assert _diff(empty_database_url) != []  # the comparison does see a difference when there is one
    upgrade_head(empty_database_url)
    assert _diff(empty_database_url) == []
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            assert conn.execute(text("SELECT version_num FROM alembic_version")).scalar() == head_revision()
            indexes = {ix["name"] for ix in inspect(conn).get_indexes("profiles")}
            uniques = {uq["name"] for uq in inspect(conn).get_unique_constraints("profiles")}
    finally:
        engine.dispose()
    assert {
        "ix_profiles_fingerprint_device_strategy_source_created",
        "ix_profiles_task",
        "ix_profiles_precision",
    } <= indexes
    assert "uq_profiles_content_hash" in uniques


def test_upgrade_twice_is_a_no_op(empty_database_url: str) -> None:
    upgrade_head(empty_database_url)
    upgrade_head(empty_database_url)
    assert _diff(empty_database_url) == []


def test_downgrade_to_base_and_back(empty_database_url: str) -> None:
    from alembic import command

    from autotune_server.migrate import alembic_config

    upgrade_head(empty_database_url)
    command.downgrade(alembic_config(empty_database_url), "base")
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            assert "profiles" not in inspect(conn).get_table_names()
    finally:
        engine.dispose()
    upgrade_head(empty_database_url)
    assert _diff(empty_database_url) == []


def test_migrations_are_found_from_any_working_directory(tmp_path: Path) -> None:
    # The service runs from wherever it is started (or from an installed wheel), not the repository root.
    db = tmp_path / "nested" / "dir" / "store.db"
    code = f"from autotune_server.migrate import upgrade_head; upgrade_head({f'sqlite:///{db}'!r})"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert db.exists()
    assert _diff(f"sqlite:///{db}") == []


def test_rows_stored_before_0002_become_ddp_measurements_with_real_trials(empty_database_url: str) -> None:
    from alembic import command

    from autotune_server.migrate import alembic_config

    config = alembic_config(empty_database_url)
    command.upgrade(config, "0001")
    # The columns of revision 0001, as a profile stored then filled them.
    profile = dict(
        id=1, content_hash="a" * 64, schema_version=1, fingerprint="0" * 64, task="t", device_kind="cuda",
        device_name="GPU", device="{}", devices="[]", precision="fp32", tags="{}", budget_bytes=2**33,
        headroom=0.1, max_micro_batch=8, micro_batch_cap=4096, multiple_of=1, world_size=4, trial_count=1,
        oom_count=0, seconds=1.0, warnings="[]", created_at="2026-01-01 00:00:00",
        uploaded_at="2026-01-01 00:00:00", document="{}",
    )
    trial = dict(id=1, profile_id=1, position=0, micro_batch=8, peak_bytes=100, fits=True, oom=False, seconds=0.5)
    engine = create_engine(empty_database_url, poolclass=NullPool)
    try:
        with engine.begin() as conn:
            for table, row in (("profiles", profile), ("trials", trial)):
                columns = ", ".join(row)
                values = ", ".join(f":{key}" for key in row)
                conn.execute(text(f"INSERT INTO {table} ({columns}) VALUES ({values})"), row)
        command.upgrade(config, "head")
        with engine.connect() as conn:
            got = conn.execute(text("SELECT strategy, source, non_monotone, world_size FROM profiles")).one()
            fake = conn.execute(text("SELECT fake FROM trials")).scalar()
    finally:
        engine.dispose()
    assert (got[0], got[1], bool(got[2]), got[3]) == ("ddp", "measured", False, 4)
    assert fake is not None and not fake
    assert _diff(empty_database_url) == []
