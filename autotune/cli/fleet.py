"""`autotune fleet`: probe job setups on every GPU kind of a Ray cluster and fill the store.

    autotune fleet examples/gpt.py:task my_job.py:task --accelerators H100,A100 --target-batch 512 \\
        --server http://tuner:8000 --ray-address head-node:6379
    autotune fleet examples/mlp.py:task examples/gpt.py:task --device cpu --budget 8MiB,16MiB \\
        --server http://127.0.0.1:8765

Ray is imported only when the command runs (``autotune.fleet.runner``), never by the parser.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from autotune.cli.common import EXIT_FAILED, CliError, non_negative_int, size, task_spec
from autotune.cli.policies import policies_of, with_policies
from autotune.cli.probe import add_probe_options, config_from_args

__all__ = ["add_parsers", "budget_list", "run_fleet_command"]


def budget_list(text: str) -> list[int]:
    """``"8MiB,16MiB"`` -> bytes of each: every budget makes its own pairs."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: empty budget in the list (use 8MiB,16MiB)")
    return [size(part) for part in parts]


def add_parsers(sub: Any) -> None:
    # "resolve": --budget below replaces probe's single budget with a list of them.
    p = sub.add_parser(
        "fleet",
        help="probe tasks on every GPU kind (or budget) as Ray tasks and upload the profiles",
        conflict_handler="resolve",
    )
    p.add_argument("tasks", nargs="+", metavar="TASK", help="path/to/file.py:name or package.module:name")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--accelerators", help="Ray accelerator types, one GPU of each per task: H100,A100,L4")
    where.add_argument("--device", choices=["cpu", "cuda"], help="any node's CPU (needs --budget) or any GPU")
    add_probe_options(p)
    p.add_argument(
        "--budget",
        type=budget_list,
        help="bytes or 800MiB / 24GiB, or a comma list (8MiB,16MiB): one pair per budget (required on cpu)",
    )
    p.add_argument("--server", help="upload each profile to this autotune server (token: AUTOTUNE_TOKEN)")
    p.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="also write every profile here as JSON; profiles the server did not take are kept here "
        "(default for those: ./autotune-fleet-unsent)",
    )
    p.add_argument(
        "--ray-address",
        help="a running Ray cluster: HOST:6379, or auto for the one `ray start` runs here "
        "(default: $RAY_ADDRESS, else a new local instance for this run)",
    )
    p.add_argument(
        "--working-dir",
        type=Path,
        default=Path("."),
        metavar="DIR",
        help="shipped to the workers; the task files must lie inside it (default: the current directory)",
    )
    p.add_argument(
        "--max-retries", type=non_negative_int, default=3, help="re-runs of a pair whose worker died (default 3)"
    )
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout (the table on stderr)")
    p.set_defaults(run=run_fleet_command)


def run_fleet_command(args: argparse.Namespace) -> int:
    from autotune.fleet import ProfileSink, Progress, make_pairs, parse_accelerators, run_fleet

    if args.server is None and args.output is None:
        raise CliError("nowhere to keep the profiles: give --server URL and/or --output DIR")
    if not args.working_dir.is_dir():
        raise CliError(f"--working-dir {str(args.working_dir)!r} is not a directory")

    def config_for(device: str, budget: int | None) -> Any:
        config = config_from_args(argparse.Namespace(**{**vars(args), "budget": budget}), device)
        config.validate()  # a bad option fails here, before any cluster time is spent
        return config

    pairs = with_policies(
        make_pairs(
            [task_spec(spec, args) for spec in args.tasks],
            accelerators=parse_accelerators(args.accelerators) if args.accelerators else None,
            device=args.device,
            budgets=args.budget or [None],
            config_for=config_for,
            working_dir=args.working_dir,
        ),
        policies_of(args),
    )
    if args.ac:  # every policy applies to every task, checked before any cluster time is spent
        from autotune.cli.policies import check_policies
        from autotune.tasks.load import load_task

        for spec in args.tasks:
            check_policies(load_task(spec), args.ac)
    progress = Progress(pairs, sys.stderr)
    with ProfileSink(server=args.server, token=os.environ.get("AUTOTUNE_TOKEN"), output_dir=args.output) as sink:
        rows = run_fleet(
            pairs,
            sink=sink,
            progress=progress,
            ray_address=args.ray_address,
            working_dir=args.working_dir,
            max_retries=args.max_retries,
        )
    progress.close()
    if args.json:
        print(json.dumps([row.as_json() for row in rows], indent=2))
        print(progress.summary(), file=sys.stderr)
    else:
        print(progress.summary())
    kept = sorted(
        {str(row.stored.path.parent) for row in rows if row.stored and row.stored.upload_error and row.stored.path}
    )
    for directory in kept:
        print(
            f"fleet: profiles not uploaded are kept in {directory}: "
            f"autotune profiles upload {directory} --server {args.server}",
            file=sys.stderr,
        )
    failed = [row for row in rows if row.state == "failed"]
    if failed:
        print(f"fleet: {len(failed)} of {len(rows)} pairs failed", file=sys.stderr)
    return 0 if all(row.ok for row in rows) else EXIT_FAILED
