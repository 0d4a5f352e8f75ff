"""Inductor's CPU kernels vectorized (a user's default) against scalar (``TORCHINDUCTOR_VEC_ISA_OK=0``, what the
suite sets in tests/conftest.py to halve its cold compiles): the CPU allocator's peak over the same compiled work is
the same byte for byte, because the kernels' instruction set changes how a buffer is computed, not which buffers
the generated wrapper allocates. Each case runs in a fresh process with a fresh inductor cache, so the seconds are
cold compiles, as on a fresh CI machine.

    .venv/bin/python bench/inductor_scalar_kernels.py

Cases: a two-block GPT with transformers' gelu_new compiled by torch.compile and stepped twice with AdamW at m = 4
and m = 8 (test_compile's truth), and torchao's AdamW4bit stepping a model whose matrices hold 4-bit states
(torchao compiles its step per parameter shape). Nothing here is a test: it prints figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, math, sys, time
import torch
from torch import nn
from torch.nn import functional as F
from torch.profiler import ProfilerActivity, profile

case, m = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.ln, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.proj(gelu_new(self.fc(self.ln(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.tok(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


started = time.perf_counter()
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    if case == "compiled-gpt":
        model = TinyGPT(128, 32)
        run = torch.compile(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:  # torchao's 4-bit AdamW: states quantized where a parameter has 4096 elements or more
        from torchao.optim import AdamW4bit

        model = TinyGPT(256, 64)
        run = model
        optimizer = AdamW4bit(model.parameters(), lr=1e-3)
    for _ in range(2):
        ids = torch.randint(0, model.tok.num_embeddings, (m, 32), generator=torch.Generator().manual_seed(m))
        F.cross_entropy(run(ids).flatten(0, 1), ids.flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
live = peak = 0
for event in sorted(events, key=lambda e: e.start_ns()):
    live += event.nbytes()
    peak = max(peak, live)
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
            [sys.executable, "-c", CHILD, case, str(micro_batch)], env=env, capture_output=True, text=True, check=False
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
