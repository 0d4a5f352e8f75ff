"""The caching allocator's gap: memory reserved but not allocated at m_max, and what to do about it.

On CUDA a trial's figure is ``max_memory_reserved`` (plus memory outside the allocator); the tensors
themselves peak at ``max_memory_allocated``. The difference is the allocator's: blocks rounded up,
segments split so that a free piece is too small for the next request. A job that runs for hours
fragments further, and the gap is where its peak drifts from the probe's. With
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` segments grow in place instead, and the gap
mostly closes. The probe records the gap at m_max and whether that setting was on
(``Profile.reserved_gap_bytes``, ``Profile.expandable_segments``); the datasheet says so when the gap
is large. Torch-free: the report and the server use it.

    >>> from autotune.core.schemas import Trial
    >>> t = Trial(micro_batch=26, peak_bytes=1200, fits=True, allocated_bytes=900, outside_allocator_bytes=100)
    >>> reserved_gap_at([t], 26)
    200
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from autotune.core.schemas import Profile, Trial
from autotune.core.units import format_bytes

__all__ = [
    "ALLOC_CONF_VARIABLES",
    "LARGE_GAP_MIN_BYTES",
    "LARGE_GAP_SHARE",
    "expandable_segments_on",
    "gap_advice",
    "reserved_gap_at",
]

# The allocator reads the first; newer torch also reads the second (without the CUDA in it).
ALLOC_CONF_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# A gap is large when it is at least this share of the peak at m_max, and at least this many bytes
# (a small model's few MiB of block rounding is not worth a setting).
LARGE_GAP_SHARE = 0.05
LARGE_GAP_MIN_BYTES = 64 << 20


def expandable_segments_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the allocator configuration in the environment turns expandable segments on.

    >>> expandable_segments_on({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:True"})
    True
    >>> expandable_segments_on({})
    False
    """
    env = os.environ if environ is None else environ
    for name in ALLOC_CONF_VARIABLES:
        for option in env.get(name, "").split(","):
            key, _, value = option.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() in ("true", "1")
    return False


def reserved_gap_at(trials: Sequence[Trial], micro_batch: int) -> int | None:
    """Reserved minus allocated at micro_batch, from its real trial that fitted (None without one
    that measured the allocator: the CPU, a fake trial)."""
    for trial in trials:
        if (
            trial.micro_batch == micro_batch
            and trial.fits
            and not trial.oom
            and not trial.fake
            and trial.allocated_bytes is not None
        ):
            reserved = trial.peak_bytes - (trial.outside_allocator_bytes or 0)
            return max(0, reserved - trial.allocated_bytes)
    return None


def gap_advice(profile: Profile) -> str | None:
    """The datasheet's line when the gap at m_max is large, else None."""
    gap = profile.reserved_gap_bytes
    peak = profile.peak_at(profile.max_micro_batch)
    if gap is None or not peak or gap < LARGE_GAP_MIN_BYTES or gap < LARGE_GAP_SHARE * peak:
        return None
    text = (
        f"the allocator held {format_bytes(gap)} reserved but not allocated at m={profile.max_micro_batch} "
        f"({100 * gap / peak:.1f}% of its peak): fragmentation"
    )
    if profile.expandable_segments:
        return text + ", with expandable_segments already on"
    return text + "; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True usually closes most of it (probe again with it)"
