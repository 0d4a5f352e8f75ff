"""What every command of the CLI shares: argument types, the one-line parser, exit codes."""

from __future__ import annotations

import argparse
from typing import Any

from autotune.plan import PLAN_POLICIES
from autotune.schemas import STRATEGIES
from autotune.units import parse_bytes

__all__ = [
    "EXIT_FAILED",
    "EXIT_USAGE",
    "CliError",
    "Parser",
    "add_strategy_and_plan_options",
    "add_task_options",
    "headroom",
    "non_negative_int",
    "positive_int",
    "size",
    "task_spec",
]

EXIT_USAGE = 2
EXIT_FAILED = 1


class CliError(Exception):
    """A user mistake caught by the CLI itself (bad flag values)."""


def _integer(text: str, lowest: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "zero or more")


def size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"headroom must be in [0, 1), got {text}")
    return value


def add_strategy_and_plan_options(p: argparse.ArgumentParser) -> None:
    """--strategy and --plan, as every command that measures or plans takes them."""
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="ddp (default: each replica holds the whole model) or fsdp (FSDP2: rank 0 of --world-size)",
    )
    p.add_argument(
        "--plan",
        choices=PLAN_POLICIES,
        default="balanced",
        help="balanced (default: the fewest steps, micro-batches within one of each other, "
        "e.g. 6x26 + 4x25 = 256) or divisor (equal micro-batches, e.g. 16x16)",
    )


def add_task_options(p: argparse.ArgumentParser) -> None:
    """--optimizer and --lr: what an hf: task trains with (a task file's ProbeTask brings its own)."""
    p.add_argument(
        "--optimizer",
        metavar="CLASS",
        help="hf: tasks: a torch.optim class (AdamW, SGD, ...) or package.module.Class (default AdamW)",
    )
    p.add_argument("--lr", type=float, metavar="LR", help="hf: tasks: the optimizer's learning rate")


def task_spec(spec: str, args: argparse.Namespace) -> str:
    """The spec with --optimizer/--lr written into it, so that it alone rebuilds the task elsewhere
    (``--device all`` children, fleet workers). Raises TaskError for a spec that is not hf:."""
    from autotune.hf_task import with_options

    return with_options(spec, optimizer=getattr(args, "optimizer", None), lr=getattr(args, "lr", None))


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2, like every other usage error
        self.exit(EXIT_USAGE, f"autotune: error: {message}\n")
