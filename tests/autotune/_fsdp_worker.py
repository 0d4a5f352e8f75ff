"""One rank of a real N-process FSDP2 job on gloo (spawned by test_fsdp_ranks.py).

Each rank measures the trial with the CPU meter at one micro-batch, then runs the same search the
probe runs. A budget that raised an OOM on one rank only would leave the others waiting in a
collective, so the ranks measure without enforcing the budget and agree on each verdict: a size
fits when the largest peak over the ranks is within the limit (what the job needs of every rank).
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.core.schemas import Trial
from autotune.measure.meters import CpuMeter
from autotune.measure.strategies import Sharded
from autotune.measure.trial import TrialRunner
from autotune.search.boundary import find_max_micro_batch
from examples import gpt
from tests.autotune._ordered_gloo import collectives_in_order, one_thread_groups

UNBOUNDED_BYTES = 1 << 40


def run(rank: int, world_size: int, rendezvous: str, out_dir: str, micro_batch: int, limit_bytes: int) -> None:
    # mp.spawn reports the first rank it sees exit; the others' errors would be lost with their
    # processes, so each rank leaves its own traceback for the test to show.
    gc.freeze()  # the imports are never this rank's garbage: each collection walks only what the job made
    try:
        _run(rank, world_size, rendezvous, out_dir, micro_batch, limit_bytes)
    except BaseException:
        Path(out_dir, f"rank{rank}.error").write_text(traceback.format_exc())
        raise


def _run(rank: int, world_size: int, rendezvous: str, out_dir: str, micro_batch: int, limit_bytes: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    one_thread_groups()  # every gloo group this rank makes: one worker thread
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world_size)
    # Each collective waited and fenced as it is issued: gloo lets go of its buffers before the rank goes on
    # (tests/autotune/_ordered_gloo.py says why).
    with contextlib.ExitStack() as stack:
        stack.callback(dist.destroy_process_group)
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world_size,))
        stack.enter_context(collectives_in_order())
        strategy = Sharded(world_size, mesh=mesh)
        meter = CpuMeter(UNBOUNDED_BYTES)
        with strategy.process_group(meter.device):
            runner = TrialRunner(gpt.task, meter, limit_bytes=UNBOUNDED_BYTES, strategy=strategy)
            peak_at = runner(micro_batch).peak_bytes

            def agreed(m: int) -> Trial:
                # Every rank hands the search the same trial: the worst figures over the ranks.
                # The search predicts its next size from the figures, so a rank that saw its own
                # (an uneven shard holds a few bytes more) could choose another m, run out of trials
                # first and leave the others waiting in a collective on a closed connection.
                trial = runner(m)
                figures = [trial.peak_bytes, trial.allocated_bytes, trial.forward_backward_bytes, trial.step_bytes]
                worst = torch.tensor([-1 if f is None else f for f in figures], dtype=torch.int64)
                dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                peak, allocated, forward_backward, step = (None if v < 0 else v for v in worst.tolist())
                return trial.model_copy(
                    update={
                        "peak_bytes": peak,
                        "allocated_bytes": allocated,
                        "forward_backward_bytes": forward_backward,
                        "step_bytes": step,
                        "fits": peak <= limit_bytes,
                    }
                )

            result = find_max_micro_batch(agreed, limit_bytes=limit_bytes)
            runner.close()
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "peak_bytes": peak_at,
                    "max_micro_batch": result.max_micro_batch,
                    "tried": [t.micro_batch for t in result.trials],
                }
            )
        )


if __name__ == "__main__":  # pragma: no cover - spawned by the test
    sys.exit(0)
