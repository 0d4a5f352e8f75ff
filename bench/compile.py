"""Compiled against eager on the CPU (issue 35): for the examples and two transformers configs, the probe's
m_max eager and compiled, the peaks at the compiled m_max (eager: the CPU allocator's own count of an ordinary
training step; compiled: the probe's trial, and the allocator's count of the model compiled the ordinary way,
torch.compile + the same step, at m_max and m_max + 1), the eager fake pre-search's m_max against the compiled
real one (the bound the datasheet's estimate carries), trial counts and seconds with compilation apart, and the
static confirmation's line (what the dynamic search read at m_max and m_max + 1, the static compilations' seconds).

    .venv/bin/python bench/compile.py            # every case (compiles: minutes on a 2-core machine)
    .venv/bin/python bench/compile.py gpt hf-gpt2 # some of them

Nothing here is a test: it prints figures.
"""

from __future__ import annotations

import gc
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from autotune.orchestrate.config import ProbeConfig  # noqa: E402
from autotune.orchestrate.probe import probe  # noqa: E402
from autotune.tasks.load import load_task  # noqa: E402
from autotune.tasks.task import ProbeTask  # noqa: E402

MIB = 1 << 20


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _cases() -> list[tuple[str, Any, float]]:
    """(name, task, budget in MiB): the examples at their middle CPU budget, and GPT-2 / BERT configs
    (transformers' gelu_new and BERT's erf GELU) at small sizes."""
    cases: list[tuple[str, Any, float]] = [
        ("mlp", load_task(str(ROOT / "examples/mlp.py") + ":task"), 2.0),
        ("gpt", load_task(str(ROOT / "examples/gpt.py") + ":task"), 12.0),
        ("cnn", load_task(str(ROOT / "examples/cnn.py") + ":task"), 8.0),
    ]
    try:
        from _hf_tasks import bert, gpt2
    except ImportError as exc:  # transformers is in the hf extra
        print(f"# hf cases skipped: {exc}")
        return cases
    cases += [("hf-gpt2", gpt2, 24.0), ("hf-bert", bert, 24.0)]
    return cases


def allocator_peak(task: ProbeTask, m: int, *, compiled: bool) -> int:
    """The CPU allocator's peak (torch.profiler memory events, summed in order) over an ordinary build,
    torch.compile when asked (its first call compiles, at m), and two steps of two accumulated micro-batches."""
    torch._dynamo.reset()
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = task.model()
        model.train()
        run: nn.Module = torch.compile(model) if compiled else model  # type: ignore[assignment]
        optimizer = task.make_optimizer(model.parameters())
        for _ in range(2):
            for _ in range(2):
                batch = task.batch(m)
                (task.compute_loss(run, batch) / 2).backward()
                del batch
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, run, optimizer
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]  # type: ignore[union-attr]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def _row(name: str, task: ProbeTask, budget_mib: float) -> None:
    import dataclasses

    config = ProbeConfig(device="cpu", budget_bytes=int(budget_mib * MIB), headroom=0.10, throughput=False)
    torch._dynamo.reset()
    started = time.perf_counter()
    eager = probe(dataclasses.replace(task, compile=None), config)
    eager_seconds = time.perf_counter() - started
    torch._dynamo.reset()
    compiled = probe(dataclasses.replace(task, compile="default"), config)
    real = {t.micro_batch: t for t in compiled.trials if not t.fake}
    fake = [t for t in compiled.trials if t.fake]
    m = compiled.max_micro_batch
    # The pre-search ran the eager model: its answer is in its warning where the real trials differ from it.
    said = [w for w in compiled.warnings if "fake pre-search predicted max micro-batch" in w]
    fake_m = int(said[0].split("max micro-batch ")[1].split(";")[0]) if said else m
    eager_at_m = allocator_peak(task, m, compiled=False)
    truth = {k: allocator_peak(task, k, compiled=True) for k in (m, m + 1) if k in real}
    exact = all(real[k].peak_bytes == v for k, v in truth.items())
    trial_seconds = sum(t.seconds for t in real.values())
    # The static confirmation's line (autotune/search/static.py: confirm_static): its trials decided, what
    # the dynamic search read at those sizes, and its compilations' seconds.
    confirmation = next((w for w in compiled.warnings if w.startswith("static confirmation")), "no static confirmation")
    print(
        f"{name:8} {budget_mib:5.1f}MiB  m_max eager {eager.max_micro_batch:4d}  compiled {m:4d}  "
        f"(the eager fake pre-search's estimate: {fake_m})"
    )
    print(
        f"          at m={m}: eager {eager_at_m:,} B, compiled trial {real[m].peak_bytes:,} B "
        f"({100 * (real[m].peak_bytes - eager_at_m) / eager_at_m:+.1f} %); allocator, compiled ordinary: "
        + ", ".join(f"m={k} {v:,} B" for k, v in truth.items())
        + f"  -> {'EXACT' if exact else 'DIFFERS'}"
        + (f" (probe m={m + 1}: {real[m + 1].peak_bytes:,} B)" if m + 1 in real else "")
    )
    print(
        f"          trials: eager {eager.trial_count} real in {eager_seconds:.1f}s; compiled {compiled.trial_count} "
        f"real ({len(fake)} fake) in {compiled.seconds:.1f}s of which compilation {compiled.compile_seconds:.1f}s, "
        f"trials {trial_seconds:.1f}s"
    )
    print(f"          {confirmation}")


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    print(f"# torch {torch.__version__}, {os.cpu_count()} CPUs; headroom 10 %")
    for name, task, budget in _cases():
        if argv and name not in argv:
            continue
        _row(name, task, budget)
        sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
