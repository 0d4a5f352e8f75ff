"""`autotune estimate`: the datasheet from fake-tensor trials, for a card this machine does not have."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from autotune.cli.common import (
    TASK_HELP,
    check_seq_len_options,
    finite_positive,
    non_negative_int,
    output_file,
    positive_int,
    positive_int_list,
    size,
    task_spec,
)
from autotune.cli.policies import for_each_policy, policies_of, recommendation
from autotune.cli.probe import add_setup_options, emit_profiles, lengths_of, moe_routing_of, setup_of
from autotune.cli.recipes.options import add_recipe_options
from autotune.core.schemas import OBJECTIVES
from autotune.core.units import limit_bytes

if TYPE_CHECKING:
    from autotune.core.schemas import Profile
    from autotune.orchestrate.config import DeviceKind, EstimateConfig

__all__ = ["add_parsers", "run_estimate"]


def add_parsers(sub: Any) -> None:
    e = sub.add_parser(
        "estimate",
        help="estimate the largest micro-batch for a budget with fake tensors (no device memory used)",
    )
    e.add_argument("task", nargs="?", help=TASK_HELP)
    add_recipe_options(e)
    e.add_argument("--device-kind", choices=["cpu", "cuda"], default="cuda", help="the card's kind (default cuda)")
    e.add_argument(
        "--device-name", help='the card the estimate is for, as /suggest matches it ("NVIDIA H100 80GB HBM3")'
    )
    add_card_options(e)
    add_setup_options(e)
    e.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="memory",
        help="what the recommended: line of several --ac policies optimizes: memory (default: the fewest steps) or "
        "throughput (the most samples per second per GPU, as predicted on a --gpu card)",
    )
    e.add_argument("--output", type=output_file, help="also write the profile JSON to this file")
    e.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    e.add_argument("--server", help="upload the estimate to this autotune server (token: AUTOTUNE_TOKEN)")
    e.add_argument(
        "--workers",
        type=non_negative_int,
        metavar="N",
        help="with --seq-len: processes that run independent fake trials beside this one when they are slow "
        "(default: one per idle core, by the load average, at most 3; 0 runs them all here)",
    )
    e.set_defaults(run=run_estimate)


def add_card_options(e: argparse.ArgumentParser) -> None:
    """--gpu, --context-bytes, --micro-batches: an estimate for a named card (autotune gpus lists them)."""
    e.add_argument(
        "--gpu",
        metavar="NAME",
        help="a card of the catalog (h100, h200, a100-80gb, l4, ...: `autotune gpus`): its name for /suggest, "
        "its memory as the default budget, and CUDA semantics by an emulated card; several (h100,h200,b200): an "
        "estimate for each in one run, the cards of one architecture sharing their fake trials' walks",
    )
    e.add_argument(
        "--gpu-memory",
        type=size,
        metavar="BYTES",
        help="with --gpu: the card's memory (e.g. 96GiB), for a card the catalog lacks or one with other memory "
        "(H100 NVL at 96GB): the architecture is the closest catalog card's, which the datasheet names",
    )
    e.add_argument(
        "--context-bytes",
        type=size,
        metavar="BYTES",
        help="with --gpu: memory outside the caching allocator (CUDA context and modules); default the catalog's",
    )
    e.add_argument(
        "--estimate-bound",
        choices=("safe", "tight"),
        default=None,  # not given: safe; given without --gpu: refused (autotune.cli.inputs)
        help="with --gpu: safe (the default) adds a stated upper bound for what the card's figure does not model "
        "(NCCL's buffers, for more than one rank), so that the answer never promises more than the card holds; "
        "tight adds nothing (docs/cuda-estimates.md)",
    )
    add_figure_options(e)
    e.add_argument(
        "--full-walk",
        action="store_true",
        help="with --gpu: walk every block of the model in every fake trial, not a few of them with the rest "
        "repeated (the same bytes, minutes longer for a deep model: the check of the shortcut; docs/depth.md)",
    )
    e.add_argument(
        "--micro-batches",
        type=positive_int_list,
        metavar="M1,M2,...",
        default=(),
        help="with --gpu: also estimate these sizes (their trials in the profile): will m = 32 fit? Each at most "
        "--max-micro-batch and a multiple of --multiple-of",
    )


def add_figure_options(e: argparse.ArgumentParser) -> None:
    """The card's and the fabric's figures for the predicted step time, in place of the catalog's
    (autotune/core/cards.py, PERFORMANCE; autotune/core/step_time.py)."""
    figures = e.add_argument_group("figures of the predicted step time (with --gpu; default the catalog's)")
    figures.add_argument(
        "--peak-tflops",
        type=finite_positive,
        metavar="TFLOPS",
        help="the card's dense peak at the job's precision (bf16: 989 on an H100 SXM); its other peaks scale with it",
    )
    figures.add_argument("--memory-tbytes-per-s", type=finite_positive, metavar="TB/S", help="the memory's bandwidth")
    figures.add_argument(
        "--nvlink-gbytes-per-s", type=finite_positive, metavar="GB/S", help="NVLink per GPU, one direction (H100: 450)"
    )
    figures.add_argument(
        "--network-gbits-per-s",
        type=finite_positive,
        metavar="GBIT/S",
        help="the network between nodes per GPU (a 400 Gb/s NIC per GPU: 400)",
    )
    figures.add_argument("--gpus-per-node", type=positive_int, metavar="N", help="GPUs in a node (default 8)")


def figures_of(args: argparse.Namespace) -> Any:
    """The figures the flags give (FigureOverrides)."""
    from autotune.core.step_time import FigureOverrides

    return FigureOverrides(
        peak_tflops=getattr(args, "peak_tflops", None),
        memory_tbytes_per_s=getattr(args, "memory_tbytes_per_s", None),
        nvlink_gbytes_per_s=getattr(args, "nvlink_gbytes_per_s", None),
        network_gbits_per_s=getattr(args, "network_gbits_per_s", None),
        gpus_per_node=getattr(args, "gpus_per_node", None),
    )


def measured_context(config: Any, args: argparse.Namespace) -> Any:
    """With --gpu and --server but no --context-bytes: the memory outside the allocator the store has
    measured on that card (its real CUDA trials), where it has; the catalog's figure otherwise."""
    if config.card is None or config.context_bytes is not None or not args.server:
        return config
    import dataclasses

    from autotune_client import TunerClient
    from autotune_client.errors import AutotuneClientError

    try:
        with TunerClient(base_url=args.server) as client:
            found = client.device_context(config.device_name)
    except AutotuneClientError as exc:
        print(f"warning: the store's context figure is not to be had ({exc}): the catalog's is used", file=sys.stderr)
        return config
    if found is None:
        return config
    source = (
        f"the median over {found.profiles} measured profiles of the card at {args.server} of each one's trial at "
        f"its m_max ({found.trials} real trials, {found.low_bytes} to {found.high_bytes} bytes)"
    )
    return dataclasses.replace(config, context_bytes=found.outside_allocator_bytes, context_source=source)


def estimate_config(
    args: argparse.Namespace,
    *,
    budget_bytes: int | None,
    gpu: str | None,
    device_kind: DeviceKind = "cuda",
    device_name: str | None = None,
    micro_batches: Sequence[int] = (),
) -> EstimateConfig:
    """The EstimateConfig of the estimate flags in args (`autotune estimate`'s, and `autotune fleet --gpu`'s
    per card and budget): the probe's setup as `autotune probe` reads it, and the card gpu names, looked up
    here once (its name and memory where they are not given)."""
    from autotune.orchestrate.config import EstimateConfig

    return EstimateConfig.of(
        **{**setup_of(args), "budget_bytes": budget_bytes},
        gpu=gpu,
        gpu_memory=getattr(args, "gpu_memory", None),
        device_kind=device_kind,
        device_name=device_name,
        context_bytes=args.context_bytes,
        micro_batches=tuple(micro_batches),
        estimate_bound=getattr(args, "estimate_bound", None) or "safe",
        figures=figures_of(args),
        full_walk=getattr(args, "full_walk", False),
    )


def run_estimate(args: argparse.Namespace) -> int:
    from autotune.cli.inputs import check_task
    from autotune.tasks.load import load_task

    cards = [name.strip() for name in args.gpu.split(",")] if args.gpu and "," in args.gpu else []
    if cards:
        return _estimate_cards(args, cards)
    config = estimate_config(
        args,
        budget_bytes=args.budget,
        gpu=args.gpu,
        device_kind=args.device_kind,
        device_name=args.device_name,
        micro_batches=args.micro_batches,
    )
    config = measured_context(config, args)
    config.validate()  # a missing budget is refused before the task is even loaded
    check_seq_len_options(args)
    task = load_task(task_spec(args.task, args))
    check_task(args, task)
    routing, _ = moe_routing_of(task, args)
    with routing:
        return _estimate_task(args, config, task)


def single_step_not_estimated(profile: Profile) -> None:
    """Say on the datasheet where a target one step (A = 1) might hold is planned accumulating: fake trials run
    the accumulating job only, so an estimate has no single-step figure (Profile.single_step) and plans from
    its m_max, as /suggest then does (autotune.core.plan.plan_with_single_step); a probe on the card measures it."""
    plan = profile.plan
    if plan is None or plan.accumulation_steps == 1 or profile.single_step is not None or profile.pipeline:
        return
    per_replica, rest = divmod(plan.target_batch, plan.world_size)
    if rest or per_replica % profile.multiple_of or per_replica > profile.micro_batch_cap:
        return
    if not _single_step_may_fit(profile, per_replica):
        return
    profile.warnings.append(
        f"target {plan.target_batch} would be micro-batch {per_replica} per replica in one step (A = 1), above the "
        f"accumulating max micro-batch {profile.max_micro_batch}: a single step holds up to one gradient set less, "
        "but fake trials estimate the accumulating job only, so the plan accumulates; `autotune probe` with the "
        "target measures the single step on the device"
    )


def _single_step_may_fit(profile: Profile, micro_batch: int) -> bool:
    """Whether the estimate's own figures leave room for a single step at micro_batch: what it saves against the
    accumulating step is at most one gradient set (the breakdown's gradients at the peak, else the fit's fixed
    bytes, which hold them), and the accumulating peak at micro_batch is at least the fit's prediction and the
    peak of any larger size tried below it (a fake trial over the card reads the card's memory: a floor too).
    Advice past that would propose what the figures already rule out (issue 62: "a single step at micro-batch 16
    per replica" where m = 1 held 54.64 GiB of an 80 GiB card)."""
    fit = profile.fit
    at_m_max = [b for b in profile.breakdown or [] if b.micro_batch == profile.max_micro_batch]
    gradients = [b.parts.get("gradients", 0) for b in at_m_max]
    if gradients:
        saved = max(gradients)
    elif fit is not None:
        saved = max(0, int(fit.fixed_bytes))
    else:
        return True  # nothing says what a single step saves
    floors = [t.peak_bytes for t in profile.trials if not t.fits and t.micro_batch <= micro_batch]
    if fit is not None:
        floors.append(int(fit.fixed_bytes + fit.bytes_per_sample * micro_batch))
    return not floors or max(floors) - saved <= profile.limit_bytes


def _estimate_cards(args: argparse.Namespace, cards: list[str]) -> int:
    """``--gpu h100,h200,b200``: each card's estimate, one after another in one run, the cards of one architecture
    sharing their walks (autotune/emulation/card_search.py, ``sharing_traces``); every profile in one JSON array."""
    from autotune.emulation.card_search import sharing_traces
    from autotune.tasks.load import load_task

    configs = []
    for name in cards:  # every card's config refused or not before any estimate starts
        config = estimate_config(
            args,
            budget_bytes=args.budget,
            gpu=name,
            device_kind=args.device_kind,
            device_name=args.device_name,
            micro_batches=args.micro_batches,
        )
        config = measured_context(config, args)
        config.validate()
        configs.append(config)
    check_seq_len_options(args)
    task = load_task(task_spec(args.task, args))
    routing, _ = moe_routing_of(task, args)
    profiles: list[Profile] = []
    with routing, sharing_traces():
        for name, config in zip(cards, configs, strict=True):
            profiles.extend(_estimate_profiles(argparse.Namespace(**{**vars(args), "gpu": name}), config, task))
    code = emit_profiles(profiles, args, as_array=True)
    for config in configs:
        _recommend([p for p in profiles if p.device.name == config.device_name], args, lengths_of(task, args))
    return code


def _estimate_task(args: argparse.Namespace, config: Any, task: Any) -> int:
    profiles = _estimate_profiles(args, config, task)
    lengths = lengths_of(task, args)
    code = emit_profiles(profiles, args, as_array=bool(lengths))
    _recommend(profiles, args, lengths)
    return code


def _recommend(profiles: list[Profile], args: argparse.Namespace, lengths: Sequence[int] | None) -> None:
    """The policies compete at each length, not the lengths with each other: a ``recommended:`` line at each length
    where several policies were estimated."""
    every_length: list[int | None] = list(lengths) if lengths else [None]
    for seq_len in every_length:
        at_length = [p for p in profiles if p.seq_len == seq_len]
        if len(at_length) > 1:  # fake trials are not timed: by memory, or by an emulated card's predicted time
            line = recommendation(at_length, getattr(args, "objective", "memory"))
            print(line if seq_len is None else f"at L={seq_len}: {line}", file=sys.stderr if args.json else sys.stdout)


def _estimate_profiles(args: argparse.Namespace, config: Any, task: Any) -> list[Profile]:
    from autotune.cli.report import trial_line
    from autotune.orchestrate.estimate import estimate

    lengths = lengths_of(task, args)
    assert config.probe.budget_bytes is not None  # validate() refused None
    limit = limit_bytes(config.probe.budget_bytes, args.headroom)
    target = config.device_name if config.card else args.device_kind
    print(f"estimating {task.name} for {target} with fake tensors ...", file=sys.stderr)

    memory = "the card" if config.card else "the budget"

    def progress(trial: Any) -> None:
        print(trial_line(trial, limit, memory=memory), file=sys.stderr, flush=True)

    def run(t: Any, c: Any) -> list[Any]:
        if lengths and c.card is not None:  # every length's emulated search in one child
            from autotune.orchestrate.estimate import estimate_for_card_at_lengths

            return estimate_for_card_at_lengths(t, c, lengths, on_trial=progress)
        if lengths:
            from autotune.orchestrate.lengths import estimate_lengths

            found = estimate_lengths(
                t,
                c,
                lengths,
                max_seq_len=args.max_seq_len,
                target_tokens=args.target_tokens,
                on_trial=progress,
                workers=args.workers,
            )
            return found.profiles
        return [estimate(t, c, on_trial=progress)]

    profiles = [p for group in for_each_policy(task, config, policies_of(args), run) for p in group]
    for profile in profiles:
        single_step_not_estimated(profile)
    return profiles
