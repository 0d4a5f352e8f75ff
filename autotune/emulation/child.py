"""The child process of an emulated card: ``python -m autotune.emulation.child REQUEST RESULT``.

Started by autotune/emulation/runner.py with the emulation in its environment (LD_PRELOAD, the card's
variables) and a CUDA build of torch. It reads a JSON request, does one job (``check``: what the
device reports; ``trials``: fake trials of a task at given sizes) and writes a JSON result; a failure
is written as one line under ``error``. Its stdout and stderr (torch's warnings, the emulation's lines)
go to a file the parent reads, never to the user's terminal.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

__all__ = ["main", "prepare_fake_cuda"]


def prepare_fake_cuda() -> None:
    """What a fake trial on the emulated card needs of torch, before any fake tensor is made.

    - ``FakeTensorMode.avoid_device_init``: with CUDA available, fake mode would initialize the device
      and constant-propagate tensors moved to it by computing them there: on an emulated card, real
      allocations. Fake tensors never need the device.
    - The optimizers pick their ``foreach`` (and ``fused``) paths only for parameters whose type is a
      plain Tensor or Parameter; a fake parameter is a FakeTensor, so without it every fake trial takes
      the for-loop path that a real CUDA job would not. ``clip_grad_norm_`` has a list of its own.
    """
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.optim.optimizer import _foreach_supported_types as optimizer_types
    from torch.utils._foreach_utils import _foreach_supported_types as clip_types

    FakeTensorMode.avoid_device_init = property(lambda self: True)  # type: ignore[assignment,method-assign]
    for supported in (optimizer_types, clip_types):
        if FakeTensor not in supported:
            supported.append(FakeTensor)


def _device() -> dict[str, Any]:
    """What torch reads of the device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("torch.cuda.is_available() is False under the emulation")
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": list(torch.cuda.get_device_capability(0)),
        "total_bytes": int(props.total_memory),
        "sm_count": int(props.multi_processor_count),
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
    }


def _check() -> dict[str, Any]:
    """What the emulated device reports, and a fake step on it that goes through autograd (the
    engine's stream stash needs the driver's primary context) and an optimizer."""
    import torch

    found = _device()
    prepare_fake_cuda()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        layer = torch.nn.Linear(8, 8, device="cuda")
        optimizer = torch.optim.AdamW(layer.parameters())
        layer(torch.randn(2, 8, device="cuda")).sum().backward()
        optimizer.step()
    return found


@contextmanager
def _recording_ops(ops: dict[str, set[str]]) -> Iterator[None]:
    """Note every op the fake meter's counting mode dispatches, with the dtypes of what it returned
    (this process's own class is wrapped, for as long as the block runs)."""
    import torch
    from torch.utils._pytree import tree_flatten

    from autotune.measure.meters.fake import _FakeCountingMode

    original = _FakeCountingMode.__torch_dispatch__

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = original(self, func, types, args, kwargs)
        dtypes = ops.setdefault(str(func), set())
        for leaf in tree_flatten(out)[0]:
            if isinstance(leaf, torch.Tensor):
                dtypes.add(str(leaf.dtype).removeprefix("torch."))
        return out

    _FakeCountingMode.__torch_dispatch__ = dispatch  # type: ignore[method-assign]
    try:
        yield
    finally:
        _FakeCountingMode.__torch_dispatch__ = original  # type: ignore[method-assign]


def _renumbered(held: list[tuple[int, int]], events: list[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Keys as small integers, one per allocation in order (a storage's address can come back for
    another storage once freed), so that traces compare across runs."""
    ids: dict[int, int] = {}
    counter = 0

    def allocate(key: int) -> int:
        nonlocal counter
        counter += 1
        ids[key] = counter
        return counter

    out_held = [[allocate(key), nbytes] for key, nbytes in held]
    out_events = []
    for key, nbytes in events:
        if nbytes < 0:
            # 0 is no allocation's id: a release of a storage the recording never saw shows as one.
            out_events.append([ids.pop(key, 0), nbytes])
        else:
            out_events.append([allocate(key), nbytes])
    return out_held, out_events


def _trials(request: dict[str, Any]) -> dict[str, Any]:
    import torch

    prepare_fake_cuda()
    from autotune.core.schemas import MAX_BYTES
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.strategies import make_strategy
    from autotune.measure.trial import TrialRunner, frozen_heap
    from autotune.search.presearch import fake_strategy
    from autotune.tasks.load import load_task

    task = load_task(request["task"])
    changes = {
        key: request[key] for key in ("precision", "activation_checkpointing") if request.get(key) is not None
    }
    if changes:
        task = dataclasses.replace(task, **changes)
    if request.get("seq_len") is not None:
        task = task.at_length(int(request["seq_len"]))
    budget = int(request.get("budget_bytes") or MAX_BYTES)
    ops: dict[str, set[str]] = {}
    device_name = _device()["name"]
    meter = FakeMeter(budget, "cuda", device_name)
    strategy = fake_strategy(make_strategy(request["strategy"], int(request["world_size"])))
    results = []
    torch.set_num_threads(1)  # fake tensors compute nothing
    recording: AbstractContextManager[Any] = _recording_ops(ops) if request.get("record_ops") else nullcontext()
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
                held, events = _renumbered(recorded.held, recorded.events)
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
                        "ops": {name: sorted(dtypes) for name, dtypes in sorted(ops.items())},
                    }
                )
        finally:
            runner.close()
    return {"task": task.name, "device": _device(), "trials": results, "warnings": runner.warnings}


def _one_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [""])[0]
    from autotune.core.errors import AutotuneError

    return first if isinstance(exc, AutotuneError) else f"{type(exc).__name__}: {first}"


def main(argv: list[str]) -> int:
    request_path, result_path = Path(argv[0]), Path(argv[1])
    request = json.loads(request_path.read_text())
    warnings.simplefilter("ignore")  # torch's warnings would only reach the log file
    try:
        result = _check() if request["job"] == "check" else _trials(request)
    except BaseException as exc:  # the parent gets one line, whatever happened
        result = {"error": _one_line(exc)}
    result_path.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
