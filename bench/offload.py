"""What --offload buys and costs (docs/offload.md): the device's m_max and the host's bytes, with and without it.

Prints one line per setup, never pass/fail:

- the CPU probe of the 4-block tiny GPT at a 2 MiB budget: none, activations; fsdp x 2: none, params;
- with ``--gpu NAME`` (a catalog card; needs the CUDA build of torch, ``make .venv-cuda``): the gpt example
  estimated on the emulated card at ``--budget`` with and without ``--offload activations``.

    .venv/bin/python bench/offload.py
    .venv/bin/python bench/offload.py --gpu h100 --budget 2GiB
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.core.units import format_bytes, parse_bytes  # noqa: E402
from autotune.orchestrate.probe import ProbeConfig, probe  # noqa: E402
from examples.gpt import Block, GPTConfig, make_task  # noqa: E402

TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4)


def _host(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def cpu_table() -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), shard_classes=(Block,))
    setups = [("ddp", 1, None), ("ddp", 1, "activations"), ("fsdp", 2, None), ("fsdp", 2, "params")]
    print("CPU probe, gpt-tiny, budget 2 MiB")
    print(f"{'strategy':<10} {'offload':<12} {'m_max':>6} {'device at m_max':>16} {'host at m_max':>14} {'seconds':>8}")
    for strategy, world_size, offload in setups:
        config = ProbeConfig(
            device="cpu", budget_bytes=2 << 20, strategy=strategy, world_size=world_size, offload=offload
        )
        started = time.perf_counter()
        profile = probe(task, config)
        seconds = time.perf_counter() - started
        at_max = next(t for t in profile.trials if not t.fake and t.micro_batch == profile.max_micro_batch)
        print(
            f"{f'{strategy} x{world_size}':<10} {offload or 'none':<12} {profile.max_micro_batch:>6} "
            f"{format_bytes(at_max.peak_bytes):>16} {_host(profile.host_peak_bytes):>14} {seconds:>8.1f}"
        )


def card_table(gpu: str, budget: str) -> None:
    print(f"\nemulated {gpu}, gpt example, budget {budget} (autotune estimate --gpu)")
    for offload in ("none", "activations"):
        command = [
            str(REPO / ".venv" / "bin" / "autotune"), "estimate", "examples/gpt.py:task", "--gpu", gpu,
            "--budget", budget, "--offload", offload, "--json",
        ]  # fmt: skip
        started = time.perf_counter()
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
        seconds = time.perf_counter() - started
        if done.returncode != 0:
            print(f"{offload:<12} failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
            continue
        profile = json.loads(done.stdout)
        print(
            f"{offload:<12} m_max {profile['max_micro_batch']:>6}  host at m_max "
            f"{_host(profile.get('host_peak_bytes')):>11}  {seconds:6.1f}s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", help="a catalog card to estimate on (emulated)")
    parser.add_argument("--budget", default="2GiB", help="the emulated card's budget (default 2GiB)")
    args = parser.parse_args()
    cpu_table()
    if args.gpu:
        parse_bytes(args.budget)  # a size, or the line that says why not
        card_table(args.gpu, args.budget)


if __name__ == "__main__":
    main()
