"""`--ac` and `--objective`: the memory policies a command probes, one probe per policy, and the
``recommended:`` line that names the policy and plan to run.

Each policy is a probe of its own with its own exact m_max (the loop is here, outside the probe);
every policy is checked before the first probe starts, so a bad one costs no device time and stores
nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from autotune.core.schemas import OBJECTIVES

__all__ = [
    "add_objective_option",
    "add_policy_option",
    "check_policies",
    "for_each_policy",
    "policies_of",
    "policy_list",
    "policy_name",
    "recommendation",
    "with_policies",
]


def policy_list(text: str) -> list[str]:
    """``"none,every-4,op"`` -> ``["none", "every-4", "op"]``: policies in their canonical spelling
    (``autotune.core.policy_names``), without repeats; an op of ``op:OP/...`` must exist in this torch."""
    from autotune.core.errors import TaskError
    from autotune.measure.policies import check_policy

    names = []
    for part in text.split(","):
        try:
            names.append(check_policy(part.strip()))
        except TaskError as exc:
            raise argparse.ArgumentTypeError(f"{exc}; a comma list probes several: none,every-2,op") from None
    return list(dict.fromkeys(names))


def policy_name(text: str) -> str:
    """One policy in its canonical spelling, by the grammar alone (torch-free: what ``autotune suggest``
    asks the server about)."""
    from autotune.core.policy_names import canonical_policy

    try:
        return canonical_policy(text.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_policy_option(p: argparse.ArgumentParser) -> None:
    """--ac, as probe, estimate and fleet take it."""
    p.add_argument(
        "--ac",
        type=policy_list,
        default=None,
        metavar="POLICIES",
        help="activation checkpointing policies to probe, one profile each: none (default), every-K (the "
        "first block and every K-th after it, K >= 2: every-2 is every other block), full (every block), op "
        "(every block op by op, torchtitan's rule: matmul and attention outputs kept, every second matmul "
        "and the rest recomputed), op:OP/OP/... (op-level, keeping the named ops' outputs: op:mm/addmm), "
        "or a comma list (none,every-2,op)",
    )


def add_objective_option(p: argparse.ArgumentParser) -> None:
    """--objective and --no-throughput, as probe takes them."""
    p.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="memory",
        help="what the recommended: line optimizes: memory (default: the largest micro-batch, the fewest "
        "steps) or throughput (the most samples per second, timed)",
    )
    p.add_argument(
        "--no-throughput",
        dest="throughput",
        action="store_false",
        help="skip the timed run after the search (no samples per second in the profile)",
    )


def policies_of(args: argparse.Namespace) -> list[str | None]:
    """The policies to probe: those of --ac, or the task's own (None) when --ac is not given."""
    return list(args.ac) if getattr(args, "ac", None) else [None]


def check_policies(task: Any, policies: Sequence[str | None]) -> None:
    """Every policy can be applied to the task's model (a block to wrap), before any probe runs.

    Raises:
        TaskError: a policy other than none on a model with no block (one line naming shard_classes).
    """
    from autotune.measure.policies import check_model

    for policy in policies:
        if policy is not None:
            check_model(task, policy)


def for_each_policy(
    task: Any, config: Any, policies: Sequence[str | None], run: Callable[[Any, Any], Any]
) -> list[Any]:
    """``run(task, config)`` once per policy, the config's ``activation_checkpointing`` set to it (a
    ProbeConfig's, or an EstimateConfig's probe's: ``with_setup``)."""
    check_policies(task, policies)
    return [
        run(task, config if policy is None else config.with_setup(activation_checkpointing=policy))
        for policy in policies
    ]


def with_policies(pairs: Sequence[Any], policies: Sequence[str | None]) -> list[Any]:
    """Fleet pairs, one per (pair, policy), numbered again in that order."""
    if policies == [None]:
        return list(pairs)
    out: list[Any] = []
    for pair in pairs:
        for policy in policies:
            config = pair.config.with_setup(activation_checkpointing=policy)
            out.append(dataclasses.replace(pair, index=len(out), config=config))
    return out


def recommendation(profiles: Sequence[Any], objective: str) -> str:
    """The ``recommended:`` line: the policy and plan that hold the target best by ``objective``,
    the others beside it."""
    from autotune.core.recommend import options_for, options_text, recommend

    options = options_for(profiles)
    return options_text(recommend(options, objective), options, objective)
