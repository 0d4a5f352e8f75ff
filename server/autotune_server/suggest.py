"""GET /suggest: the plan for a job from the newest matching profile, measured or predicted.

Measured: a profile of this fingerprint on this device model; m_max is what the probe measured
(lowered to the largest measured size within a smaller requested budget, and below the smallest
micro-batch at which a job reported an OOM). Predicted: only other device models have profiles and a
budget is given; m_max comes from the stored affine fit at budget x (1 - headroom) and the answer
says plainly that it is a prediction.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from autotune.plan import micro_batch_for_limit, plan
from autotune.schemas import Plan, Suggestion
from autotune_server import repository
from autotune_server.convert import fit_of
from autotune_server.errors import BudgetTooSmall, InvalidPlanRequest, NoProfileForSuggestion
from autotune_server.models import ProfileRow

__all__ = ["suggest"]


def _plan(m_max: int, target_batch: int, world_size: int) -> Plan:
    try:
        return plan(m_max, target_batch, world_size)
    except ValueError as exc:
        field = "target_batch" if "target_batch" in str(exc) else "world_size"
        # The first line only: a pydantic error's later lines echo internals, not advice.
        raise InvalidPlanRequest(str(exc).splitlines()[0], field=field) from None


def _measured(
    session: Session,
    row: ProfileRow,
    *,
    target_batch: int,
    world_size: int,
    budget_bytes: int | None,
    headroom: float | None,
) -> Suggestion:
    warnings: list[str] = []
    m_max = row.max_micro_batch
    used_budget = row.budget_bytes
    if budget_bytes is not None:
        used_budget = budget_bytes
        limit = budget_bytes * (1.0 - (headroom if headroom is not None else row.headroom))
        measured_limit = row.budget_bytes * (1.0 - row.headroom)
        if limit < measured_limit:
            within = [
                t.micro_batch
                for t in row.trials
                if t.fits and not t.oom and t.peak_bytes <= limit and t.micro_batch <= row.max_micro_batch
            ]
            if not within:
                raise BudgetTooSmall(
                    f"no measured micro-batch of profile {row.id} peaks within {int(limit)} bytes "
                    f"(budget_bytes {budget_bytes} less headroom); probe with this budget",
                    field="budget_bytes",
                )
            m_max = max(within)
            warnings.append(
                f"budget {budget_bytes} is below the {row.budget_bytes} bytes the profile was measured "
                f"with: micro-batch capped at {m_max}, the largest measured size within it"
            )
        elif limit > measured_limit:
            warnings.append(
                f"profile was measured with a budget of {row.budget_bytes} bytes; a larger budget may "
                "fit a larger micro-batch: probe again with the larger budget to use it"
            )
    oom_at = repository.smallest_oom_micro_batch(session, row.id)
    if oom_at is not None and oom_at <= m_max:
        if oom_at <= 1:
            raise BudgetTooSmall(
                f"a job reported an out-of-memory error at micro-batch {oom_at} with profile {row.id}",
                field="fingerprint",
            )
        m_max = oom_at - 1
        warnings.append(f"a job reported an out-of-memory error at micro-batch {oom_at}: capped at {m_max}")
    chosen = _plan(m_max, target_batch, world_size)
    if chosen.note:
        warnings.append(chosen.note)
    peak = next(
        (t.peak_bytes for t in row.trials if t.micro_batch == chosen.micro_batch and t.fits and not t.oom),
        None,
    )
    return Suggestion(
        micro_batch=chosen.micro_batch,
        accumulation_steps=chosen.accumulation_steps,
        world_size=chosen.world_size,
        effective_batch=chosen.effective_batch,
        target_batch=chosen.target_batch,
        exact=chosen.exact,
        source="measured",
        profile_id=row.id,
        fingerprint=row.fingerprint,
        device_name=row.device_name,
        max_micro_batch=m_max,
        peak_bytes=peak,
        budget_bytes=used_budget,
        warnings=warnings,
    )


def _predicted(
    row: ProfileRow,
    *,
    device_name: str,
    target_batch: int,
    world_size: int,
    budget_bytes: int,
    headroom: float | None,
) -> Suggestion:
    fit = fit_of(row)
    assert fit is not None  # the caller picks a row with a fit
    limit = budget_bytes * (1.0 - (headroom if headroom is not None else row.headroom))
    m_max = micro_batch_for_limit(fit, limit, row.micro_batch_cap)
    if row.multiple_of > 1:
        m_max -= m_max % row.multiple_of
    if m_max < 1:
        raise BudgetTooSmall(
            f"by the fit measured on {row.device_name} (profile {row.id}), not even one sample "
            f"fits within {int(limit)} bytes (budget_bytes {budget_bytes} less headroom)",
            field="budget_bytes",
        )
    chosen = _plan(m_max, target_batch, world_size)
    warnings = [
        f"predicted from the memory fit measured on {row.device_name} (profile {row.id}), not measured "
        f"on {device_name}: probe on {device_name} to be sure"
    ]
    if chosen.note:
        warnings.append(chosen.note)
    peak = max(0, round(fit.fixed_bytes + fit.bytes_per_sample * chosen.micro_batch))
    return Suggestion(
        micro_batch=chosen.micro_batch,
        accumulation_steps=chosen.accumulation_steps,
        world_size=chosen.world_size,
        effective_batch=chosen.effective_batch,
        target_batch=chosen.target_batch,
        exact=chosen.exact,
        source="predicted",
        profile_id=row.id,
        fingerprint=row.fingerprint,
        device_name=device_name,
        max_micro_batch=m_max,
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        warnings=warnings,
    )


def suggest(
    session: Session,
    *,
    fingerprint: str,
    device_name: str,
    target_batch: int,
    world_size: int = 1,
    budget_bytes: int | None = None,
    headroom: float | None = None,
    server_url: str = "URL",
) -> Suggestion:
    """The plan for a job.

    Args:
        fingerprint: the job setup's fingerprint (``autotune.fingerprint``).
        device_name: the device model the job runs on (e.g. "NVIDIA H100 80GB HBM3").
        target_batch: effective batch T; world_size: data-parallel replicas D.
        budget_bytes, headroom: the job's memory budget; needed for a prediction from another device.
        server_url: this server's URL, quoted in the how-to-probe advice of the 404.

    Raises:
        NoProfileForSuggestion: nothing to measure or predict from (404).
        InvalidPlanRequest: the plan arithmetic refused (e.g. target_batch < world_size) (422).
        BudgetTooSmall: not even one sample fits the given budget (422).
    """
    row = repository.newest_profile(session, fingerprint, device_name)
    if row is not None:
        return _measured(
            session,
            row,
            target_batch=target_batch,
            world_size=world_size,
            budget_bytes=budget_bytes,
            headroom=headroom,
        )
    elsewhere = repository.newest_profiles_elsewhere(session, fingerprint, device_name)
    with_fit = [r for r in elsewhere if fit_of(r) is not None]
    if budget_bytes is not None and with_fit:
        return _predicted(
            with_fit[0],
            device_name=device_name,
            target_batch=target_batch,
            world_size=world_size,
            budget_bytes=budget_bytes,
            headroom=headroom,
        )
    other_devices = sorted({r.device_name for r in elsewhere})
    if other_devices and budget_bytes is None:
        message = (
            f"no profile of fingerprint {fingerprint} on {device_name!r}; profiles exist on "
            f"{', '.join(repr(d) for d in other_devices)}: pass budget_bytes for a prediction from "
            f"their memory fit, or probe on {device_name!r}"
        )
    else:
        message = (
            f"no profile of fingerprint {fingerprint} on {device_name!r}"
            + (" and none elsewhere with a memory fit" if other_devices else "")
            + f": probe it on that device with `autotune probe TASK --server {server_url}`"
        )
    raise NoProfileForSuggestion(
        message,
        field="fingerprint",
        details={
            "looked_for": {
                "fingerprint": fingerprint,
                "device_name": device_name,
                "budget_bytes": budget_bytes,
            },
            "devices_with_profiles": other_devices,
            "how_to_probe": f"AUTOTUNE_TOKEN=... autotune probe TASK --server {server_url}",
        },
    )
