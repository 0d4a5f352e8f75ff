"""Fake trials on worker processes beside the main one (autotune/search/lanes.py): where a trial runs
changes nothing but the wall time, and a worker that cannot start costs nothing but its share."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import autotune.search.lanes as fake_lanes
import autotune.search.presearch as presearch
from autotune.orchestrate.estimate import EstimateConfig
from autotune.orchestrate.lengths import LengthsRun, estimate_lengths
from autotune.tasks.load import load_task

MiB = 1 << 20
SPEC = "examples/gpt.py:task_seq"
LENGTHS = [128, 256, 512]


def _answers(run: LengthsRun) -> Any:
    surface = run.surface
    assert surface is not None
    return (
        [
            (p.seq_len, p.max_micro_batch, sorted((t.micro_batch, t.peak_bytes, t.fits) for t in p.trials))
            for p in run.profiles
        ],
        surface.pieces,
        surface.longest,
        run.no_fit,
    )


@pytest.fixture
def lanes_always(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Lanes for any trial however quick, and a count of the trials they brought back."""
    monkeypatch.setattr(presearch, "SLOW_BUILD_SECONDS", 0.0)
    monkeypatch.setattr(presearch, "SLOW_TRIAL_SECONDS", 0.0)
    counted = {"came_back": 0, "failed": 0}
    finished = fake_lanes.FakeLanes.finished

    def counting(self: fake_lanes.FakeLanes, running: Any, *, block: bool) -> Any:
        for point, result in finished(self, running, block=block):
            counted["came_back" if result is not None else "failed"] += 1
            yield point, result

    monkeypatch.setattr(fake_lanes.FakeLanes, "finished", counting)
    return counted


@pytest.fixture(scope="module")
def estimated_here() -> dict[tuple[str, int], LengthsRun]:
    """The estimates with every trial in this process, by (strategy, world size): the ddp one is the truth of two
    tests, so it runs once."""
    return {}


def _here(estimated: dict[tuple[str, int], LengthsRun], strategy: str, world: int) -> LengthsRun:
    if (strategy, world) not in estimated:
        config = EstimateConfig.of(budget_bytes=64 * MiB, device_kind="cpu", strategy=strategy, world_size=world)
        estimated[strategy, world] = estimate_lengths(load_task(SPEC), config, LENGTHS, max_seq_len=1024, workers=0)
    return estimated[strategy, world]


@pytest.mark.parametrize(("strategy", "world"), [("ddp", 1), ("fsdp", 2)])
def test_trials_on_a_worker_give_the_same_estimate_as_trials_here(
    lanes_always: dict[str, int], estimated_here: dict[tuple[str, int], LengthsRun], strategy: str, world: int
) -> None:
    task = load_task(SPEC)
    assert task.source == SPEC
    config = EstimateConfig.of(budget_bytes=64 * MiB, device_kind="cpu", strategy=strategy, world_size=world)
    here = _here(estimated_here, strategy, world)
    assert lanes_always["came_back"] == 0
    beside = estimate_lengths(task, config, LENGTHS, max_seq_len=1024, workers=1)
    assert lanes_always["came_back"] >= 3  # the surface's and the confirmations' trials, some of them
    assert _answers(beside) == _answers(here)


def test_a_worker_that_cannot_start_leaves_every_trial_to_this_process(
    lanes_always: dict[str, int], estimated_here: dict[tuple[str, int], LengthsRun]
) -> None:
    task = load_task(SPEC)
    config = EstimateConfig.of(budget_bytes=64 * MiB, device_kind="cpu")
    assert config == EstimateConfig.of(budget_bytes=64 * MiB, device_kind="cpu", strategy="ddp", world_size=1)
    here = _here(estimated_here, "ddp", 1)  # the same estimate as the ddp case's, shared
    # The worker loads the task from its spec: one that does not load kills the worker at its start.
    broken = dataclasses.replace(task, source="examples/no_such_file.py:task")
    beside = estimate_lengths(broken, config, LENGTHS, max_seq_len=1024, workers=1)
    assert lanes_always["came_back"] == 0 and lanes_always["failed"] >= 1
    assert _answers(beside) == _answers(here)


def test_a_task_built_in_python_runs_every_trial_here(lanes_always: dict[str, int]) -> None:
    from examples.gpt import task_seq

    assert task_seq.source is None  # nothing another process could load it from
    config = EstimateConfig.of(budget_bytes=64 * MiB, device_kind="cpu")
    estimate_lengths(task_seq, config, LENGTHS[:2], max_seq_len=512, workers=1)
    assert lanes_always == {"came_back": 0, "failed": 0}


def test_a_worker_routes_by_the_runs_load_factor() -> None:
    """A lane's worker holds its model under the routing of the run that made it (a mixture of experts'
    fake trials there route as they do here), for as long as the worker lives."""
    from autotune.measure.meters.fake import current_load_factor, moe_routing

    task = load_task("examples/mlp.py:task")
    with moe_routing(1.5):
        lanes = fake_lanes.FakeLanes.for_task(
            task, 1, device_type="cpu", strategy="ddp", world_size=1, device_name=None, hold=presearch.hold_lane_model
        )
    assert lanes is not None and lanes.setup.moe_load_factor == 1.5
    assert current_load_factor() == 1.0
    _, stack, fakes = presearch.hold_lane_model(lanes.setup)
    try:
        assert current_load_factor() == 1.5
    finally:
        fakes.close()
        stack.close()
    assert current_load_factor() == 1.0
