"""The child process of an emulated card: ``python -m autotune.emulation.child REQUEST RESULT``.

Started by autotune/emulation/runner.py with the emulation in its environment (LD_PRELOAD, the card's
variables) and a CUDA build of torch. It reads a JSON request, does one job (``check``: what the
device reports; ``trials``: fake trials of a task at given sizes; ``search``: the search of
card_search.py) and writes a JSON result; a failure
is written as one line under ``error``. Its stdout and stderr (torch's warnings, the emulation's lines)
go to a file the parent reads, never to the user's terminal.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from autotune.emulation.fake_cuda import device_facts, prepare_fake_cuda, recording_ops

__all__ = ["main"]


def _check() -> dict[str, Any]:
    """What the emulated device reports, and a fake step on it that goes through autograd (the
    engine's stream stash needs the driver's primary context) and an optimizer."""
    import torch

    found = device_facts()
    prepare_fake_cuda()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = torch.nn.Linear(8, 8, device="cuda")
        optimizer = torch.optim.AdamW(layer.parameters())
        layer(torch.randn(2, 8, device="cuda")).sum().backward()
        optimizer.step()
    return found


def _trials(request: dict[str, Any]) -> dict[str, Any]:
    import torch

    prepare_fake_cuda()
    from autotune.core.schemas import MAX_BYTES
    from autotune.core.setup import JobSetup
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.strategy_choice import make_strategy
    from autotune.measure.trial import TrialRunner, frozen_heap
    from autotune.search.presearch import fake_strategy
    from autotune.search.reserved import renumbered
    from autotune.tasks.load import load_task

    job = JobSetup.model_validate(request["setup"])
    task = load_task(request["task"]).with_setup(job)
    if request.get("seq_len") is not None:
        task = task.at_length(int(request["seq_len"]))
    budget = int(request.get("budget_bytes") or MAX_BYTES)
    ops: dict[str, set[str]] = {}
    device_name = device_facts()["name"]
    meter = FakeMeter(budget, "cuda", device_name)
    strategy = fake_strategy(make_strategy(job.strategy, job.world_size, job.mesh))
    results = []
    torch.set_num_threads(1)  # fake tensors compute nothing
    recording: AbstractContextManager[Any] = recording_ops(ops) if request.get("record_ops") else nullcontext()
    with strategy.process_group(meter.device), frozen_heap(), recording:
        runner = TrialRunner(task, meter, limit_bytes=budget, strategy=strategy)
        try:
            runner.build()
            for micro_batch in request["micro_batches"]:
                ops.clear()
                meter.release()
                started = time.perf_counter()
                with meter.record_events() as recorded:
                    trial = runner(int(micro_batch))
                held, events, streams = renumbered(recorded.held, recorded.events, recorded.streams)
                results.append(
                    {
                        "micro_batch": trial.micro_batch,
                        "peak_bytes": trial.peak_bytes,
                        "forward_backward_bytes": trial.forward_backward_bytes,
                        "step_bytes": trial.step_bytes,
                        "oom": trial.oom,
                        "seconds": round(time.perf_counter() - started, 6),
                        "held": held,
                        "events": events,
                        "streams": sorted(streams.items()),
                        "ops": {name: sorted(dtypes) for name, dtypes in sorted(ops.items())},
                    }
                )
        finally:
            runner.close()
    return {"task": task.name, "device": device_facts(), "trials": results, "warnings": runner.warnings}


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    from autotune.core.errors import AutotuneError

    return first if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {first}"


def main(argv: list[str]) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text())
    warnings.simplefilter("ignore")  # torch's warnings would only reach the log file
    try:
        if request["job"] == "search":
            from autotune.emulation.card_search import child_search

            result = child_search(request)
        else:
            result = _check() if request["job"] == "check" else _trials(request)
    except BaseException as exc:  # the parent gets one line, whatever happened
        result = {"error": _one_line(exc)}
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
