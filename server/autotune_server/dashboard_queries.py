"""The dashboard's read queries: the filtered, sorted, paginated profile table and its filter choices.

Kept apart from ``repository.py`` (the API's queries) because these exist only for the HTML pages:
substring search, sorting by any column, offset pagination with a total. The table never loads a
profile's stored document or its trials, only columns and one aggregate per row.

    page = profile_table(session, TableQuery(text="gpt", precision="bf16", sort="m_max", page=2))
    page.rows[0].peak_share, page.total, page.pages
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Float, cast, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune_server.models import ProfileRow, TrialRow
from autotune_server.repository import deciding_trial, to_utc

__all__ = [
    "DEFAULT_PER_PAGE",
    "DEFAULT_SORT",
    "MAX_FILTER_CHARS",
    "MAX_PER_PAGE",
    "SORT_KEYS",
    "TablePage",
    "TableQuery",
    "TableRow",
    "device_names",
    "policy_siblings",
    "profile_table",
]

DEFAULT_PER_PAGE = 25
MAX_PER_PAGE = 100
DEFAULT_SORT = "age"
# Column keys the table can sort by; "plan" is left out because it lives in a JSON column.
SORT_KEYS = ("task", "fingerprint", "device", "precision", "seq_len", "m_max", "peak_share", "age")
# The longest filter text that is honoured: longer than any stored task, fingerprint or device name.
MAX_FILTER_CHARS = 256


@dataclass(frozen=True)
class TableQuery:
    """What the table shows, as read from the page's query parameters (already normalised).

    ``text`` matches task, fingerprint and device name as a case-insensitive substring; ``device``,
    ``precision``, ``strategy`` (ddp, fsdp), ``source`` (measured, estimate) and ``policy`` (none,
    every-K, full, op, op:OP/...) are exact; empty
    means "any". ``sort`` is one of :data:`SORT_KEYS`; ascending
    age means newest first, as a person reads an "age" column.
    """

    text: str = ""
    device: str = ""
    precision: str = ""
    strategy: str = ""
    source: str = ""
    # The memory policy (activation checkpointing: none, every-K, full, op, op:OP/...), canonical.
    policy: str = ""
    # A sequence-aware profile's length (None: any profile, with a length or without).
    seq_len: int | None = None
    sort: str = DEFAULT_SORT
    descending: bool = False
    page: int = 1
    per_page: int = DEFAULT_PER_PAGE

    @property
    def filtered(self) -> bool:
        """Whether any filter narrows the table."""
        if self.seq_len is not None:
            return True
        return bool(self.text or self.device or self.precision or self.strategy or self.source or self.policy)

    def with_page(self, page: int) -> TableQuery:
        """The same query on another page."""
        return replace(self, page=page)


@dataclass(frozen=True)
class TableRow:
    """One profile as the table shows it."""

    id: int
    task: str
    fingerprint: str
    device_kind: str
    device_name: str
    precision: str
    max_micro_batch: int
    plan: dict[str, Any] | None
    budget_bytes: int
    headroom: float
    # The largest peak among fitting deciding trials (real ones; an estimate's fake ones): the cost
    # of the largest m that fits.
    peak_bytes: int | None
    created_at: datetime
    strategy: str = "ddp"
    world_size: int = 1
    source: str = "measured"
    activation_checkpointing: str = "none"
    # A sequence-aware profile's length (None for other profiles).
    seq_len: int | None = None
    # The mesh (its stored document's, as Mesh.describe says it; '' for none): world_size counts every rank.
    mesh: str = ""

    @property
    def estimate(self) -> bool:
        """Whether the figures come from fake-tensor trials only."""
        return self.source == "estimate"

    @property
    def peak_share(self) -> float | None:
        """Peak of the largest fitting trial as a share of the budget (None without a fitting trial)."""
        if self.peak_bytes is None or self.budget_bytes <= 0:
            return None
        return self.peak_bytes / self.budget_bytes


@dataclass(frozen=True)
class TablePage:
    """A page of the table: its rows, the total that matched, and where it sits among the pages."""

    rows: list[TableRow]
    total: int
    query: TableQuery
    pages: int = field(default=1)

    @property
    def first_index(self) -> int:
        """1-based position of the first row on this page among all matches (0 when none match)."""
        return (self.query.page - 1) * self.query.per_page + 1 if self.rows else 0

    @property
    def last_index(self) -> int:
        """1-based position of the last row on this page among all matches."""
        return self.first_index + len(self.rows) - 1 if self.rows else 0


def _peak_column() -> ColumnElement[Any]:
    # Correlated per row; the unique (profile_id, position) index of trials makes it an index range scan.
    return (
        select(func.max(TrialRow.peak_bytes))
        .where(TrialRow.profile_id == ProfileRow.id, TrialRow.fits.is_(True), deciding_trial())
        .correlate(ProfileRow)
        .scalar_subquery()
    )


def _filters(query: TableQuery) -> list[ColumnElement[bool]]:
    clauses: list[ColumnElement[bool]] = []
    if query.text:
        # autoescape: a user's "%" or "_" is a character to find, not a LIKE wildcard.
        needle = query.text.lower()
        clauses.append(
            func.lower(ProfileRow.task).contains(needle, autoescape=True)
            | func.lower(ProfileRow.fingerprint).contains(needle, autoescape=True)
            | func.lower(ProfileRow.device_name).contains(needle, autoescape=True)
        )
    if query.device:
        clauses.append(ProfileRow.device_name == query.device)
    if query.precision:
        clauses.append(ProfileRow.precision == query.precision)
    if query.strategy:
        clauses.append(ProfileRow.strategy == query.strategy)
    if query.source:
        clauses.append(ProfileRow.source == query.source)
    if query.policy:
        clauses.append(ProfileRow.activation_checkpointing == query.policy)
    if query.seq_len is not None:
        clauses.append(ProfileRow.seq_len == query.seq_len)
    return clauses


def _order(query: TableQuery, peak: ColumnElement[Any]) -> list[ColumnElement[Any]]:
    share = cast(peak, Float) / cast(ProfileRow.budget_bytes, Float)
    columns: dict[str, ColumnElement[Any] | InstrumentedAttribute[Any]] = {
        "task": func.lower(ProfileRow.task),
        "fingerprint": ProfileRow.fingerprint,
        "device": func.lower(ProfileRow.device_name),
        "precision": ProfileRow.precision,
        "seq_len": ProfileRow.seq_len,
        "m_max": ProfileRow.max_micro_batch,
        "peak_share": share,
        "age": ProfileRow.created_at,
    }
    column = columns.get(query.sort, columns[DEFAULT_SORT])
    # Age grows as created_at shrinks: ascending age is newest first.
    descending = query.descending != (query.sort == "age")
    primary = column.desc() if descending else column.asc()
    # Rows without a fitting trial have no share; they go last either way. The id breaks ties so
    # that offset pagination never shows a row twice or skips one.
    return [primary.nulls_last(), ProfileRow.id.desc()]


def profile_table(session: Session, query: TableQuery) -> TablePage:
    """One page of the profile table.

    Args:
        session: a database session.
        query: filters, sort and page; a page past the last is read as the last page.

    Returns:
        The rows of the page with the total number of matching profiles.
    """
    clauses = _filters(query)
    total = int(session.scalar(select(func.count()).select_from(ProfileRow).where(*clauses)) or 0)
    pages = max(1, math.ceil(total / query.per_page))
    query = query.with_page(min(max(1, query.page), pages))
    peak = _peak_column()
    statement = (
        select(
            ProfileRow.id,
            ProfileRow.task,
            ProfileRow.fingerprint,
            ProfileRow.device_kind,
            ProfileRow.device_name,
            ProfileRow.precision,
            ProfileRow.max_micro_batch,
            ProfileRow.plan,
            ProfileRow.budget_bytes,
            ProfileRow.headroom,
            peak.label("peak_bytes"),
            ProfileRow.created_at,
            ProfileRow.strategy,
            ProfileRow.world_size,
            ProfileRow.source,
            ProfileRow.activation_checkpointing,
            ProfileRow.seq_len,
            ProfileRow.document["mesh"].label("mesh"),
        )
        .where(*clauses)
        .order_by(*_order(query, peak))
        .offset((query.page - 1) * query.per_page)
        .limit(query.per_page)
    )
    rows = [
        TableRow(
            id=int(r.id),
            task=r.task,
            fingerprint=r.fingerprint,
            device_kind=r.device_kind,
            device_name=r.device_name,
            precision=r.precision,
            max_micro_batch=int(r.max_micro_batch),
            plan=r.plan,
            budget_bytes=int(r.budget_bytes),
            headroom=float(r.headroom),
            peak_bytes=int(r.peak_bytes) if r.peak_bytes is not None else None,
            created_at=to_utc(r.created_at),
            strategy=r.strategy,
            world_size=int(r.world_size),
            source=r.source,
            activation_checkpointing=r.activation_checkpointing,
            seq_len=None if r.seq_len is None else int(r.seq_len),
            mesh=_mesh_text(r.mesh),
        )
        for r in session.execute(statement)
    ]
    return TablePage(rows=rows, total=total, query=query, pages=pages)


def _mesh_text(stored: Any) -> str:
    try:
        mesh = Mesh.from_dict(stored if isinstance(stored, dict) else None)
    except (AutotuneError, TypeError):
        return ""
    return "" if mesh.trivial else mesh.describe()


def policy_siblings(session: Session, row: ProfileRow) -> list[ProfileRow]:
    """The newest timed measurement of each other memory policy of the same setup (fingerprint,
    device model, strategy and world size), for the datasheet's throughput chart."""
    query = (
        select(ProfileRow)
        .where(
            ProfileRow.fingerprint == row.fingerprint,
            ProfileRow.device_name == row.device_name,
            ProfileRow.strategy == row.strategy,
            ProfileRow.world_size == row.world_size,
            ProfileRow.source == "measured",
            ProfileRow.activation_checkpointing != row.activation_checkpointing,
            ProfileRow.throughput.is_not(None),
        )
        .order_by(ProfileRow.created_at.desc(), ProfileRow.id.desc())
        .limit(64)
    )
    newest: dict[str, ProfileRow] = {}
    for sibling in session.scalars(query):
        newest.setdefault(sibling.activation_checkpointing, sibling)
    return [newest[policy] for policy in sorted(newest)]


def device_names(session: Session) -> list[str]:
    """Every device model that has a profile, for the device filter (sorted, distinct)."""
    return list(session.scalars(select(ProfileRow.device_name).distinct().order_by(ProfileRow.device_name)))
