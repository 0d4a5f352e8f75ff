"""Train with the plan the tuner suggests (docs/client.md, "Use it from a training script").

Run it with AUTOTUNE_URL (and AUTOTUNE_TOKEN, to upload what it measures) pointing at `autotune serve`;
without them it measures locally and says so.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from autotune import Accumulator, PlanBatchSampler
from autotune_client import observer, suggest

TARGET_BATCH = 256  # samples per optimizer update, as the recipe says


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


torch.manual_seed(0)
model = Net()
inputs = torch.randn(4096, 128)
dataset = TensorDataset(inputs, inputs[:, :8] * 2.0 - inputs[:, 8:16])  # a learnable target

# Before the DataLoader: the micro-batches that fit and keep TARGET_BATCH in the fewest steps.
# The budget is only needed on a CPU; on a GPU the card's memory is the budget.
plan = suggest(model, TARGET_BATCH, example=dataset[:1], optimizer=make_optimizer, budget="1.5MiB")
print(f"plan: {plan.micro_batch} x {plan.accumulation_steps} x {plan.world_size} = {plan.effective_batch} "
      f"({plan.source}, profile {plan.profile_id}); micro-batches (size, count): {plan.micro_batches}")

# A balanced plan's micro-batches may differ by one sample (6 x 26 + 4 x 25 = 256): the sampler yields them.
loader = DataLoader(dataset, batch_sampler=PlanBatchSampler(RandomSampler(dataset), plan))
optimizer = make_optimizer(model.parameters())
# What the job really peaks at goes back to the profile that answered (after 3 updates, then at most
# every 5 minutes and only when it grew; never blocking or failing training), so that later answers
# take the drift. On a GPU, observer(plan, device="cuda") reads torch.cuda.max_memory_reserved; this
# CPU job has no allocator peak to read, and reports only an OOM (with oom_fallback=True).
report = observer(plan)
acc = Accumulator(
    model, optimizer, accumulation_steps=plan.accumulation_steps, max_grad_norm=1.0, observe=report
)

for epoch in range(3):
    total = 0.0
    for group in acc.groups(loader):
        for x, y in group:
            with acc.micro_step():
                loss_sum = nn.functional.mse_loss(model(x), y, reduction="sum")
                acc.backward(loss_sum)  # divided by the samples of the whole group
            total += loss_sum.item()
        acc.step()
    print(f"epoch {epoch}: loss {total / len(dataset):.4f}")
print(acc.counters)
