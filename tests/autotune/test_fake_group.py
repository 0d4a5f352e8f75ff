"""One process probing several meshes in turn: each job's collectives resolve its own process group.

DTensor's sharding-propagation caches key on specs whose DeviceMesh compares equal across destroyed and new
groups (autotune/measure/fake_group.py): without emptying them when a fake group ends, the second job here was
handed the first one's tp sub-mesh and stopped at "Could not resolve the process group registered under the
name 7". Each pair's second job equals the same job run first in a fresh cache (its figures cannot depend on what
ran before it in the process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.distributed as dist

from autotune.core.mesh import Mesh
from autotune.core.schemas import Strategy
from autotune.measure.fake_group import forget_meshes
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.hf import hf_task
from autotune.tasks.task import ProbeTask
from tests.autotune._hf_configs import TWO_LAYERS, write_config

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]


def _peaks(task: ProbeTask, mesh: Mesh, strategy: Strategy) -> dict[int, int]:
    config = ProbeConfig(
        device="cpu",
        budget_bytes=1_500_000,
        headroom=0.0,
        strategy=strategy,
        world_size=4,
        mesh=mesh,
        max_micro_batch=2,
    )
    return {t.micro_batch: t.peak_bytes for t in probe(task, config).trials if not t.fake}


@pytest.mark.parametrize(
    ("first", "first_strategy"),
    [(Mesh(tp=2, pp=2, pp_microbatches=2), "ddp"), (Mesh(tp=2, cp=2), "fsdp")],
    ids=["pp2xtp2", "tp2xcp2"],
)
def test_a_tp_job_after_another_mesh_in_the_same_process(tmp_path: Path, first: Mesh, first_strategy: Strategy) -> None:
    task = hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False, **TWO_LAYERS)).at_length(64)
    forget_meshes()
    alone = _peaks(task, Mesh(tp=2), "fsdp")
    assert _peaks(task, first, first_strategy)  # the job that leaves its meshes in DTensor's caches
    after = _peaks(task, Mesh(tp=2), "fsdp")
    assert after == alone and 2 in after  # the cap's trial is real (the smaller ones the fake pre-search's)
