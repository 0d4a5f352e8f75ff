"""Profiles for tests of every package: valid by construction, unique on demand.

from tests.factories import make_profile, profile_payload
profile = make_profile(device_name="NVIDIA H100 80GB HBM3", max_micro_batch=24)
body = profile_payload(seed=3)            # JSON-ready dict, distinct content per seed
"""

from __future__ import annotations

import hashlib
from datetime import datetime, timedelta, timezone
from typing import Any

from autotune.schemas import Device, Fit, Plan, Profile, Trial

__all__ = [
    "DEFAULT_DEVICE",
    "FINGERPRINT",
    "fingerprint_for",
    "make_profile",
    "profile_payload",
]

FINGERPRINT = "0123456789abcdef" * 4
DEFAULT_DEVICE = "NVIDIA A100-SXM4-80GB"
BASE_TIME = datetime(2026, 1, 1, tzinfo=timezone.utc)


def fingerprint_for(name: str) -> str:
    """A valid fingerprint (64 hex digits) derived from a readable name."""
    return hashlib.sha256(name.encode()).hexdigest()


def make_profile(
    *,
    fingerprint: str = FINGERPRINT,
    device_name: str = DEFAULT_DEVICE,
    device_kind: str = "cuda",
    task: str = "examples/gpt.py:task",
    precision: str = "bf16",
    budget_bytes: int = 80 * 2**30,
    headroom: float = 0.10,
    max_micro_batch: int = 24,
    fixed_bytes: float = 10 * 2**30,
    bytes_per_sample: float = 2.5 * 2**30,
    with_fit: bool = True,
    seed: int = 0,
    created_at: datetime | None = None,
    tags: dict[str, str | int | float | bool] | None = None,
) -> Profile:
    """A profile as the probe would produce it: trials that follow the affine fit.

    ``seed`` changes the content (and so the content hash) without changing any lookup key, and
    moves ``created_at`` by seed seconds so that "newest" is well defined.
    """

    def peak(m: int) -> int:
        return int(fixed_bytes + bytes_per_sample * m) + seed

    sizes = sorted({1, 2, max(1, max_micro_batch // 2), max_micro_batch})
    trials = [Trial(micro_batch=m, peak_bytes=peak(m), fits=True, seconds=0.5) for m in sizes]
    trials.append(Trial(micro_batch=max_micro_batch + 1, peak_bytes=peak(max_micro_batch + 1), fits=False))
    return Profile(
        fingerprint=fingerprint,
        task=task,
        device=Device(kind=device_kind, name=device_name, index=0, total_bytes=budget_bytes),  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        tags=tags if tags is not None else {"suite": "tests"},
        budget_bytes=budget_bytes,
        headroom=headroom,
        max_micro_batch=max_micro_batch,
        plan=Plan(
            micro_batch=max_micro_batch,
            accumulation_steps=1,
            world_size=1,
            effective_batch=max_micro_batch,
            target_batch=max_micro_batch,
            exact=True,
            max_micro_batch=max_micro_batch,
        ),
        trials=trials,
        fit=Fit(fixed_bytes=fixed_bytes, bytes_per_sample=bytes_per_sample) if with_fit else None,
        trial_count=len(trials),
        oom_count=0,
        seconds=3.0,
        created_at=created_at if created_at is not None else BASE_TIME + timedelta(seconds=seed),
    )


def profile_payload(**kwargs: Any) -> dict[str, Any]:
    """``make_profile(**kwargs)`` as the JSON body a client sends."""
    return make_profile(**kwargs).model_dump(mode="json")
