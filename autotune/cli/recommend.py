"""`autotune recommend PROFILE.json ...`: the setup and plan that hold the target best, among profiles of one
job probed (or estimated) in different setups: memory policies, optimizers, offload, quantization
(autotune/core/recommend.py). Torch-free.

    autotune probe task.py:task --budget 20GiB --target-batch 256 --output none.json
    autotune probe task.py:task --budget 20GiB --target-batch 256 --ac op --optimizer adamw8bit --output op8.json
    autotune recommend none.json op8.json --objective throughput
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from autotune.cli.common import CliError
from autotune.core.schemas import OBJECTIVES

__all__ = ["add_parsers", "run_recommend"]


def add_parsers(sub: Any) -> None:
    r = sub.add_parser(
        "recommend",
        help="the setup and plan that hold the target best among profiles of one job in different setups",
    )
    r.add_argument("profiles", nargs="+", type=Path, metavar="PROFILE.json", help="profiles (--output files)")
    r.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="throughput",
        help="throughput (default: the most samples per second where timed, else the stated ordering: the "
        "fewest steps, then the least extra work) or memory (the fewest steps, the largest micro-batch)",
    )
    r.set_defaults(run=run_recommend)


def _read(path: Path) -> list[Any]:
    from pydantic import ValidationError

    from autotune.core.schemas import Profile

    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CliError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise CliError(f"{path}: not JSON ({exc})") from None
    try:
        return [Profile.model_validate(item) for item in (data if isinstance(data, list) else [data])]
    except ValidationError as exc:
        raise CliError(
            f"{path}: not a profile ({exc.error_count()} errors, the first at {exc.errors()[0]['loc']})"
        ) from None


def run_recommend(args: argparse.Namespace) -> int:
    from autotune.cli.policies import recommendation

    profiles = [profile for path in args.profiles for profile in _read(path)]
    devices = sorted({profile.device.name for profile in profiles})
    if len(devices) > 1:
        raise CliError(f"the profiles are of different devices ({', '.join(devices)}): compare setups on one device")
    targets = sorted({profile.plan.target_batch for profile in profiles if profile.plan is not None})
    if len(targets) > 1:
        raise CliError(f"the profiles plan different targets ({', '.join(map(str, targets))}): probe them for one")
    lengths = sorted({profile.seq_len for profile in profiles}, key=lambda length: length or 0)
    for length in lengths:
        at_length = [profile for profile in profiles if profile.seq_len == length]
        line = recommendation(at_length, args.objective)
        print(line if length is None or len(lengths) == 1 else f"at L={length}: {line}")
    return 0
