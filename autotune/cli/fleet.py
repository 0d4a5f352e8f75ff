"""`autotune fleet`: probe job setups on every GPU kind of a Ray cluster and fill the store.

    autotune fleet examples/gpt.py:task my_job.py:task --accelerators H100,A100 --target-batch 512 \\
        --server http://tuner:8000 --ray-address head-node:6379
    autotune fleet examples/mlp.py:task examples/gpt.py:task --device cpu --budget 8MiB,16MiB \\
        --server http://127.0.0.1:8765
    autotune fleet examples/gpt.py:task --gpu h100,a100-80gb --target-batch 512 --server http://tuner:8000

``--gpu`` makes each pair an estimate for a catalog card (``autotune estimate TASK --gpu NAME``, the card
emulated in a child process) on any node's CPU, instead of a probe on a GPU.

Ray is imported only when the command runs (``autotune.fleet.runner``), never by the parser.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.cli.common import EXIT_FAILED, TASK_HELP, CliError, non_negative_int, size, task_spec
from autotune.cli.policies import policies_of, with_policies
from autotune.cli.probe import add_probe_options, config_from_args

__all__ = ["PROBE_ONLY", "add_parsers", "budget_list", "card_list", "run_fleet_command"]

PROBE_ONLY = (
    ("presearch", False, "--no-presearch", "an estimate is fake trials only: there is no pre-search to skip"),
    ("throughput", False, "--no-throughput", "fake trials are not timed: an estimate has no timed run"),
    ("objective", "throughput", "--objective throughput", "fake trials are not timed: estimates compare by memory"),
)
"""Options of a probe that an estimate (``--gpu``) has no use for: (dest, value given, flag, why)."""


def budget_list(text: str) -> list[int]:
    """``"8MiB,16MiB"`` -> bytes of each: every budget makes its own pairs."""
    parts = [part.strip() for part in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: empty budget in the list (use 8MiB,16MiB)")
    return [size(part) for part in parts]


def card_list(text: str) -> list[str]:
    """``"h100,a100-80gb"`` -> the catalog's short names; a name the catalog does not know is kept as written,
    for ``--gpu-memory`` to describe (:func:`_cards`: without it, one line naming the known cards)."""
    from autotune.core.cards import lookup

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{text!r} names no card (e.g. h100,a100-80gb; `autotune gpus` lists them)")
    found = []
    for name in names:
        try:
            found.append(lookup(name).short_name)
        except ValueError:
            found.append(name)
    return list(dict.fromkeys(found))


def add_parsers(sub: Any) -> None:
    # "resolve": --budget below replaces probe's single budget with a list of them.
    p = sub.add_parser(
        "fleet",
        help="probe tasks on every GPU kind (or budget) as Ray tasks and upload the profiles",
        conflict_handler="resolve",
    )
    p.add_argument("tasks", nargs="+", metavar="TASK", help=TASK_HELP)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--accelerators", help="Ray accelerator types, one GPU of each per task: H100,A100,L4")
    where.add_argument("--device", choices=["cpu", "cuda"], help="any node's CPU (needs --budget) or any GPU")
    where.add_argument(
        "--gpu",
        type=card_list,
        metavar="CARDS",
        help="estimates, not probes: catalog cards (h100,a100-80gb; `autotune gpus`), each emulated on any "
        "node's CPU as `autotune estimate --gpu` does, its memory the default budget",
    )
    add_probe_options(p)
    p.add_argument(
        "--gpu-memory",
        type=size,
        metavar="BYTES",
        help="with --gpu naming one card: its memory (e.g. 96GiB), for a card the catalog lacks or one with other "
        "memory, as `autotune estimate --gpu NAME --gpu-memory` takes it",
    )
    p.add_argument(
        "--context-bytes",
        type=size,
        metavar="BYTES",
        help="with --gpu: memory outside the caching allocator (CUDA context and modules); default the "
        "store's measurement on the card (--server), else the catalog's",
    )
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
    from autotune.fleet import ProfileSink, Progress, run_fleet

    if args.server is None and args.output is None:
        raise CliError("nowhere to keep the profiles: give --server URL and/or --output DIR")
    if not args.working_dir.is_dir():
        raise CliError(f"--working-dir {str(args.working_dir)!r} is not a directory")
    pairs = with_policies(_estimate_pairs(args) if args.gpu else _probe_pairs(args), policies_of(args))
    _check_tasks(args)
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


def _probe_pairs(args: argparse.Namespace) -> list[Any]:
    """--accelerators / --device: one probe per task × GPU kind (or device) × budget."""
    from autotune.fleet import make_pairs, parse_accelerators

    if args.context_bytes is not None:
        raise CliError("--context-bytes applies to estimates for cards: name them with --gpu")
    if getattr(args, "moe_load_factor", None) is not None:
        # A probe pair's worker runs its real trials with the model's own routing and no option carries the
        # factor there: accepting it would drop it silently.
        raise CliError(
            "--moe-load-factor applies to fleet estimates for cards (--gpu): a probe pair measures the model's own "
            "routing with real trials"
        )

    def config_for(device: str, budget: int | None) -> Any:
        config = config_from_args(argparse.Namespace(**{**vars(args), "budget": budget}), device)
        config.validate()  # a bad option fails here, before any cluster time is spent
        return config

    return make_pairs(
        [task_spec(spec, args) for spec in args.tasks],
        accelerators=parse_accelerators(args.accelerators) if args.accelerators else None,
        device=args.device,
        budgets=args.budget or [None],
        config_for=config_for,
        working_dir=args.working_dir,
    )


def _estimate_pairs(args: argparse.Namespace) -> list[Any]:
    """--gpu: one estimate per task × card × budget, each on a CPU, as `autotune estimate --gpu` makes it."""
    from autotune.fleet import EstimateOptions, make_pairs

    _refuse_probe_only(args)
    return make_pairs(
        [task_spec(spec, args) for spec in args.tasks],
        accelerators=None,
        device=None,
        cards=_cards(args),
        budgets=args.budget or [None],
        config_for=_estimate_config_for(args),
        working_dir=args.working_dir,
        estimate=EstimateOptions(seq_lens=tuple(args.seq_len or ()), moe_load_factor=args.moe_load_factor),
    )


def _cards(args: argparse.Namespace) -> list[str]:
    """The cards of --gpu: catalog cards, or with --gpu-memory one card described by its name and memory (the
    closest catalog card's architecture, as `autotune estimate --gpu-memory` takes it)."""
    from autotune.core.cards import resolve_card
    from autotune.core.errors import AutotuneError
    from autotune.fleet.pairs import parse_cards

    if args.gpu_memory is None:
        try:
            return parse_cards(",".join(args.gpu))
        except AutotuneError as exc:
            raise CliError(str(exc)) from None
    if len(args.gpu) != 1:
        raise CliError(
            f"--gpu-memory is one card's memory: --gpu names {len(args.gpu)} cards ({', '.join(args.gpu)}); "
            "run one fleet per card memory"
        )
    try:
        resolve_card(args.gpu[0], args.gpu_memory)
    except ValueError as exc:
        raise CliError(f"--gpu {args.gpu[0]!r} --gpu-memory {args.gpu_memory}: {exc}") from None
    return list(args.gpu)


def _refuse_probe_only(args: argparse.Namespace) -> None:
    """One line for the first probe-only option given with --gpu, before any cluster time is spent."""
    for dest, given, flag, why in PROBE_ONLY:
        if getattr(args, dest) == given:
            raise CliError(f"{flag} is a probe's option, not an estimate's (--gpu): {why}")
    # The card estimate over lengths (autotune estimate --gpu --seq-len) answers at the lengths given and
    # plans --target-batch there: it has no search for the longest length, nor a plan in tokens.
    if args.target_tokens is not None:
        raise CliError("--target-tokens is not planned by estimates for cards (--gpu): give --target-batch")
    if args.max_seq_len is not None:
        raise CliError("--max-seq-len: estimates for cards (--gpu) answer at the --seq-len lengths only")


def _estimate_config_for(args: argparse.Namespace) -> Callable[[str, int | None], Any]:
    """``(card, budget) -> EstimateConfig`` as `autotune estimate --gpu CARD` builds it from the same flags
    (its name and memory from the catalog, the memory outside the allocator as the store measured it)."""
    from autotune.cli.estimate import estimate_config, measured_context

    outside: dict[str, tuple[int | None, str | None]] = {}

    def config_for(card: str, budget: int | None) -> Any:
        config = estimate_config(args, budget_bytes=budget, gpu=card)
        if card not in outside:  # the store is asked once per card, not once per budget
            measured = measured_context(config, args)
            outside[card] = (measured.context_bytes, measured.context_source)
        context_bytes, context_source = outside[card]
        config = dataclasses.replace(config, context_bytes=context_bytes, context_source=context_source)
        config.validate()  # a bad option fails here, before any cluster time is spent
        return config

    return config_for


def _check_tasks(args: argparse.Namespace) -> None:
    """Every policy applies to every task, and --moe-load-factor to an estimate's, checked on the driver
    before any cluster time is spent (each task is loaded here only when one of them is given)."""
    moe = args.gpu and args.moe_load_factor is not None
    if not args.ac and not moe:
        return
    from autotune.cli.policies import check_policies
    from autotune.cli.probe import moe_routing_of
    from autotune.tasks.load import load_task

    for spec in args.tasks:
        task = load_task(task_spec(spec, args))
        if args.ac:
            check_policies(task, args.ac)
        if moe:
            moe_routing_of(task, args)
