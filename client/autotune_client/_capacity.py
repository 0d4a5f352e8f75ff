"""The capacity L -> m_max(L) of a setup, built from the profiles the store keeps (``TunerClient.capacity``).

The store keeps every profile of a run over lengths (``autotune probe --seq-len ...``), each with the
surface they share, and ``/suggest?seq_len=L`` answers any covered L from them; a length-aware sampler
needs the answer at every length before launch. This reads the newest run of the setup (measured
before estimated): its newest profile names the lengths the run measured (``surface.measured_lengths``),
the newest profile at each of them with the same surface completes it, and
:func:`autotune.core.capacity.capacity` turns them into the callable, as it does for local profiles.
Torch-free.

    with TunerClient() as tuner:
        cap = tuner.capacity(fingerprint=fp, device_name="NVIDIA H100 80GB HBM3")
    sampler = LengthBatchSampler(lengths, cap, target_tokens=65536)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.core.capacity import Capacity, CapacityError, capacity
from autotune.core.schemas import Profile
from autotune_client.errors import AutotuneClientError

if TYPE_CHECKING:
    from autotune_client._client import TunerClient

__all__ = ["stored_capacity"]

# Profiles read in all, at most: a run over lengths rarely measures more than a dozen.
MAX_PROFILES_READ = 64


def stored_capacity(
    client: TunerClient,
    *,
    fingerprint: str,
    device_name: str,
    strategy: str = "ddp",
    world_size: int = 1,
    activation_checkpointing: str = "none",
    source: str | None = None,
) -> Capacity:
    """What ``TunerClient.capacity`` returns (see the module docstring).

    Args:
        source: "measured" or "estimate"; None: the newest measured run, else the newest estimated one.

    Raises:
        AutotuneClientError: no profile over lengths of this setup on device_name, or stored profiles
            that do not make a capacity (the reason in one line).
    """
    filters: dict[str, Any] = {
        "fingerprint": fingerprint,
        "device_name": device_name,
        "strategy": strategy,
        "world_size": world_size,
        "activation_checkpointing": activation_checkpointing,
    }
    for kind in (source,) if source is not None else ("measured", "estimate"):
        found = [s for s in client.profiles(**filters, source=kind) if s.seq_len is not None]
        if found:
            return _newest_run(client, found)
    raise AutotuneClientError(
        f"no profile over sequence lengths of fingerprint {fingerprint} on {device_name!r}"
        + (f" ({strategy} at world size {world_size}, {activation_checkpointing})" if strategy != "ddp" else "")
        + ": probe it with `autotune probe TASK --seq-len L1,L2,...`"
    )


def _newest_run(client: TunerClient, summaries: list[Any]) -> Capacity:
    """The capacity of the run of the newest of summaries (newest first, each with a seq_len)."""
    newest = client.profile(summaries[0].id).profile
    run = [newest]
    wanted = set(newest.surface.measured_lengths if newest.surface is not None else []) - {newest.seq_len}
    for summary in summaries[1:MAX_PROFILES_READ]:
        if not wanted:
            break
        if summary.seq_len not in wanted or (summary.budget_bytes, summary.headroom) != (
            newest.budget_bytes,
            newest.headroom,
        ):
            continue
        profile: Profile = client.profile(summary.id).profile
        if profile.surface == newest.surface:
            run.append(profile)
            wanted.discard(profile.seq_len)
    try:
        return capacity(run)
    except CapacityError as exc:
        raise AutotuneClientError(f"the stored profiles give no capacity: {exc}") from None
