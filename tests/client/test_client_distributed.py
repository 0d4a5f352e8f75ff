"""One decision per job: under a gloo process group of 2, rank 0 decides and both ranks run its plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.client import _dist_worker as worker
from tests.ranks import spawn

WORLD_SIZE = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("dist")
    spawn(worker.run, args=(WORLD_SIZE, str(out / "rendezvous"), str(out)), nprocs=WORLD_SIZE, join=True)
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def test_rank0_probes_once_and_every_rank_gets_its_suggestion(results: list[dict[str, Any]]) -> None:
    zero, one = (r["local"] for r in results)
    assert zero["probes"] == 1 and one["probes"] == 0
    assert zero["suggestion"] == one["suggestion"]
    s = zero["suggestion"]
    assert s["source"] == "probed" and s["world_size"] == WORLD_SIZE
    assert s["micro_batch"] < worker.TARGET // WORLD_SIZE  # the budget binds
    assert sum(size * count for size, count in s["micro_batches"]) * WORLD_SIZE == worker.TARGET


def test_distributed_false_keeps_per_rank_decisions(results: list[dict[str, Any]]) -> None:
    assert [r["per_rank"]["probes"] for r in results] == [1, 1]
    assert results[0]["per_rank"]["suggestion"]["world_size"] == WORLD_SIZE


def test_only_rank0_asks_the_store(results: list[dict[str, Any]]) -> None:
    zero, one = (r["store"] for r in results)
    assert zero["requests"] == ["/api/v1/suggest"] and one["requests"] == []
    assert zero["suggestion"] == one["suggestion"]
    assert one["suggestion"]["profile_id"] == 100  # rank 0's answer, not what rank 1's store would say


def test_an_error_on_rank0_reaches_the_other_rank_in_one_line(results: list[dict[str, Any]]) -> None:
    assert "'not a size'" in results[0]["error"]
    assert results[1]["error"].startswith("rank 0 could not decide the plan: budget 'not a size'")
    assert "\n" not in results[1]["error"]


def test_the_wait_is_bounded(results: list[dict[str, Any]]) -> None:
    assert results[1]["timeout"].startswith("AutotuneClientError: rank 1 got no plan from rank 0 within 1 s")
