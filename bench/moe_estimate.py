"""A Mixtral-8x7B-shaped config estimated at L = 4096 under fsdp x 8 on an 80 GiB budget, with fake tensors on
this CPU: m_max, seconds and peak RSS (target: under 5 minutes and 4 GiB on a 2-core machine).

    .venv/bin/python bench/moe_estimate.py [--load-factor F]
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from autotune.core.errors import CannotFitError
from autotune.measure.meters.fake import moe_routing
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.tasks.load import load_task

MIXTRAL_8X7B = {
    "model_type": "mixtral",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
}
GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load-factor", type=float, default=1.0)
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args()
    where = Path(tempfile.mkdtemp()) / "mixtral-8x7b"
    where.mkdir()
    (where / "config.json").write_text(json.dumps(MIXTRAL_8X7B))
    started = time.perf_counter()
    task = load_task(f"hf:{where}").at_length(args.seq_len)
    config = EstimateConfig.of(
        budget_bytes=80 * GiB, device_kind="cuda", precision="bf16", strategy="fsdp", world_size=8, target_batch=64
    )
    try:
        with moe_routing(args.load_factor):
            profile = estimate(task, config)
    except CannotFitError as exc:  # without checkpointing, m = 1 at L = 4096 needs ~175 GiB per rank
        rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
        print(f"{exc}\n  {time.perf_counter() - started:.1f} s, peak RSS {rss_gib:.2f} GiB")
        return
    seconds = time.perf_counter() - started
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GiB
    peaks = {t.micro_batch: t.peak_bytes for t in profile.trials}
    where_run = f"{task.name} L={args.seq_len} fsdp x8 80 GiB, load factor {args.load_factor}"
    print(f"{where_run}: m_max {profile.max_micro_batch}")
    print(f"  fake trials {len(profile.trials)}, peak at m_max {peaks.get(profile.max_micro_batch, 0) / GiB:.2f} GiB")
    print(f"  {seconds:.1f} s, peak RSS {rss_gib:.2f} GiB")


if __name__ == "__main__":
    main()
