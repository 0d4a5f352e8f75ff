"""DDP with 2 processes on gloo: one gradient all-reduce per group, and the single-process
full-batch gradient (global token normalization across replicas)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from examples import gpt
from tests.autotune import _acc_ddp_worker as worker
from tests.autotune._acc_helpers import concat, grads, max_relative_error
from tests.ranks import spawn

WORLD_SIZE = 2

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("ddp")
    spawn(worker.run, args=(WORLD_SIZE, str(out / "rendezvous"), str(out)), nprocs=WORLD_SIZE, join=True)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _reference() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[int]]:
    """One process, the whole global group as one batch: the gradient DDP + accumulation must match."""
    torch.manual_seed(0)
    model = gpt.GPT()
    opt = torch.optim.SGD(model.parameters(), lr=worker.LR)
    first: dict[str, torch.Tensor] = {}
    counts = []
    for g in range(worker.GROUPS):
        batch = concat(
            [worker.micro_batch(g, r, i) for r in range(WORLD_SIZE) for i in range(worker.ACCUMULATION_STEPS)]
        )
        total, n = gpt.loss_sum(model, batch)
        counts.append(n)
        (total / n).backward()
        if g == 0:
            first = grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return first, {n: p.detach().clone() for n, p in model.named_parameters()}, counts


def test_exactly_one_gradient_allreduce_per_group_on_the_last_micro_batch(ddp_results: list[dict]) -> None:
    last = worker.ACCUMULATION_STEPS - 1
    for result in ddp_results:
        # The small GPT fits in DDP's first bucket, so one all-reduce per group; it happens on the
        # last micro-batch only (no_sync covered the others' forward and backward).
        assert result["allreduces"] == [(g, last) for g in range(worker.GROUPS)]


def test_ddp_gradient_equals_single_process_full_batch(ddp_results: list[dict]) -> None:
    first, params, counts = _reference()
    for result in ddp_results:
        assert result["denominators"] == counts  # the global supervised-token count of each group
        error = max_relative_error(result["first_grads"], first)
        print(f"ddp vs single-process full batch: {error:.2e}")
        assert error < 1e-5
        for name, want in params.items():
            torch.testing.assert_close(result["params"][name], want, rtol=1e-5, atol=1e-6, msg=name)
        assert result["counters"] == (
            worker.GROUPS * worker.ACCUMULATION_STEPS,
            worker.GROUPS,
            worker.GROUPS * worker.ACCUMULATION_STEPS * worker.MICRO_BATCH,
        )
