"""Pipelines over fsdp and tp against real ranks (issue 34): the probe's stages beside a real gloo job's ranks.

    nice .venv/bin/python bench/pipeline_meshes.py                 # fsdp 2 x tp 2 x pp 2: 8 processes, ~75 s
    nice .venv/bin/python bench/pipeline_meshes.py --world-size 4 --tp 2 --strategy ddp   # pp 2 x tp 2

The real job is tests/autotune/_pipeline_fsdp_worker.py (torchtitan's build: a (pp, dp, tp) mesh, each stage's blocks
parallelize_module-d over tp, then fully_shard-ed over dp, PipelineStage + Schedule1F1B, K 2, two steps; two runs per
size after a warm-up, gloo's collectives fenced: tests/autotune/_ordered_gloo.py); the probe's side is
autotune/measure/pipeline/stages.py's ShardedStage on the CPU meter and on fake trials. Too slow for the test suite on
2 cores (tests/autotune/test_pipeline_fsdp.py runs pp x fsdp and pp x tp at 4 processes). Prints each rank's figures,
every run's, and whether each stage equals its ranks."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.multiprocessing as mp

    from autotune.core.mesh import Mesh
    from autotune.measure.meters import CpuMeter
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.pipeline import PipelineTrials
    from autotune.measure.strategy_choice import make_strategy
    from autotune.tasks.task import ProbeTask
    from tests.autotune import _pipeline_fsdp_worker as worker

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--strategy", choices=("ddp", "fsdp"), default="fsdp")
    args = parser.parse_args(argv)
    stages, k, sizes = 2, 2, [2, 3]
    with tempfile.TemporaryDirectory() as folder:
        started = time.perf_counter()
        mp.spawn(
            worker.run,
            args=(args.world_size, stages, str(Path(folder) / "rendezvous"), folder, k, sizes, "1f1b", args.tp, 2),
            nprocs=args.world_size,
            join=True,
        )
        seconds = time.perf_counter() - started
        real = [json.loads((Path(folder) / f"rank{r}.json").read_text()) for r in range(args.world_size)]
        runs = [json.loads((Path(folder) / f"rank{r}.runs.json").read_text()) for r in range(args.world_size)]
    task = ProbeTask(
        name="tiny-llama-tp",
        model=worker.TpLlama if args.tp > 1 else worker.TinyLlama,
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
        tp_plan=worker.TP_PLAN,
    )
    mesh = Mesh(pp=stages, tp=args.tp, pp_microbatches=k)
    per_stage = args.world_size // stages
    equal = True
    print(f"{args.strategy} over W {args.world_size}, {mesh.describe()}: real job {seconds:.0f} s")
    for rank in range(args.world_size):
        print(f"  rank {rank} (stage {rank // per_stage}): {real[rank]} (runs {runs[rank]})")
    for meter in (CpuMeter(1 << 40), FakeMeter(1 << 40)):
        strategy = make_strategy(args.strategy, args.world_size, mesh)
        with strategy.process_group(torch.device("cpu")):
            trials = PipelineTrials(
                task, meter, limit_bytes=1 << 40, stages=stages, schedule="1f1b", microbatches=k, strategy=strategy
            )
            for m in sizes:
                trials(m)
                ranks = [[real[r][str(m)] for r in range(s * per_stage, (s + 1) * per_stage)] for s in range(stages)]
                same = all(set(group) == {peak} for group, peak in zip(ranks, trials.stage_peaks[m], strict=True))
                equal &= same
                print(f"  {type(meter).__name__} m={m}: stages {trials.stage_peaks[m]} {'==' if same else '!='} ranks")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
