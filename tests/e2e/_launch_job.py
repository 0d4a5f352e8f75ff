"""A training job's launch, as its own process: build the model, ask ``suggest``, print the answer.

    python tests/e2e/_launch_job.py MODEL TARGET_BATCH [--budget 8MiB] [--tag NAME] [--forbid-trials]

MODEL is ``mlp`` (examples/mlp.py's model, which ``autotune probe examples/mlp.py:task`` measures)
or ``wide`` (a model nobody has probed); ``--tag NAME`` makes the setup another one (tags enter the
fingerprint). The server comes from $AUTOTUNE_URL, as in a real job.
With ``--forbid-trials`` every way into a measurement is replaced by a sentinel that counts the
call and fails the job, so a job that printed ``"trials_attempted": 0`` provably measured nothing.
Any TunerUnavailableWarning is an error: the job must have used the server.
Prints one JSON line: {"suggestion": {...}, "trials_attempted": N}.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from typing import Any, NoReturn

import torch
from torch import nn

import autotune.measure.trial
import autotune.orchestrate.probe
from autotune_client import TunerUnavailableWarning, suggest
from examples import mlp

WIDE_IN, WIDE_CLASSES = 96, 10


def wide_model() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDE_IN, 192), nn.ReLU(), nn.Linear(192, WIDE_CLASSES))


def wide_batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(m, WIDE_IN), torch.randint(0, WIDE_CLASSES, (m,))


attempts = 0


def _forbidden(*_args: Any, **_kwargs: Any) -> NoReturn:
    global attempts
    attempts += 1
    raise AssertionError("a measurement was started although the store had the answer")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", choices=["mlp", "wide"])
    parser.add_argument("target_batch", type=int)
    parser.add_argument("--budget")
    parser.add_argument("--tag")
    parser.add_argument("--forbid-trials", action="store_true")
    args = parser.parse_args()

    warnings.simplefilter("error", TunerUnavailableWarning)
    if args.forbid_trials:
        for module, name in (
            (autotune.orchestrate.probe, "probe"),
            (autotune.orchestrate.probe, "probe_with_meter"),
            (autotune.orchestrate.probe, "run_trial"),
            (autotune.measure.trial, "run_trial"),
        ):
            if hasattr(module, name):
                setattr(module, name, _forbidden)

    if args.model == "mlp":
        model: nn.Module = mlp.MLP()
        example: Any = mlp.task.batch
    else:
        model, example = wide_model(), wide_batch
    try:
        tags = {"variant": args.tag} if args.tag else None
        result = suggest(model, args.target_batch, example=example, budget=args.budget, tags=tags)
    finally:
        # Printed even when suggest failed, so that the test sees the count either way.
        print(json.dumps({"trials_attempted": attempts}), file=sys.stderr)
    print(json.dumps({"suggestion": result.model_dump(mode="json"), "trials_attempted": attempts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
