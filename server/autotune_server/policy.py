"""The memory-policy dimension of /suggest: which profiles answer a job's checkpointing policy, and
``objective=throughput``, which policy's plan holds the target with the most samples per second.

A setup's profiles under each policy (none, every-K, full, op, op:OP/...) share one fingerprint (the
policy is not part of it) and differ in ``profiles.activation_checkpointing``, which holds the canonical
spelling (``autotune.core.policy_names``; the query's is made canonical too, so equality matches); the
lookup keeps the newest of each kind per policy. ``objective=memory`` (the default) answers from the
profiles of the job's own policy only: a profile measured with checkpointing would overstate what fits a
job without it.
``objective=throughput`` asks the memory answer of every stored policy and returns the one whose
plan is timed fastest (``autotune.core.recommend`` prices it from the profile's timed runs), saying the
policy it needs; timed answers before untimed ones, the least recomputation among equals.
"""

from __future__ import annotations

from collections.abc import Callable

from autotune.core.recommend import Option, recommend, samples_per_second
from autotune.core.schemas import Suggestion
from autotune_server.candidates import Candidate, Lookup
from autotune_server.errors import BudgetTooSmall, InvalidPlanRequest, NoProfileForSuggestion

__all__ = ["fastest", "for_policy", "policies", "policy_not_found"]


def policies(found: Lookup) -> list[str]:
    """The policies with a profile in the lookup, here or elsewhere, in a stable order."""
    return sorted({c.activation_checkpointing for c in (*found.here, *found.elsewhere)})


def for_policy(found: Lookup, policy: str) -> Lookup:
    """The lookup restricted to profiles measured under ``policy``."""
    return Lookup(
        here=tuple(c for c in found.here if c.activation_checkpointing == policy),
        elsewhere=tuple(c for c in found.elsewhere if c.activation_checkpointing == policy),
        skipped=found.skipped,
    )


def policy_not_found(found: Lookup, policy: str, fingerprint: str, device_name: str) -> NoProfileForSuggestion | None:
    """The 404 for a policy with no profile while other policies of the setup have some, else None."""
    others = [p for p in policies(found) if p != policy]
    if not others or any(c.activation_checkpointing == policy for c in (*found.here, *found.elsewhere)):
        return None
    return NoProfileForSuggestion(
        f"no profile of fingerprint {fingerprint} under activation checkpointing {policy!r}; profiles exist "
        f"under {', '.join(map(repr, others))}: ask with activation_checkpointing={others[0]}, or "
        f"objective=throughput to pick among them, or probe with --ac {policy}",
        field="activation_checkpointing",
        details={"looked_for": {"fingerprint": fingerprint, "device_name": device_name, "policy": policy}},
    )


def _candidate(found: Lookup, profile_id: int | None) -> Candidate | None:
    return next((c for c in (*found.here, *found.elsewhere) if c.id == profile_id), None)


def fastest(
    found: Lookup, answer: Callable[[Lookup, str], Suggestion], *, device_name: str, world_size: int
) -> Suggestion:
    """The answer of the policy whose plan has the most timed samples per second.

    Args:
        found: the lookup of every policy.
        answer: ``answer(lookup of one policy, policy)`` is that policy's memory answer (raises as
            ``suggest.compute`` does).

    Raises:
        the first policy's error when no policy answers (404 when nothing is stored at all).
    """
    answers: list[tuple[Option, Suggestion]] = []
    errors: list[Exception] = []
    for policy in policies(found):
        try:
            suggestion = answer(for_policy(found, policy), policy)
        except (NoProfileForSuggestion, BudgetTooSmall, InvalidPlanRequest) as exc:
            errors.append(exc)
            continue
        c = _candidate(found, suggestion.profile_id)
        rate = samples_per_second(c.throughput, suggestion.micro_batches, world_size) if c else None
        option = Option(
            policy=policy,
            max_micro_batch=suggestion.max_micro_batch,
            micro_batches=tuple(suggestion.micro_batches),
            accumulation_steps=suggestion.accumulation_steps,
            samples_per_second=None if rate is None else rate[0],
            timed=True if rate is None else rate[1],
        )
        if rate is not None and c is not None:
            suggestion.samples_per_second = round(rate[0], 4)
            if not rate[1]:
                suggestion.warnings.append(
                    f"samples per second priced from the nearest timed micro-batch of profile {c.id}, "
                    "not timed at this plan's sizes"
                )
            if c.device_name != device_name:
                suggestion.warnings.append(f"samples per second timed on {c.device_name}, not on {device_name}")
        answers.append((option, suggestion))
    if not answers:
        if errors:
            raise errors[0]
        return answer(found, "none")  # nothing stored: the ordinary 404
    options = [option for option, _ in answers]
    timed = any(option.samples_per_second is not None for option in options)
    # Nothing timed: the fewest steps (the memory objective's order) among the policies.
    best = recommend(options, "throughput" if timed else "memory")
    chosen = next(suggestion for option, suggestion in answers if option is best)
    beside = [option.text() for option, _ in answers if option is not best]
    chosen.warnings.append(
        f"objective throughput: activation checkpointing {best.policy!r} holds the target fastest "
        f"({best.text()})" + (f"; beside it {'; '.join(beside)}" if beside else "")
    )
    if not timed:
        chosen.warnings.append("no stored profile of this setup was timed: the policy with the fewest steps answers")
    return chosen
