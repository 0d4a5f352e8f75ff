"""Human text for trials and profiles (the CLI's progress lines and the datasheet). Torch-free."""

from __future__ import annotations

from autotune.schemas import Profile, Trial
from autotune.units import format_bytes

__all__ = ["datasheet", "trial_line"]


def trial_line(trial: Trial, limit_bytes: int | None = None) -> str:
    """One progress line: m, peak, verdict, time."""
    verdict = "OOM" if trial.oom else ("fits" if trial.fits else "over limit")
    if trial.fake:
        verdict = f"fake {verdict}"
    share = f" ({100 * trial.peak_bytes / limit_bytes:5.1f}% of limit)" if limit_bytes and not trial.oom else ""
    return (
        f"trial m={trial.micro_batch:<6d} peak {format_bytes(trial.peak_bytes):>11}{share}  "
        f"{verdict:<15} {trial.seconds:6.2f}s"
    )


def datasheet(profile: Profile) -> str:
    """The profile as a page of text: plan, memory, fit, trials, warnings."""
    dev = profile.device
    lines = [
        f"autotune datasheet: {profile.task}",
        f"  fingerprint      {profile.fingerprint[:16]}",
        f"  device           {dev.name} ({dev.kind}{'' if dev.index is None else f':{dev.index}'})",
        f"  precision        {profile.precision}",
        f"  budget           {format_bytes(profile.budget_bytes)} (headroom {profile.headroom:.0%}, "
        f"limit {format_bytes(profile.limit_bytes)})",
        f"  max micro-batch  {profile.max_micro_batch}"
        + (f" (multiple of {profile.multiple_of})" if profile.multiple_of > 1 else ""),
    ]
    plan = profile.plan
    chosen = plan.micro_batch if plan else profile.max_micro_batch
    if plan is not None:
        lines += [
            f"  plan             m={plan.micro_batch} x A={plan.accumulation_steps} x D={plan.world_size} "
            f"= {plan.effective_batch} (target {plan.target_batch}, {'exact' if plan.exact else 'NOT exact'})",
        ]
    peak = profile.peak_at(chosen)
    if peak is not None:
        lines.append(
            f"  peak at m={chosen:<6d} {format_bytes(peak)} ({100 * peak / profile.budget_bytes:.1f}% of budget)"
        )
    elif (predicted := profile.predicted_peak(chosen)) is not None:
        lines.append(f"  peak at m={chosen:<6d} ~{format_bytes(predicted)} (from the fit)")
    if profile.fit is not None:
        lines.append(
            f"  fit              {format_bytes(profile.fit.fixed_bytes)} + "
            f"{format_bytes(profile.fit.bytes_per_sample)} per sample (forward/backward)"
        )
    lines.append(f"  trials           {profile.trial_count} ({profile.oom_count} OOM) in {profile.seconds:.2f}s")
    lines.extend(f"  warning          {warning}" for warning in profile.warnings)
    return "\n".join(lines)
