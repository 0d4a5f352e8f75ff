"""GET /suggest: the plan for a job from the newest matching profile, measured, predicted or estimated.

Which profile answers a job of strategy S at world size N (``_rank``): for ddp, ddp profiles only
(an fsdp rank held 1/N of the model); for fsdp, an fsdp profile measured at N, else one at a smaller
N' (each of its ranks held a larger shard: conservative), else a ddp profile (every rank held the
whole model) -- only the first is ``measured``, the others are ``predicted`` with a warning saying
what was measured. Profiles on this device model before those on others (which need a budget), and
every answer resting on a measurement before any resting on an estimate (fake-tensor trials):
an estimate answers only when nothing measured can, as ``estimated``, with a warning.

Measured: a profile of this fingerprint on this device model, preferably one probed with the same
DDP-ness as the job (world size 1 vs > 1: with DDP the probe counted the gradient buckets); m_max is
what the probe measured (lowered to the largest measured size within a stricter requested budget or
headroom, and below the smallest micro-batch at which a job reported an OOM). Predicted: only other
device models have profiles and a budget is given (or no measured size is within a stricter limit);
m_max comes from the stored affine fit of the forward/backward peaks at budget x (1 - headroom),
bounded by the whole peak of the smallest measured micro-batch (the optimizer step's phase, which
the fit does not see), and the answer says plainly that it is a prediction. Every plan respects the
profile's ``multiple_of``.

An estimate of a CUDA card assumed a figure outside the caching allocator (the CUDA context, loaded
kernel modules); where measured profiles of that card hold one (``repository.device_context``), its
trials and m_max are re-derived with that figure before anything else (``measured_context``), and the
answer says so.

The work is split for speed, since /suggest is what hundreds of jobs call at the start of a sweep:
``candidates.lookup`` reads the database (a few small indexed queries, no ORM objects) and its result
is cached per (fingerprint, device) for a second (``autotune_server.suggest_cache``); ``compute`` is
pure arithmetic on that result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from sqlalchemy import Connection

from autotune.core.plan import (
    in_tokens,
    is_single_step,
    micro_batch_for_limit,
)
from autotune.core.schemas import Plan, Suggestion, SuggestQuery
from autotune.core.setup import JobSetup
from autotune.core.units import limit_bytes_unrounded
from autotune_server import drift, measured_context, policy, sequence, setups
from autotune_server.candidates import Candidate, Lookup
from autotune_server.errors import BudgetTooSmall, InvalidPlanRequest, NoProfileForSuggestion

__all__ = ["compute", "suggest"]

# What a suggestion rests on: a measurement of this kind of job, a prediction from another kind or
# device model, or an estimate (fake-tensor trials).
Label = Literal["measured", "predicted", "estimated"]


def _plan(
    c: Candidate,
    query: SuggestQuery,
    m_max: int,
    target_batch: int,
    *,
    single_step_max: int | None = None,
) -> Plan:
    """The plan every reader of a profile makes (``JobSetup.plan``: over the job's D under the profile's mesh, a
    pipeline's K within the bounds its stages were measured at, one step from the single step's m_max where it holds
    the target), its ValueError as the API's 422."""
    setup = JobSetup(
        strategy=query.strategy, world_size=query.world_size, mesh=c.setup.mesh, offload=c.setup.offload
    )
    try:
        return setup.plan(
            m_max, target_batch, multiple_of=c.multiple_of, policy=query.plan, single_step_max=single_step_max
        )
    except ValueError as exc:
        message = str(exc).splitlines()[0]  # a pydantic error's later lines echo internals, not advice
        # The query parameter at fault; otherwise the stored profile's figures (max_micro_batch below
        # multiple_of), which the fingerprint names.
        field = next((f for f in ("target_batch", "world_size") if message.startswith(f)), None)
        if field is None:
            field = "target_batch" if "target_batch" in message else "fingerprint"
        raise InvalidPlanRequest(message, field=field) from None


def _round_down(m: int, multiple_of: int) -> int:
    return m - m % multiple_of if multiple_of > 1 else m


def _ddp_warning(c: Candidate, job: JobSetup) -> str | None:
    """What a difference in DDP's buckets between the profile and the job means, if there is one."""
    replicas = job.data_parallel
    if job.holds_ddp_buckets and not c.uses_ddp:
        return (
            f"profile {c.id} was measured over {c.setup.data_parallel} data-parallel replica(s) (world size "
            f"{c.world_size}): DDP's gradient buckets (about the size of the gradients) were not counted; probe with "
            f"--world-size {job.world_size} for an exact figure"
        )
    if not job.holds_ddp_buckets and c.uses_ddp:
        return (
            f"profile {c.id} was measured with DDP over {c.setup.data_parallel} replica(s) (world size "
            f"{c.world_size}): its figures include DDP's gradient buckets, which a job of {replicas} replica does "
            "not allocate (conservative)"
        )
    return None


def _rank(c: Candidate, job: JobSetup) -> tuple[int, int] | None:
    """How well c answers a job of setup ``job``: lower is better, (0, _) is a measurement of this kind of
    job; None: never (its ranks held less than the job's will)."""
    ddp_ness = int(c.uses_ddp != job.holds_ddp_buckets)
    if job.strategy == "ddp":
        return (0, ddp_ness) if c.strategy == "ddp" else None
    if c.strategy == "fsdp":
        if c.world_size == job.world_size:
            return (0, 0)
        return (1, job.world_size - c.world_size) if c.world_size < job.world_size else None
    return (2, ddp_ness)


def _strategy_warning(c: Candidate, job: JobSetup) -> str | None:
    """What a strategy or world-size mismatch between the profile and the job means, if there is one."""
    strategy, world_size = job.strategy, job.world_size
    if strategy == "ddp":
        return _ddp_warning(c, job)
    if c.strategy == "fsdp" and c.world_size == world_size:
        return None
    how = f"probe with --strategy fsdp --world-size {world_size} for an exact figure"
    if c.strategy == "fsdp":
        return (
            f"the per-rank memory of profile {c.id} was measured with FSDP at world size {c.world_size}, "
            f"not {world_size}: predicted from it, not measured (at {world_size} each rank holds a smaller "
            f"shard of the parameters, gradients and optimizer state: conservative); {how}"
        )
    return (
        f"profile {c.id} was measured with DDP at world size {c.world_size} (every rank holds the whole "
        f"model, its gradients and optimizer state), not with FSDP at world size {world_size}: predicted "
        f"from it, not measured (usually conservative: FSDP shards those over the ranks); {how}"
    )


def _estimate_warning(c: Candidate, device_name: str) -> str:
    return (
        f"estimated, not measured: profile {c.id} rests on fake-tensor trials (shapes and dtypes, no "
        f"memory spent), not on a measurement on the device; probe on {device_name} for a measured figure"
    )


def _with_measured_context(c: Candidate, warnings: list[str]) -> Candidate:
    """c re-derived with what measured profiles of its card hold outside the allocator, where c is an
    estimate of a CUDA card that assumed a figure there (``autotune_server.measured_context``); the note
    that says so joins ``warnings``. Everything after (a stricter budget, drift, the plan) works on it
    as on any profile.

    Raises:
        BudgetTooSmall: with the measured figure, not even the smallest tested size fits.
    """
    rederived, note = measured_context.for_candidate(c)
    if note is None:
        return c
    if rederived.max_micro_batch < 1:
        raise BudgetTooSmall(
            f"profile {c.id}: {note}; probe on {c.device_name} for a measured figure", field="fingerprint"
        )
    warnings.append(note)
    return rederived


def _limit_text(budget_bytes: int, headroom: float) -> str:
    return f"budget {budget_bytes} bytes less headroom {headroom:g}"


def _predicted_max(c: Candidate, limit: float, *, limit_text: str, field: str) -> int:
    """m_max within ``limit`` by c's fit and its smallest measured whole peak.

    The fit is of the forward/backward peaks; while the optimizer step dominates, the whole peak
    is flat at about peak(m=1), so the smallest measured micro-batch's whole peak must fit too.

    Raises:
        BudgetTooSmall: not even one (multiple_of) micro-batch fits.
    """
    fit = c.fit
    assert fit is not None  # the caller picks a candidate with a fit
    if c.smallest_peak is not None and c.smallest_peak > limit:
        raise BudgetTooSmall(
            f"the weights and optimizer state alone take about {c.smallest_peak} bytes (the whole "
            f"peak of the smallest micro-batch measured on {c.device_name}, profile {c.id}), more "
            f"than the {int(limit)} bytes within the {limit_text}",
            field=field,
        )
    m_max = _round_down(micro_batch_for_limit(fit, limit, c.micro_batch_cap), c.multiple_of)
    if m_max < 1:
        what = "one sample" if c.multiple_of <= 1 else f"one micro-batch of {c.multiple_of}"
        raise BudgetTooSmall(
            f"by the fit measured on {c.device_name} (profile {c.id}), not even {what} "
            f"fits within {int(limit)} bytes ({limit_text})",
            field=field,
        )
    return m_max


def _suggestion(
    c: Candidate,
    chosen: Plan,
    *,
    source: Label,
    device_name: str,
    m_max: int,
    peak: int | None,
    budget_bytes: int,
    warnings: list[str],
    strategy: str = "ddp",
) -> Suggestion:
    if chosen.note:
        warnings.append(chosen.note)
    setup = c.setup
    if setup.compile is not None and not setup.compiled_measured:
        warnings.append(
            f"profile {c.id} is an estimate of a job compiled with mode {setup.compile}: its fake trials ran the "
            "eager step (a compiled step usually holds less, but not always); probe the compiled job for its own figure"
        )
    single = is_single_step(chosen, m_max)
    return Suggestion.from_plan(
        chosen,
        mesh=setup.mesh.label(),
        host_budget_bytes=setup.host_budget_bytes,
        source=source,
        strategy=strategy,
        profile_id=c.id,
        fingerprint=c.fingerprint,
        device_name=device_name,
        max_micro_batch=m_max,
        multiple_of=c.multiple_of,
        peak_bytes=peak,
        budget_bytes=budget_bytes,
        warnings=warnings,
        single_step=single,
    )


def _single_step_within(c: Candidate, limit: float) -> int | None:
    """The single step's m_max within a limit stricter than the one c was measured within: the largest size
    its own single-step trials measured within it (None: none, or c has no single-step figure)."""
    if c.single_step_max is None:
        return None
    within = [
        m
        for m, peak, fits, oom in c.single_step_trials
        if fits and not oom and peak <= limit and m <= c.single_step_max
    ]
    found = _round_down(max(within, default=0), c.multiple_of)
    return found if found >= 1 else None


def _predicted_peak(c: Candidate, micro_batch: int) -> int:
    fit = c.fit
    assert fit is not None
    by_fit = max(0, round(fit.fixed_bytes + fit.bytes_per_sample * micro_batch))
    return max(by_fit, c.smallest_peak or 0)


def _measured(
    c: Candidate,
    query: SuggestQuery,
    target_batch: int,
    *,
    label: Label = "measured",
    warnings: list[str] | None = None,
) -> Suggestion:
    """The answer from c's own trials (``label`` says what they are to this job: see ``compute``)."""
    warnings = list(warnings or [])
    mismatch = _strategy_warning(c, JobSetup.of_query(query))
    if mismatch is not None:
        warnings.append(mismatch)
    m_max = c.max_micro_batch
    # A = 1 (Profile.single_step): held to the same limit, drift and OOM reports as m_max below.
    single_max = c.single_step_max
    used_budget = query.budget_bytes if query.budget_bytes is not None else c.budget_bytes
    if query.budget_bytes is not None or query.headroom is not None:
        used_headroom = query.headroom if query.headroom is not None else c.headroom
        field = "budget_bytes" if query.budget_bytes is not None else "headroom"
        limit = limit_bytes_unrounded(used_budget, used_headroom)
        measured_limit = limit_bytes_unrounded(c.budget_bytes, c.headroom)
        limit_text = _limit_text(used_budget, used_headroom)
        if limit < measured_limit:
            within = [
                m for m, peak, fits, oom in c.trials if fits and not oom and peak <= limit and m <= c.max_micro_batch
            ]
            m_max = _round_down(max(within, default=0), c.multiple_of)
            single_max = _single_step_within(c, limit)
            if m_max < 1:
                # Nothing measured is within the stricter limit: predict from this profile's fit.
                return _fallback_prediction(
                    c,
                    limit,
                    limit_text=limit_text,
                    field=field,
                    query=query,
                    target_batch=target_batch,
                    budget_bytes=used_budget,
                    warnings=warnings,
                )
            warnings.append(
                f"the limit of {int(limit)} bytes ({limit_text}) is below the {int(measured_limit)} "
                f"bytes profile {c.id} was measured within: micro-batch capped at {m_max}, the largest "
                "measured size within it"
            )
        elif limit > measured_limit:
            warnings.append(
                f"profile {c.id} was measured within {int(measured_limit)} bytes "
                f"({_limit_text(c.budget_bytes, c.headroom)}); the larger limit of {int(limit)} bytes "
                f"({limit_text}) may fit a larger micro-batch than the measured {m_max}: probe again "
                "with it to use it"
            )
    job_headroom = query.headroom if query.headroom is not None else c.headroom
    drifted = drift.within_drift(c, m_max, limit_bytes_unrounded(used_budget, job_headroom), warnings)
    if drifted < m_max:  # the jobs peak above the trials: a one-step plan would rest on the same trials, larger
        single_max = None
    m_max = drifted
    if c.oom_at is not None and single_max is not None and c.oom_at <= single_max:
        single_max = _round_down(c.oom_at - 1, c.multiple_of)
    if c.oom_at is not None and c.oom_at <= m_max:
        capped = _round_down(c.oom_at - 1, c.multiple_of)
        if capped < 1:
            raise BudgetTooSmall(
                f"a job reported an out-of-memory error at micro-batch {c.oom_at} with profile {c.id}",
                field="fingerprint",
            )
        m_max = capped
        warnings.append(f"a job reported an out-of-memory error at micro-batch {c.oom_at}: capped at {m_max}")
    chosen = _plan(c, query, m_max, target_batch, single_step_max=single_max)
    trials = c.single_step_trials if is_single_step(chosen, m_max) else c.trials
    peak = next((p for m, p, fits, oom in trials if m == chosen.micro_batch and fits and not oom), None)
    return _suggestion(
        c,
        chosen,
        source=label,
        device_name=c.device_name,
        m_max=m_max,
        peak=peak,
        budget_bytes=used_budget,
        warnings=warnings,
        strategy=query.strategy,
    )


def _from_surface(
    c: Candidate,
    query: SuggestQuery,
    target_batch: int,
    seq_len: int,
    *,
    lengths: list[int],
    label: Label,
    warnings: list[str],
) -> Suggestion:
    """The answer at a length nobody measured, from the peak surface of c's probe (which covers it)."""
    warnings = list(warnings)
    mismatch = _strategy_warning(c, JobSetup.of_query(query))
    if mismatch is not None:
        warnings.append(mismatch)
    used_budget = query.budget_bytes if query.budget_bytes is not None else c.budget_bytes
    used_headroom = query.headroom if query.headroom is not None else c.headroom
    limit = limit_bytes_unrounded(used_budget, used_headroom)
    m_max = sequence.surface_max(c, seq_len, limit)
    if m_max < 1:
        raise BudgetTooSmall(
            f"by the memory surface of profile {c.id}, not even micro-batch {c.multiple_of} at seq_len {seq_len} "
            f"fits within {int(limit)} bytes ({_limit_text(used_budget, used_headroom)}): it predicts "
            f"{sequence.surface_peak(c, c.multiple_of, seq_len)} bytes",
            field="seq_len",
        )
    warnings.append(
        f"predicted from the memory surface of profile {c.id}: seq_len {seq_len} was not measured (measured: "
        f"{', '.join(map(str, lengths))}); probe with --seq-len {seq_len} for a measured figure"
    )
    chosen = _plan(c, query, m_max, target_batch)
    return _suggestion(
        c,
        chosen,
        source=label,
        device_name=c.device_name,
        m_max=m_max,
        peak=sequence.surface_peak(c, chosen.micro_batch, seq_len),
        budget_bytes=used_budget,
        warnings=warnings,
        strategy=query.strategy,
    )


def _fallback_prediction(
    c: Candidate,
    limit: float,
    *,
    limit_text: str,
    field: str,
    query: SuggestQuery,
    target_batch: int,
    budget_bytes: int,
    warnings: list[str],
) -> Suggestion:
    """No measured size of c is within a stricter limit: c's own fit, marked as a prediction (an
    estimate stays one)."""
    if c.fit is None:
        raise BudgetTooSmall(
            f"no measured micro-batch of profile {c.id} peaks within {int(limit)} bytes "
            f"({limit_text}), and it has no memory fit to predict from; probe with this budget",
            field=field,
        )
    m_max = _predicted_max(c, limit, limit_text=limit_text, field=field)
    # The fit is of the forward/backward peaks: never predict at or past a size this profile
    # measured over the limit (or saw run out of memory).
    over = [m for m, peak, _, oom in c.trials if oom or peak > limit]
    if over and min(over) <= m_max:
        m_max = _round_down(min(over) - 1, c.multiple_of)
        if m_max < 1:
            raise BudgetTooSmall(
                f"micro-batch {min(over)} of profile {c.id} already peaks over {int(limit)} bytes "
                f"({limit_text}); probe with this budget",
                field=field,
            )
    if c.oom_at is not None and c.oom_at <= m_max:
        m_max = _round_down(c.oom_at - 1, c.multiple_of)
        if m_max < 1:
            raise BudgetTooSmall(
                f"a job reported an out-of-memory error at micro-batch {c.oom_at} with profile {c.id}",
                field="fingerprint",
            )
    chosen = _plan(c, query, m_max, target_batch)
    warnings.append(
        f"no measured micro-batch of profile {c.id} peaks within {int(limit)} bytes ({limit_text}): "
        f"predicted from its memory fit, not measured; probe with this budget to be sure"
    )
    return _suggestion(
        c,
        chosen,
        source="estimated" if c.estimate else "predicted",
        device_name=c.device_name,
        m_max=m_max,
        peak=_predicted_peak(c, chosen.micro_batch),
        budget_bytes=budget_bytes,
        warnings=warnings,
        strategy=query.strategy,
    )


def _predicted(
    c: Candidate, query: SuggestQuery, target_batch: int, budget_bytes: int, *, warnings: list[str] | None = None
) -> Suggestion:
    used_headroom = query.headroom if query.headroom is not None else c.headroom
    limit = limit_bytes_unrounded(budget_bytes, used_headroom)
    m_max = _predicted_max(c, limit, limit_text=_limit_text(budget_bytes, used_headroom), field="budget_bytes")
    chosen = _plan(c, query, m_max, target_batch)
    what = "estimated" if c.estimate else "measured"
    warnings = [
        *(warnings or []),
        f"predicted from the memory fit {what} on {c.device_name} (profile {c.id}), not measured "
        f"on {query.device_name}: probe on {query.device_name} to be sure",
    ]
    mismatch = _strategy_warning(c, JobSetup.of_query(query))
    if mismatch is not None:
        warnings.append(mismatch)
    return _suggestion(
        c,
        chosen,
        source="estimated" if c.estimate else "predicted",
        device_name=query.device_name,
        m_max=m_max,
        peak=_predicted_peak(c, chosen.micro_batch),
        budget_bytes=budget_bytes,
        warnings=warnings,
        strategy=query.strategy,
    )


def _best(candidates: tuple[Candidate, ...], job: JobSetup) -> tuple[tuple[int, int], Candidate] | None:
    """The candidate that answers the job best by ``_rank``, the newest among equals (candidates
    come newest first)."""
    ranked = [(rank, i, c) for i, c in enumerate(candidates) if (rank := _rank(c, job)) is not None]
    if not ranked:
        return None
    rank, _, best = min(ranked, key=lambda item: (item[0], item[1]))
    return rank, best


def compute(found: Lookup, query: SuggestQuery, *, server_url: str | Callable[[], str] = "URL") -> Suggestion:
    """The plan for the job ``query`` asks about, from what ``lookup`` found (pure).

    Args:
        found: the lookup for (query.fingerprint, query.device_name).
        query: the job (``autotune.core.schemas.SuggestQuery``, whose fields say what each means):
            target_batch T (or target_tokens with seq_len); world_size D (for fsdp, the N ranks the
            model is sharded over); budget_bytes and headroom, needed for a prediction from another
            device (a headroom without a budget applies to the measured profile's own budget);
            strategy (see the module docstring for which profiles answer which job); plan
            (``autotune.core.plan.plan``'s policy); activation_checkpointing, the job's memory policy
            (with objective "memory" only profiles measured under it answer); objective "throughput"
            (the stored policy whose plan is timed fastest answers, and the Suggestion says which
            policy it needs: autotune_server.policy); seq_len (a sequence-aware setup answers from its
            profile at that length, else from the memory surface that covers it:
            autotune_server.sequence).
        server_url: this server's URL (or a function giving it, only called for the 404), quoted in
            the how-to-probe advice of the 404.

    Profiles the lookup passed over (``found.skipped``: they contradict their own trials) never
    answer; the suggestion says they were passed over.

    The order of preference: measurements before estimates; within each, a profile of the job's
    kind (``_rank``) before one of another kind, and at equal kind one on this device model before
    one on another (which needs ``budget_bytes``), the newest first.

    Raises:
        NoProfileForSuggestion: nothing to measure or predict from (404).
        InvalidPlanRequest: the plan arithmetic refused (target_batch < world_size, or a target
            that would need more accumulation steps than ``autotune.core.plan`` allows) (422).
        BudgetTooSmall: not even one sample (or multiple_of) fits the given budget (422).
    """
    target_batch, token_note = sequence.target_batch_for(
        query.target_batch, query.target_tokens, query.seq_len, query.data_parallel
    )
    found = setups.for_setup(found, query)
    if query.objective == "throughput":
        # Each stored policy's memory answer for the target in sequences, then the fastest of them.
        in_sequences = query.model_copy(update={"target_batch": target_batch, "target_tokens": None})
        answer = policy.fastest(
            found,
            lambda one, name: compute(
                one,
                in_sequences.model_copy(update={"objective": "memory", "activation_checkpointing": name}),
                server_url=server_url,
            ),
            device_name=query.device_name,
            world_size=query.data_parallel,
        )
        return in_tokens(answer, query.seq_len, query.target_tokens, token_note)
    missing = policy.policy_not_found(found, query.activation_checkpointing, query.fingerprint, query.device_name)
    if missing is not None:
        raise missing
    found = policy.for_policy(found, query.activation_checkpointing)
    answer = _compute(found, query, target_batch, server_url)
    answer.activation_checkpointing = query.activation_checkpointing
    return in_tokens(answer, query.seq_len, query.target_tokens, token_note)


def _compute(found: Lookup, query: SuggestQuery, target_batch: int, server_url: str | Callable[[], str]) -> Suggestion:
    """``compute`` for the profiles of one memory policy."""
    at = sequence.at_length(found, query.seq_len, fingerprint=query.fingerprint)
    if query.seq_len is not None and at is not found and not at.here and not at.elsewhere:
        # Nothing measured at this length: the newest surface of this device model that covers it.
        for source in ("measured", "estimate"):
            covering = tuple(c for c in sequence.covering(found, query.seq_len) if c.source == source)
            best = _best(covering, JobSetup.of_query(query))
            if best is not None:
                c = best[1]
                answer = _from_surface(
                    c,
                    query,
                    target_batch,
                    query.seq_len,
                    lengths=sequence.measured_lengths(found),
                    label="estimated" if c.estimate else "predicted",
                    warnings=[_estimate_warning(c, query.device_name)] if c.estimate else [],
                )
                return _with_skipped(found, answer)
        raise sequence.not_measured(found, query.seq_len, fingerprint=query.fingerprint, device_name=query.device_name)
    if at is found:  # not sequence-aware: asked at its own length only
        at = sequence.at_fixed_length(
            found, query.seq_len, fingerprint=query.fingerprint, device_name=query.device_name
        )
    found = at
    for source in ("measured", "estimate"):
        here = _best(tuple(c for c in found.here if c.source == source), JobSetup.of_query(query))
        elsewhere = (
            _best(
                tuple(c for c in found.elsewhere if c.source == source and c.fit is not None), JobSetup.of_query(query)
            )
            if query.budget_bytes is not None
            else None
        )
        if here is not None and (elsewhere is None or here[0][0] <= elsewhere[0][0]):
            (kind, _), c = here
            warnings = [_estimate_warning(c, query.device_name)] if c.estimate else []
            c = _with_measured_context(c, warnings)
            answer = _measured(
                c,
                query,
                target_batch,
                label="estimated" if c.estimate else ("measured" if kind == 0 else "predicted"),
                warnings=warnings,
            )
            return _with_skipped(found, answer)
        if elsewhere is not None and query.budget_bytes is not None:
            c = elsewhere[1]
            answer = _predicted(
                c,
                query,
                target_batch,
                query.budget_bytes,
                warnings=[_estimate_warning(c, query.device_name)] if c.estimate else [],
            )
            return _with_skipped(found, answer)
    raise _not_found(found, query, server_url() if callable(server_url) else server_url)


def _with_skipped(found: Lookup, answer: Suggestion) -> Suggestion:
    if found.skipped:
        ids = ", ".join(str(i) for i in found.skipped)
        answer.warnings.append(
            f"stored profile(s) {ids} of this fingerprint contradict their own trials and were passed "
            "over (GET /api/v1/profiles/{id} lists the problems)"
        )
    return answer


def _kind_text(c: Candidate) -> str:
    return f"{c.strategy} at world size {c.world_size}" + (" (estimate)" if c.estimate else "")


def _not_found(found: Lookup, query: SuggestQuery, server_url: str) -> NoProfileForSuggestion:
    usable = [c for c in found.elsewhere if _rank(c, JobSetup.of_query(query)) is not None]
    other_devices = sorted({c.device_name for c in usable})
    probe = f"autotune probe TASK --server {server_url}" + (
        f" --strategy fsdp --world-size {query.world_size}" if query.strategy == "fsdp" else ""
    )
    if other_devices and query.budget_bytes is None:
        message = (
            f"no profile of fingerprint {query.fingerprint} on {query.device_name!r}; profiles exist on "
            f"{', '.join(repr(d) for d in other_devices)}: pass budget_bytes for a prediction from "
            f"their memory fit, or probe on {query.device_name!r}"
        )
    else:
        message = (
            f"no profile of fingerprint {query.fingerprint} on {query.device_name!r}"
            + (" and none elsewhere with a memory fit" if other_devices else "")
            + f": probe it on that device with `{probe}`"
        )
    # Profiles that exist but never answer this job: an fsdp rank held a smaller shard than the job's.
    unusable = sorted({_kind_text(c) for c in found.here if _rank(c, JobSetup.of_query(query)) is None})
    if unusable:
        message += (
            f"; the profiles on {query.device_name!r} ({', '.join(unusable)}) do not answer a {query.strategy} job at "
            f"world size {query.world_size}: each of their ranks held a smaller share of the model than this "
            "job's ranks will"
        )
    return NoProfileForSuggestion(
        message,
        field="fingerprint",
        details={
            "looked_for": {
                "fingerprint": query.fingerprint,
                "device_name": query.device_name,
                "budget_bytes": query.budget_bytes,
                "strategy": query.strategy,
                "world_size": query.world_size,
            },
            "devices_with_profiles": other_devices,
            "how_to_probe": f"AUTOTUNE_TOKEN=... {probe}",
        },
    )


def suggest(conn: Connection, query: SuggestQuery, *, server_url: str = "URL") -> Suggestion:
    """``compute(consistent_lookup(conn, query.fingerprint, query.device_name), query)``, uncached (for
    scripts and tests)."""
    from autotune_server.consistency import consistent_lookup

    return compute(consistent_lookup(conn, query.fingerprint, query.device_name), query, server_url=server_url)
