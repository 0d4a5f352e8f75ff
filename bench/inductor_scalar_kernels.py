"""Inductor's CPU kernels vectorized (a user's default) against scalar (``TORCHINDUCTOR_VEC_ISA_OK=0``, what the
suite sets in tests/conftest.py to halve its cold compiles): the CPU allocator's peak over the same compiled work is
the same byte for byte, because the kernels' instruction set changes how a buffer is computed, not which buffers
the generated wrapper allocates. Each case runs in a fresh process with a fresh inductor cache, so the seconds are
cold compiles, as on a fresh CI machine.

    .venv/bin/python bench/inductor_scalar_kernels.py

Cases: test_compile's truth (a two-block GPT with transformers' gelu_new compiled by torch.compile, two accumulated
AdamW steps) at m = 4 and m = 8, and test_optimizer_specs' adamw4bit truth (torchao compiles its step per parameter
shape) at m = 4: the child calls the suite's own functions. Nothing here is a test: it prints figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The child measures the very truths the suite asserts (no model or loop of its own): test_compile's
# allocator_peak_once (a two-block GPT with gelu_new, torch.compile'd, two accumulated AdamW steps) and
# test_optimizer_specs' adamw4bit truth (tests/autotune/_allocator_truth.py over examples/gpt.py's one-block GPT
# stepped by torchao's own AdamW4bit).
CHILD = r"""
import json, sys, time
from types import SimpleNamespace

sys.path.insert(0, sys.argv[3])
case, m = sys.argv[1], int(sys.argv[2])
started = time.perf_counter()
if case == "compiled-gpt":
    from tests.autotune.test_compile import allocator_peak_once

    peak = allocator_peak_once(m, compiled=True)[0]
else:  # torchao's 4-bit AdamW
    from examples.gpt import GPT, make_task
    from tests.autotune._allocator_truth import allocator_peak_bytes
    from tests.autotune._ordinary_optimizers import ORDINARY
    from tests.autotune.test_optimizer_specs import TINY

    task = make_task(TINY)
    ordinary = SimpleNamespace(
        model=lambda: GPT(TINY), batch=task.batch, compute_loss=task.compute_loss, shard_classes=None,
        make_optimizer=ORDINARY["adamw4bit"],
    )
    peak = allocator_peak_bytes(ordinary, m)
print(json.dumps({"peak_bytes": peak, "seconds": time.perf_counter() - started}))
"""


def run(case: str, micro_batch: int, *, scalar: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1"}
        env["OMP_NUM_THREADS"] = "1"
        env.pop("TORCHINDUCTOR_VEC_ISA_OK", None)
        if scalar:
            env["TORCHINDUCTOR_VEC_ISA_OK"] = "0"
        done = subprocess.run(
            [sys.executable, "-c", CHILD, case, str(micro_batch), str(ROOT)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{case} m={micro_batch}: {done.stderr.strip().splitlines()[-1]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def main() -> None:
    print(
        f"{'case':<16} {'m':>3} {'vectorized peak B':>18} {'scalar peak B':>14} {'equal':>6} {'cold s vec':>11} "
        f"{'cold s scalar':>14}"
    )
    started = time.perf_counter()
    for case, micro_batch in (("compiled-gpt", 4), ("compiled-gpt", 8), ("adamw4bit", 4)):
        vectorized = run(case, micro_batch, scalar=False)
        scalar = run(case, micro_batch, scalar=True)
        equal = "yes" if vectorized["peak_bytes"] == scalar["peak_bytes"] else "NO"
        print(
            f"{case:<16} {micro_batch:>3} {int(vectorized['peak_bytes']):>18,} {int(scalar['peak_bytes']):>14,} "
            f"{equal:>6} {vectorized['seconds']:>11.1f} {scalar['seconds']:>14.1f}"
        )
    print(f"({time.perf_counter() - started:.0f} s in all)")


if __name__ == "__main__":
    main()
