"""Each memory policy's m_max against the CPU allocator's own count (tests/autotune/_allocator_truth.py) of the
model built and checkpointed the ordinary way: the blocks in torch's ``checkpoint_wrapper`` (non-reentrant
``torch.utils.checkpoint``) as torchtitan wraps them, op-level with ``create_selective_checkpoint_contexts``
and torchtitan's rule written out here. Nothing below imports the project's policies: the truth shares no code
with what it checks."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from autotune.orchestrate.probe import ProbeConfig, probe
from examples.gpt import GPT, Block, GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._ordinary_checkpointing import checkpointed

MiB = 1 << 20
TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4)


# What the meter cannot see: torch.utils.checkpoint keeps the CPU generator's state (torch.get_rng_state(), a
# tensor made below the dispatcher) for each checkpointed call until its backward, to replay dropout alike.
# On a CUDA device it is host memory.
RNG_STATE_BYTES = torch.get_rng_state().nbytes
WRAPPED = {"every-3": 2, "op": 4, "op:addmm/mm": 4}
# policy -> the ordinary model under it (tests/autotune/_ordinary_checkpointing.py): every-3 wraps blocks 0 and 3 of
# 4; op torchtitan's list (the tiny GPT's Linear layers have biases: addmm, so only attention is saved);
# op:addmm/mm every other matmul of a block.
ORDINARY: dict[str, Callable[[], nn.Module]] = {
    policy: (lambda policy=policy: checkpointed(GPT(TINY), policy)) for policy in ("every-3", "op", "op:addmm/mm")
}


@pytest.mark.parametrize(
    ("policy", "strategy", "world_size"),
    [("every-3", "ddp", 1), ("op", "ddp", 1), ("op:addmm/mm", "ddp", 1), ("op:addmm/mm", "fsdp", 2)],
)
def test_each_policy_is_exact_against_the_allocator_at_m_max_and_past_it(
    policy: str, strategy: str, world_size: int
) -> None:
    task = dataclasses.replace(
        make_task(TINY, name="gpt-tiny"), shard_classes=(Block,), activation_checkpointing=policy
    )
    budget = 2 * MiB
    config = ProbeConfig(device="cpu", budget_bytes=budget, target_batch=64, strategy=strategy, world_size=world_size)
    measured = probe(task, config)
    assert measured.activation_checkpointing == policy
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    limit = int(budget * (1 - config.headroom))
    # FSDP2 shards the wrappers (op wraps every block), as torchtitan does.
    ordinary = dataclasses.replace(task, shard_classes=(CheckpointWrapper,) if world_size > 1 else (Block,))
    at_max = allocator_peak_bytes(ordinary, m_max, world_size=world_size, model=ORDINARY[policy])
    past_max = allocator_peak_bytes(ordinary, m_max + 1, world_size=world_size, model=ORDINARY[policy])
    # The allocator agrees with the decision at the boundary, and with the probe's real trials byte for byte.
    assert at_max <= limit < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    kept = WRAPPED[policy] * RNG_STATE_BYTES
    assert (at_max - peaks[m_max], past_max - peaks[m_max + 1]) == (kept, kept)
