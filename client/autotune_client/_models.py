"""What the server answers beyond ``autotune.core.schemas``: stored records with their ids.

These mirror ``autotune_server.wire`` (which a training environment does not install) but ignore
fields they do not know, so that a newer server does not break an older client.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from autotune.core.schemas import Profile

__all__ = ["ProfileSummary", "StoredProfile"]


class _Answer(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ProfileSummary(_Answer):
    """One row of ``GET /profiles``: the lookup columns, without the trials."""

    id: int
    fingerprint: str
    task: str
    device_name: str
    device_kind: str | None = None
    precision: str
    budget_bytes: int
    headroom: float
    max_micro_batch: int
    world_size: int = 1
    # A server from before strategies and estimates stored only ddp measurements.
    strategy: str = "ddp"
    source: str = "measured"
    # A sequence-aware setup's length (None for others, and from a server from before lengths).
    seq_len: int | None = None
    # The setup's mesh ('' for none, and from a server from before setups) and its host budget under offload.
    mesh: str = ""
    host_budget_bytes: int | None = None
    trial_count: int = 0
    created_at: datetime
    uploaded_at: datetime | None = None
    uploader: str | None = None
    content_hash: str | None = None


class StoredProfile(_Answer):
    """``GET /profiles/{id}``: the profile as uploaded, with the store's bookkeeping."""

    id: int
    profile: Profile
    content_hash: str | None = None
    uploaded_at: datetime | None = None
    uploader: str | None = None
    observation_count: int = 0
    # What the store says about a profile that contradicts its own trials (never used by /suggest).
    warnings: list[str] = []
