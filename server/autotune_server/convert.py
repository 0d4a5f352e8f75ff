"""Rows to wire models. Kept apart from the queries so that ``repository.py`` stays about SQL."""

from __future__ import annotations

from typing import Any

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.core.schemas import Fit, Profile
from autotune_server.consistency import stored_warnings
from autotune_server.models import ObservationRow, ProfileRow
from autotune_server.repository import to_utc
from autotune_server.wire import ProfileSummary, StoredObservation, StoredProfile

__all__ = ["fit_of", "to_profile", "to_stored_observation", "to_stored_profile", "to_summary"]


def fit_of(row: ProfileRow) -> Fit | None:
    """The stored affine fit of a profile, if the probe produced one."""
    if row.fit_fixed_bytes is None or row.fit_bytes_per_sample is None:
        return None
    return Fit(fixed_bytes=row.fit_fixed_bytes, bytes_per_sample=row.fit_bytes_per_sample)


def to_profile(row: ProfileRow) -> Profile:
    """The Profile as it was uploaded (the stored document; trials in probe order)."""
    return Profile.model_validate(row.document)


def _mesh_label(document: dict[str, Any] | None) -> str:
    """The stored mesh as Mesh.label writes it ('' for none, or for a hand-written row whose mesh does not parse)."""
    try:
        return Mesh.from_dict((document or {}).get("mesh")).label()
    except (AutotuneError, TypeError):
        return ""


def to_summary(row: ProfileRow) -> ProfileSummary:
    """The list view of a profile."""
    return ProfileSummary(
        id=row.id,
        content_hash=row.content_hash,
        fingerprint=row.fingerprint,
        task=row.task,
        device_kind=row.device_kind,
        device_name=row.device_name,
        precision=row.precision,
        budget_bytes=row.budget_bytes,
        headroom=row.headroom,
        max_micro_batch=row.max_micro_batch,
        world_size=row.world_size,
        strategy=row.strategy,
        source=row.source,
        activation_checkpointing=row.activation_checkpointing,
        seq_len=row.seq_len,
        mesh=_mesh_label(row.document),
        host_budget_bytes=(row.document or {}).get("host_budget_bytes"),
        trial_count=row.trial_count,
        created_at=to_utc(row.created_at),
        uploaded_at=to_utc(row.uploaded_at),
        uploader=row.uploader,
    )


def to_stored_profile(row: ProfileRow, observation_count: int) -> StoredProfile:
    """The detail view of a profile."""
    return StoredProfile(
        id=row.id,
        content_hash=row.content_hash,
        uploaded_at=to_utc(row.uploaded_at),
        uploader=row.uploader,
        observation_count=observation_count,
        profile=to_profile(row),
        warnings=stored_warnings(row),
    )


def to_stored_observation(row: ObservationRow) -> StoredObservation:
    """An observation as stored."""
    return StoredObservation(
        id=row.id,
        profile_id=row.profile_id,
        micro_batch=row.micro_batch,
        peak_bytes=row.peak_bytes,
        oom=row.oom,
        world_size=row.world_size,
        note=row.note,
        created_at=to_utc(row.created_at),
        uploader=row.uploader,
    )
