"""Response bodies of the REST API that are not in ``autotune.core.schemas`` (which holds what clients send).

A stored profile is returned nested, ``{"id": ..., "profile": {...}}``, so that a client can parse
``profile`` with ``autotune.core.schemas.Profile`` as it is (that model forbids unknown fields).
"""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from autotune.core.schemas import Observation, Profile

__all__ = [
    "Health",
    "ObservationPage",
    "ProfilePage",
    "ProfileRef",
    "ProfileSummary",
    "Readiness",
    "StoredObservation",
    "StoredProfile",
    "content_hash",
]


class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ProfileRef(_Out):
    """What POST /profiles answers: where the profile lives and whether this request stored it."""

    id: int
    content_hash: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    created: bool
    url: str


class ProfileSummary(_Out):
    """One row of GET /profiles: the lookup columns, not the trials."""

    id: int
    content_hash: str
    fingerprint: str
    task: str
    device_kind: str
    device_name: str
    precision: str
    budget_bytes: int
    headroom: float
    max_micro_batch: int
    world_size: int
    strategy: str
    source: str
    activation_checkpointing: str = "none"
    # A sequence-aware setup's length (None for others).
    seq_len: int | None = None
    # The setup's mesh as Mesh.label writes it ('' for none; world_size counts every rank) and its host budget.
    mesh: str = ""
    host_budget_bytes: int | None = None
    trial_count: int
    created_at: datetime
    uploaded_at: datetime
    uploader: str | None = None


class ProfilePage(_Out):
    """A page of profiles, newest upload first; pass ``next_cursor`` back as ``cursor`` for the next."""

    items: list[ProfileSummary]
    next_cursor: str | None = None


class StoredObservation(Observation):
    """An observation as stored: the sent fields plus where and when it was recorded."""

    id: int
    profile_id: int
    created_at: datetime
    uploader: str | None = None
    # What the store made of it, in the POST's answer (e.g. left out of the drift, and why).
    warnings: list[str] = []


class ObservationPage(_Out):
    """The observations of one profile, oldest first."""

    items: list[StoredObservation]


class StoredProfile(_Out):
    """GET /profiles/{id}: the profile as uploaded, plus the store's bookkeeping."""

    id: int
    content_hash: str
    uploaded_at: datetime
    uploader: str | None = None
    observation_count: int
    profile: Profile
    # Set when the stored profile contradicts itself (stored before the checks, or under older rules):
    # it is served as it is, and never used by /suggest.
    warnings: list[str] = Field(default_factory=list)


class Health(_Out):
    """The process answers."""

    status: Literal["ok"] = "ok"


class Readiness(_Out):
    """The database answers and its schema is at the migration head."""

    status: Literal["ready"] = "ready"
    database: str
    revision: str | None = None


# Profile fields of the second wave, with the value every profile stored before them had.
_LATER_PROFILE_FIELDS: dict[str, object] = {
    "strategy": "ddp",
    "source": "measured",
    "non_monotone": False,
    "expandable_segments": None,
    "reserved_gap_bytes": None,
}


def content_hash(profile: Profile) -> str:
    """sha256 of the canonical JSON of a profile: equal bodies give equal hashes.

    ``created_at`` counts only when the client sent it: the model fills a missing one with the
    current time, which would make the same body hash differently on every upload.
    """
    exclude = None if "created_at" in profile.model_fields_set else {"created_at"}
    data = profile.model_dump(mode="json", exclude=exclude)
    # Fields added after profiles were first stored count only when they differ from the default:
    # a profile sent again by an older client hashes as it did, and stays one row.
    for key, default in _LATER_PROFILE_FIELDS.items():
        if data.get(key) == default:
            del data[key]
    for trial in data["trials"]:
        if trial.get("fake") is False:
            del trial["fake"]
    # The same for a plan's micro-batches when they are the one equal pair every older plan meant.
    plan = data.get("plan")
    if plan is not None and plan.get("micro_batches") == [[plan["micro_batch"], plan["accumulation_steps"]]]:
        del plan["micro_batches"]
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()
