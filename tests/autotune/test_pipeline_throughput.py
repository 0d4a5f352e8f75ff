"""A pipeline probe's throughput (issue 61): each stage's steps timed on the device as its trial runs them, the
pipeline's step composed by its schedule (the slowest stage's micro-batches over 1 - bubble, then the slowest optimizer
step), and stored as any probe's: per replica, the timed median, consistent with the update it prices, so that
``recommend`` ranks pipeline setups by it."""

from __future__ import annotations

import math

from autotune.core.consistency import check_profile
from autotune.core.mesh import Mesh
from autotune.core.recommend import samples_per_second
from autotune.measure.pipeline.timing import StageTimes
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.tasks.task import ProbeTask
from tests.autotune import _pipeline_worker as worker

K = 2
BUDGET = 1_000_000  # m_max 2 of the tiny Llama's most loaded stage (tests/autotune/test_pipeline.py)


def test_the_bubble_is_a_share_of_each_micro_batch() -> None:
    times = StageTimes(forward_backward_seconds=[0.4, 0.8], step_seconds=[0.1, 0.2], microbatches=4, repeats=3)
    # The slowest stage's 0.8 s over 4 micro-batches, over 1 - (pp - 1) / (K + pp - 1) = 1 - 1/5.
    assert math.isclose(times.micro_batch_seconds(Mesh(pp=2, pp_microbatches=4), 4), 0.25)
    # A plan of K = 2 has a larger bubble (1/3) per micro-batch.
    assert math.isclose(times.micro_batch_seconds(Mesh(pp=2, pp_microbatches=4), 2), 0.3)


def test_a_pipeline_probe_is_timed_and_stored_as_any_probe() -> None:
    task = ProbeTask(
        name="tiny-llama",
        model=worker.TinyLlama,
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
    )
    mesh = Mesh(pp=2, pp_microbatches=K)
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, world_size=4, mesh=mesh, target_batch=6, throughput=True)
    profile = probe(task, config)
    check_profile(profile)  # what the store checks before it keeps a profile
    m_max, replicas = profile.max_micro_batch, 2
    assert profile.throughput is not None and profile.plan is not None
    timed = profile.throughput[0]
    assert timed.micro_batches == [(m_max, K)] and timed.world_size == replicas and timed.repeats >= 3
    per_micro_batch = timed.micro_batch_seconds[0][1]
    assert math.isclose(timed.seconds_per_update, K * per_micro_batch + timed.step_seconds, rel_tol=1e-5)
    assert math.isclose(timed.samples_per_second, replicas * m_max * K / timed.seconds_per_update, rel_tol=1e-3)
    # The plan's update (its m and K) is priced from its own timed size.
    plan_update = [(profile.plan.micro_batch, profile.plan.accumulation_steps)]
    if plan_update != timed.micro_batches:
        assert profile.throughput[1].micro_batches == plan_update
    priced = samples_per_second(profile.throughput, plan_update, replicas)
    assert priced is not None and priced[1] and priced[0] > 0
