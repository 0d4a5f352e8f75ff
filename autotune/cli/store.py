"""`autotune suggest` and `autotune profiles`: the store seen through the client."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.cli.common import (
    CliError,
    add_mesh_options,
    add_strategy_and_plan_options,
    headroom,
    loss_name,
    mesh_of,
    positive_int,
    seq_len,
    size,
    world_size,
)
from autotune.cli.policies import policy_name
from autotune.core.schemas import OBJECTIVES, OFFLOADS, SOURCES, STRATEGIES

__all__ = ["add_parsers", "run_profiles", "run_suggest"]


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("suggest", help="ask the server for a plan (for launch scripts)")
    g.add_argument("--server")
    g.add_argument("--fingerprint", required=True)
    g.add_argument("--target-batch", type=positive_int, help="sequences (samples) per update")
    g.add_argument("--target-tokens", type=positive_int, help="tokens per update instead (needs --seq-len)")
    g.add_argument("--seq-len", type=seq_len, help="a sequence-aware setup's sequence length")
    g.add_argument("--world-size", type=world_size, default=1)
    g.add_argument("--device-name", required=True)
    g.add_argument("--budget", type=size)
    g.add_argument("--headroom", type=headroom)
    add_strategy_and_plan_options(g)
    add_mesh_options(g)
    g.add_argument("--offload", choices=OFFLOADS, help="the job's offload (default: the fingerprint's)")
    g.add_argument("--host-budget", type=size, help="the host memory the job may use under --offload")
    g.add_argument("--compile", metavar="MODE", help="the job's torch.compile mode (default: the fingerprint's)")
    g.add_argument(
        "--loss",
        type=loss_name,
        metavar="LOSS",
        help="the job's loss: plain, chunked[:N] or fused-linear (default: the fingerprint's)",
    )
    g.add_argument(
        "--ac",
        type=policy_name,
        default="none",
        help="the job's activation checkpointing policy (default none; every-K, full, op, op:OP/OP/... as "
        "probe's --ac): objective memory answers from its profiles",
    )
    g.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="memory",
        help="memory (default) or throughput: the stored policy whose plan was timed fastest, and which it is",
    )
    g.add_argument("--json", action="store_true")
    g.set_defaults(run=run_suggest)

    r = sub.add_parser("profiles", help="list, show, remove or upload stored profiles")
    r.add_argument("action", choices=["ls", "show", "rm", "upload"])
    r.add_argument("profile_id", nargs="?", metavar="ID|DIR", help="a profile id (show, rm); a directory (upload)")
    r.add_argument("--server")
    r.add_argument("--json", action="store_true")
    r.add_argument("--fingerprint")
    r.add_argument("--task")
    r.add_argument("--device-name")
    r.add_argument("--precision")
    r.add_argument("--strategy", choices=STRATEGIES)
    r.add_argument("--world-size", type=world_size)
    r.add_argument("--source", choices=SOURCES, help="measured, or estimate (fake-tensor trials only)")
    r.set_defaults(run=run_profiles)


def run_suggest(args: argparse.Namespace) -> int:
    from autotune.cli.client_commands import suggest_command

    if (args.target_batch is None) == (args.target_tokens is None):
        raise CliError("give --target-batch (sequences per update) or --target-tokens (tokens per update)")
    if args.target_tokens is not None and args.seq_len is None:
        raise CliError("--target-tokens needs --seq-len: tokens are planned in sequences of a length")
    return suggest_command(
        server=args.server,
        fingerprint=args.fingerprint,
        target_batch=args.target_batch,
        target_tokens=args.target_tokens,
        seq_len=args.seq_len,
        world_size=args.world_size,
        device_name=args.device_name,
        budget_bytes=args.budget,
        headroom=args.headroom,
        strategy=args.strategy,
        plan=args.plan,
        activation_checkpointing=args.ac,
        objective=args.objective,
        mesh=mesh_of(args).label(),
        host_budget_bytes=args.host_budget,
        offload=args.offload,
        compile=args.compile,
        lm_loss=args.loss,
        as_json=args.json,
    )


def run_profiles(args: argparse.Namespace) -> int:
    from autotune.cli.client_commands import profiles_command

    if args.action == "upload":
        from pathlib import Path

        from autotune.cli.client_commands import upload_directory

        if args.profile_id is None:
            raise CliError("profiles upload needs a directory of JSON profiles (what autotune fleet kept)")
        return upload_directory(Path(args.profile_id), server=args.server)
    if args.action in ("show", "rm") and args.profile_id is None:
        raise CliError(f"profiles {args.action} needs a profile id")
    if args.profile_id is not None:
        try:
            args.profile_id = int(args.profile_id)
        except ValueError:
            raise CliError(f"profiles {args.action}: {args.profile_id!r} is not a profile id") from None
    filters = {
        key: value
        for key, value in {
            "fingerprint": args.fingerprint,
            "task": args.task,
            "device_name": args.device_name,
            "precision": args.precision,
            "strategy": args.strategy,
            "world_size": args.world_size,
            "source": args.source,
        }.items()
        if value is not None
    }
    return profiles_command(
        server=args.server, action=args.action, profile_id=args.profile_id, as_json=args.json, filters=filters
    )
