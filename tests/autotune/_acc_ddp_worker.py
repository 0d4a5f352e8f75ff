"""The body of the DDP test, run in each of the spawned processes (it must be importable by name).

No ``from __future__ import annotations`` here: DDP checks the comm hook's annotations as real types.
"""

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from autotune.loop.accumulate import Accumulator
from examples import gpt

MICRO_BATCH = 2
ACCUMULATION_STEPS = 2
GROUPS = 2
LR = 0.1


def micro_batch(group: int, rank: int, index: int) -> dict[str, torch.Tensor]:
    """The data of (group, rank, micro-batch index): variable-length padded sequences."""
    return gpt.make_batch(MICRO_BATCH, seed=1000 * group + 100 * rank + index, variable_lengths=True)


def rank_loader(rank: int) -> list[dict[str, torch.Tensor]]:
    return [micro_batch(g, rank, i) for g in range(GROUPS) for i in range(ACCUMULATION_STEPS)]


def run(rank: int, world_size: int, rendezvous_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a shared CPU: no oversubscription
    # A file rendezvous: no port to pick and then lose to another process before binding it.
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(gpt.GPT())
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        acc = Accumulator(model, opt, accumulation_steps=ACCUMULATION_STEPS)
        allreduces: list[tuple[int, int]] = []  # (group, micro-batch position) of each gradient all-reduce

        def counting_hook(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            group = acc._group
            allreduces.append((group.index if group is not None else -1, acc._position))
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        model.register_comm_hook(None, counting_hook)
        first_grads: dict[str, torch.Tensor] = {}
        denominators: list[int] = []
        count = lambda b: (b["labels"] != gpt.IGNORE_INDEX).sum()  # noqa: E731
        for group in acc.groups(rank_loader(rank), count=count):
            denominators.append(group.denominator)
            for batch in group:
                with acc.micro_step():
                    total, n = gpt.loss_sum(model, batch)
                    acc.backward(total, count=n)
            if group.index == 0:
                first_grads = {
                    name.removeprefix("module."): p.grad.detach().clone()
                    for name, p in model.named_parameters()
                    if p.grad is not None
                }
            acc.step()
        torch.save(
            {
                "allreduces": allreduces,
                "first_grads": first_grads,
                "params": {
                    n.removeprefix("module."): p.detach().clone() for n, p in model.named_parameters()
                },
                "denominators": denominators,
                "counters": (acc.counters.micro_batches, acc.counters.updates, acc.counters.samples),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
    finally:
        dist.destroy_process_group()
