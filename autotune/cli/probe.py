"""`autotune probe` and `autotune verify`: the commands that run the user's model."""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Any

from autotune.cli.common import (
    EXIT_FAILED,
    TASK_HELP,
    CliError,
    add_mesh_options,
    add_seq_len_options,
    add_strategy_and_plan_options,
    add_task_options,
    add_tp_plan_option,
    check_seq_len_options,
    finite_positive,
    headroom,
    loss_name,
    mesh_of,
    micro_batch_cap,
    output_file,
    positive_int,
    seq_len,
    size,
    task_spec,
    world_size,
)
from autotune.cli.policies import add_objective_option, add_policy_option, for_each_policy, policies_of, recommendation
from autotune.cli.recipes.emit import write_recipe_for
from autotune.cli.recipes.options import add_recipe_options
from autotune.core.files import write_atomically
from autotune.core.schemas import OFFLOADS, PRECISIONS
from autotune.core.units import limit_bytes

__all__ = [
    "add_offload_options",
    "add_parsers",
    "add_probe_options",
    "add_setup_options",
    "config_from_args",
    "emit_profile",
    "emit_profiles",
    "lengths_of",
    "run_probe",
    "run_verify",
    "setup_of",
]


def add_probe_options(p: argparse.ArgumentParser) -> None:
    """The options that shape one probe (shared by `probe`, and by the commands that run probes)."""
    add_setup_options(p)
    p.add_argument(
        "--no-presearch",
        dest="presearch",
        action="store_false",
        help="skip the fake-tensor pre-search: real trials only",
    )
    add_objective_option(p)


def add_setup_options(p: argparse.ArgumentParser) -> None:
    """The options that say what is measured and planned (`probe`'s and `estimate`'s)."""
    p.add_argument("--budget", type=size, help="bytes or 800MiB / 24GiB (required on cpu)")
    p.add_argument("--headroom", type=headroom, default=0.10, help="fraction kept free (default 0.10)")
    p.add_argument("--target-batch", type=positive_int, help="effective batch T to plan for")
    p.add_argument(
        "--world-size", type=world_size, default=1, help="ranks W (data-parallel replicas D = W / (tp x pp x cp))"
    )
    p.add_argument("--max-micro-batch", type=micro_batch_cap, default=4096)
    p.add_argument(
        "--no-breakdown",
        dest="breakdown",
        action="store_false",
        help="skip the peak's breakdown by what holds it",
    )
    p.add_argument(
        "--levers",
        action="store_true",
        help="after the search, what each change of the setup would free at the peak and the m_max it gives "
        "(a fake trial and an estimate per change)",
    )
    p.add_argument("--multiple-of", type=positive_int, default=1)
    p.add_argument("--precision", choices=PRECISIONS, help="override the task's precision")
    add_strategy_and_plan_options(p)
    add_mesh_options(p)
    add_tp_plan_option(p)
    add_policy_option(p)
    add_offload_options(p)
    p.add_argument(
        "--compile",
        nargs="?",
        const="default",
        type=compile_mode,
        metavar="MODE",
        help="run the trials on the model torch.compile'd in MODE (default: default; reduce-overhead, "
        "max-autotune, ...: the installed torch's modes), compiled once per probe (docs/compile.md)",
    )
    p.add_argument(
        "--sdpa-backend",
        choices=("flash", "efficient", "cudnn", "math"),
        help="the kernel scaled_dot_product_attention runs (default: the one torch picks for the inputs and the "
        "device, which the datasheet names): what the job's torch, mask or inputs make it run, e.g. math where "
        "a mask rules out the fused kernels (docs/cuda-estimates.md)",
    )
    p.add_argument(
        "--loss",
        type=loss_name,
        metavar="LOSS",
        help="how the causal LM's loss is computed: plain (default: the logits whole), chunked[:N] (TRL's chunked "
        "NLL, N tokens per chunk, 256 by default) or fused-linear (Liger's fused linear cross entropy): "
        "autotune/tasks/losses.py",
    )
    add_task_options(p)
    add_seq_len_options(p)
    p.add_argument(
        "--moe-load-factor",
        type=moe_load_factor,
        metavar="F",
        help="mixture-of-experts tasks: the routing fake trials assume, the busiest expert's share of tokens "
        "over a fair one (default 1.0, balanced; under --ep experts / top_k, every token on expert 0: the worst "
        "case of a dropless job); real trials route as the model does",
    )


def compile_mode(text: str) -> str:
    """A ``torch.compile`` mode of the installed torch (``--compile MODE``)."""
    from autotune.tasks.task import compile_modes

    if text not in compile_modes():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a torch.compile mode of this torch: choose from {', '.join(compile_modes())}"
        )
    return text


def add_offload_options(p: argparse.ArgumentParser) -> None:
    """--offload and --host-budget (autotune/measure/offload.py, docs/offload.md)."""
    p.add_argument(
        "--offload",
        choices=OFFLOADS,
        help="keep part of the job in host memory: activations (the blocks' saved activations, save_on_cpu) or "
        "params (--strategy fsdp: FSDP2's CPUOffloadPolicy); the device's bytes decide m, the host's are reported",
    )
    p.add_argument(
        "--host-budget",
        type=size,
        metavar="BYTES",
        help="with --offload: a size whose host bytes exceed this does not fit (e.g. 64GiB)",
    )


def moe_load_factor(text: str) -> float:
    """--moe-load-factor: a finite number of at least 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a finite number: the busiest expert's share of tokens over a fair one, at least 1 "
            "and at most experts / top_k"
        )
    if value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text} is below 1: 1.0 is balanced routing, and no expert is busier than a fair share on average"
        )
    return value


def moe_routing_of(task: Any, args: argparse.Namespace) -> tuple[Any, float | None]:
    """The routing the fake trials of task run under (a context) and what its profiles say (None: dense),
    by --moe-load-factor (autotune/orchestrate/routing.py); recorded in args for emit_profile(s).

    Raises:
        CliError: --moe-load-factor on a dense model, or above experts / top_k (every token on one expert).
    """
    from autotune.core.errors import TaskError
    from autotune.orchestrate.routing import moe_routing_for

    args.moe_load_factor_used = None  # what emit_profile(s) write into the profiles
    try:
        routing, factor = moe_routing_for(task, getattr(args, "moe_load_factor", None), getattr(args, "ep", 1) or 1)
    except TaskError as exc:
        raise CliError(str(exc)) from None
    args.moe_load_factor_used = factor
    return routing, factor


def _with_routing(profile: Any, args: argparse.Namespace) -> Any:
    factor = getattr(args, "moe_load_factor_used", None)
    return profile if factor is None else profile.model_copy(update={"moe_load_factor": factor})


def setup_of(args: argparse.Namespace) -> dict[str, Any]:
    """The ProbeConfig fields the setup options give (:func:`add_setup_options`): the one place the flags
    become the job's setup, for a probe (:func:`config_from_args`), an estimate and the fleet's pairs."""
    return {
        "budget_bytes": args.budget,
        "headroom": args.headroom,
        "target_batch": args.target_batch,
        "world_size": args.world_size,
        "max_micro_batch": args.max_micro_batch,
        "multiple_of": args.multiple_of,
        "precision": args.precision,
        "strategy": args.strategy,
        "mesh": mesh_of(args),
        "tp_plan": getattr(args, "tp_plan", None),
        "sdpa_backend": getattr(args, "sdpa_backend", None),
        "plan_policy": args.plan,
        "offload": getattr(args, "offload", None),
        "host_budget_bytes": getattr(args, "host_budget", None),
        "compile": getattr(args, "compile", None),
        "lm_loss": getattr(args, "loss", None),
        "breakdown": getattr(args, "breakdown", False),
        "levers": getattr(args, "levers", False),
    }


def config_from_args(args: argparse.Namespace, device: str) -> Any:
    """The ProbeConfig the probe options describe, on device."""
    from autotune.orchestrate.config import ProbeConfig

    return ProbeConfig(
        device=device,
        presearch=args.presearch,
        throughput=getattr(args, "throughput", False),
        seq_lens=tuple(getattr(args, "seq_len", None) or ()),
        max_seq_len=getattr(args, "max_seq_len", None),
        target_tokens=getattr(args, "target_tokens", None),
        **setup_of(args),
    )


def add_parsers(sub: Any) -> None:
    p = sub.add_parser("probe", help="measure the largest micro-batch that fits and plan the target batch")
    p.add_argument("task", nargs="?", help=TASK_HELP)
    add_recipe_options(p)
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | all | auto (default)")
    add_probe_options(p)
    p.add_argument("--output", type=output_file, help="also write the profile JSON to this file")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.add_argument("--server", help="upload the profile to this autotune server (token: AUTOTUNE_TOKEN)")
    p.set_defaults(run=run_probe)

    v = sub.add_parser("verify", help="prove that accumulation reproduces the big-batch gradient")
    v.add_argument("task", help=TASK_HELP)
    v.add_argument("--target-batch", type=positive_int)
    v.add_argument("--micro-batch", type=positive_int)
    v.add_argument("--tolerance", type=finite_positive)
    v.add_argument("--seq-len", type=seq_len, help="the sequence length of a sequence-aware task (hf: tasks)")
    add_task_options(v)
    v.set_defaults(run=run_verify)


def run_probe(args: argparse.Namespace) -> int:
    from autotune.cli.inputs import check_task
    from autotune.tasks.load import load_task

    check_seq_len_options(args)
    spec = task_spec(args.task, args)
    task = load_task(spec)
    check_task(args, task)
    routing, _ = moe_routing_of(task, args)
    with routing:
        return _probe_task(args, spec, task)


def _probe_task(args: argparse.Namespace, spec: str, task: Any) -> int:
    from autotune.cli.report import trial_line
    from autotune.orchestrate.probe import probe

    config = config_from_args(args, args.device)
    limit = limit_bytes(args.budget, args.headroom) if args.budget else None
    lengths = lengths_of(task, args)
    print(f"probing {task.name} on {args.device} ...", file=sys.stderr)
    if lengths:
        if args.device.strip().lower() == "all":
            raise CliError("--seq-len with --device all is not supported: probe one device (--device cuda:N)")
        from autotune.orchestrate.lengths import probe_lengths

        def over_lengths(t: Any, c: Any) -> list[Any]:
            return probe_lengths(
                t,
                c,
                lengths,
                max_seq_len=args.max_seq_len,
                target_tokens=args.target_tokens,
                on_trial=lambda r: print(trial_line(r, limit), file=sys.stderr, flush=True),
            ).profiles

        profiles = [p for group in for_each_policy(task, config, policies_of(args), over_lengths) for p in group]
        code = emit_profiles(profiles, args, as_array=True)
        for seq_len in lengths:  # the policies compete at each length, not the lengths with each other
            at_length = [p for p in profiles if p.seq_len == seq_len]
            if at_length:
                line = recommendation(at_length, args.objective)
                print(f"at L={seq_len}: {line}", file=sys.stderr if args.json else sys.stdout)
        return code
    if args.device.strip().lower() == "all":
        if config.strategy == "fsdp":
            raise CliError(
                "--strategy fsdp with --device all is refused: the fsdp probe answers for rank 0 of "
                "--world-size on one device; probe one device (--device cuda:N)"
            )
        from autotune.orchestrate.multi import probe_all_devices

        profiles = for_each_policy(task, config, policies_of(args), lambda _task, c: probe_all_devices(spec, c))
    else:
        profiles = for_each_policy(
            task,
            config,
            policies_of(args),
            lambda t, c: probe(t, c, on_trial=lambda r: print(trial_line(r, limit), file=sys.stderr, flush=True)),
        )
    code = emit_profiles(profiles, args)
    # Always: which policy and plan hold the target best, each policy's samples per second beside it.
    print(recommendation(profiles, args.objective), file=sys.stderr if args.json else sys.stdout)
    return code


def lengths_of(task: Any, args: argparse.Namespace) -> list[int] | None:
    """The --seq-len lengths for a sequence-aware task, None for another (and for one bound to a
    length already, ``task.at_length(L)``); a sequence-aware task without them, or lengths for a task
    that takes none, is one line (exit 2)."""
    from autotune.orchestrate.lengths import check_lengths

    lengths = getattr(args, "seq_len", None)
    if task.sequence_aware and task.seq_len is None and not lengths:
        raise CliError(
            f"task {task.name!r} is sequence-aware (its batch takes seq_len=): "
            "give the lengths with --seq-len L1,L2,..."
        )
    return check_lengths(task, lengths) if lengths else None


def emit_profiles(profiles: list[Any], args: argparse.Namespace, *, as_array: bool = False) -> int:
    """One profile as :func:`emit_profile`; several (one run, several policies or lengths) as a JSON
    array on --json and --output (``as_array``: an array even of one, as --seq-len promises), a
    datasheet each (one table over the lengths), each uploaded to --server."""
    profiles = [_with_routing(profile, args) for profile in profiles]
    code = emit_profile(profiles[0], args) if len(profiles) == 1 and not as_array else _emit_many(profiles, args)
    write_recipe_for(profiles, args)  # --write-recipe: the recipe with the plan's batch keys
    return code


def _emit_many(profiles: list[Any], args: argparse.Namespace) -> int:
    from autotune.cli.report import datasheet, lengths_datasheet

    text = "[\n" + ",\n".join(profile.model_dump_json(indent=2) for profile in profiles) + "\n]"
    if args.output:
        write_atomically(args.output, text)
    if args.json:
        print(text)
    if any(profile.seq_len is not None for profile in profiles):
        print(lengths_datasheet(profiles), file=sys.stderr if args.json else sys.stdout)
    else:
        for profile in profiles:
            print(datasheet(profile), file=sys.stderr if args.json else sys.stdout)
    if args.server:
        from autotune.cli.client_commands import upload_profile

        token = os.environ.get("AUTOTUNE_TOKEN")
        for profile in profiles:
            profile_id = upload_profile(profile, server=args.server, token=token)
            print(f"uploaded as profile {profile_id} to {args.server}", file=sys.stderr)
    return 0


def emit_profile(profile: Any, args: argparse.Namespace) -> int:
    """The profile as --output, --json and --server ask, the datasheet on the terminal."""
    from autotune.cli.report import datasheet

    profile = _with_routing(profile, args)
    text = profile.model_dump_json(indent=2)
    if args.output:
        write_atomically(args.output, text)
    if args.json:
        print(text)
        print(datasheet(profile), file=sys.stderr)
    else:
        print(datasheet(profile))
    if args.server:
        from autotune.cli.client_commands import upload_profile

        profile_id = upload_profile(profile, server=args.server, token=os.environ.get("AUTOTUNE_TOKEN"))
        print(f"uploaded as profile {profile_id} to {args.server}", file=sys.stderr)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from autotune.loop.verify import verify_cli
    from autotune.tasks.load import load_task

    task = _at_length(load_task(task_spec(args.task, args)), args.seq_len)
    ok, message = verify_cli(task, args.target_batch, args.micro_batch, args.tolerance)
    if not ok and message.startswith(_VERIFY_REFUSED):  # sizes it refused before running (--target-batch 1, ...)
        raise CliError(message.removeprefix(_VERIFY_REFUSED))
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else EXIT_FAILED


# How verify_cli says it refused its sizes rather than found a mismatch (autotune/loop/verify.py).
_VERIFY_REFUSED = "autotune verify: "


def _at_length(task: Any, seq_len: int | None) -> Any:
    """A sequence-aware task (its batch takes ``seq_len=``) at the one length verify runs."""
    if task.sequence_aware and seq_len is None:
        raise CliError(f"task {task.name!r} is sequence-aware (its batch takes seq_len=): give --seq-len L")
    return task if seq_len is None else task.at_length(seq_len)
