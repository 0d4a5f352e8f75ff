"""Rank 0's trials of a tensor-parallel job in one process (test_tp_fake.py, test_tp_moe.py): tp 2 over a fake
process group, the rest of the world ``inner`` (ddp or fsdp), each size's peak by the meter given."""

from __future__ import annotations

from autotune.core.mesh import Mesh
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.strategies import TensorParallel
from autotune.measure.trial import TrialRunner

LIMIT_BYTES = 1 << 30


def tp_peaks(meter: CpuMeter, task: object, inner: str, world_size: int, sizes: tuple[int, ...]) -> dict[int, int]:
    strategy = TensorParallel(world_size, Mesh(tp=2), inner=inner)
    with strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=LIMIT_BYTES, strategy=strategy)  # type: ignore[arg-type]
        try:
            return {m: runner(m).peak_bytes for m in sizes}
        finally:
            runner.close()
