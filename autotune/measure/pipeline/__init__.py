"""Pipeline parallelism per rank: each stage's trial on one device, replaying its schedule.

A pipeline of ``pp`` stages cuts the model by its decoder blocks (the children of its one top-level
``nn.ModuleList``, or the task's ``shard_classes``): stage s holds a contiguous run of them, as many as
``torch.tensor_split`` gives it (the first ``n % pp`` stages one more), the modules the model calls before the
blocks (the embedding) with the first stage and those it calls after them (the final norm, the head, the loss)
with the last, as torchtitan and PyTorch's pipelining tutorial cut a model by hand. A stage is the task's own
model built on ``meta`` with only its parameters given storage: the other blocks are dropped from the list, a
module the stage does not hold is never run (before the blocks, it hands on the activation that arrived from
the previous stage; after them, the forward stops at the stage's last block), so it holds only its own
weights, gradients and optimizer state.

The stage's trial replays, on one device, what ``torch.distributed.pipelining`` does on that rank for two
optimizer steps of K micro-batches each (the steady state of a job, as the plain trial is):

- **the order** of forwards and backwards. GPipe: all K forwards, then all K backwards. 1F1B
  (``Schedule1F1B``): ``min(K, pp - s)`` forwards of warm-up, then one backward and one forward until the
  forwards are done, then the remaining backwards: stage s holds up to ``pp - s`` micro-batches' activations.
  Interleaved 1F1B with V virtual stages per rank (``ScheduleInterleaved1F1B``): the model is cut in pp x V
  stages, rank r holds stages r, r + pp, ... side by side, and runs :func:`interleaved_actions`;
- **the tensors crossing the stage's boundaries**, with the right shapes: ``PipelineStage`` keeps one receive
  buffer per micro-batch for the activation arriving from the previous stage (used as the stage's input, a
  leaf that requires grad) and one for the gradient arriving from the next, allocated once and kept; the
  stage's output is held from its forward to its backward; the input's gradient is made by the backward and
  held while it is sent;
- **what the schedule's own variables keep alive**, which is part of the rank's real peak: under GPipe every
  send of a step is waited on at the end of its phase, so every output (forward) and every input gradient
  (backward) of the step stays referenced until then; under 1F1B the latest forward's output stays referenced
  until the next forward returns, an input gradient until the next backward's is made, and the first warm-up
  forward's send until the cooldown; the multi-stage runtime of the interleaved schedule waits on every send
  when the step ends;
- gradients accumulate over the K micro-batches (``scale_grads`` divides them by K in place at the end), the
  losses of the last stage are kept until the step ends, and the optimizer steps once per step (one optimizer
  per stage a rank holds, as torchtitan builds one per model part).

Every stage of every micro-batch size is measured; a size fits when every stage fits. The answer is the most
loaded stage's (the largest peak), and :class:`PipelineTrials` keeps each stage's peak per size for the
datasheet, with the bubble ``(pp - 1) / (K + pp - 1)`` (``autotune/core/mesh.py``).

The data: each step's K micro-batches are made when the step starts and dropped when it ends (torchtitan's
data loader makes the whole batch, inputs and targets, on every rank, and ``schedule.step`` cuts it into
views), on every stage. Truth: ``tests/autotune/test_pipeline.py`` runs 2 real processes on gloo with
``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleGPipe`` / ``ScheduleInterleaved1F1B``: equal to the byte.

Over FSDP2 (``--strategy fsdp``, :class:`ShardedStage`): the stage is cut and ``fully_shard``-ed on ``meta`` over
its data-parallel group of D = W / pp, then only its shards are given storage, as torchtitan builds pp x fsdp; the
replay drives the wrapper as ``PipelineStage`` does (gradients accumulated unsharded and units kept gathered over
the step's K backwards, one reduce-scatter at its end). Under interleaved 1F1B each of the rank's V stages is sharded
on its own (torchtitan's model parts) and the replay adds the multi-stage runtime's actions (every stage gathered
when the step starts, each reduced and resharded right after its own last backward: :class:`_InterleavedReplay`).
Truth: ``tests/autotune/test_pipeline_fsdp.py``, 4 real processes (pp 2 x dp 2, and pp 2 x tp 2) on gloo, 1F1B (and
GPipe, once by hand) and interleaved 1F1B (V 2): equal to the byte on every rank.

Over DDP (``--strategy ddp``, D > 1): each stage holds the gradient buckets of the DDP that wraps it over its
data-parallel group, one flat tensor per dtype of its own trainable parameters (:class:`StageStrategy`). Truth:
``tests/autotune/test_ddp_buckets_meshes.py``, 4 real processes (pp 2 x dp 2), 1F1B: equal to the byte.

Where this is not exact: a model that combines several modules before its first block (GPT-2's token and
position embeddings added) makes, on a stage past the first, one transient activation-sized tensor the real
stage does not (the sum, replaced by the arriving activation at the first block); activations crossing
stages are taken to keep the dtype a ``meta`` forward gives them (autocast is not applied to it).

The package, a module per job: ``schedules`` (the order of a rank's forwards and backwards), ``stages`` (how a stage
holds its part: whole, or sharded over its groups), ``cutting`` (the stages' modules, what crosses their boundaries,
each stage built alone), ``replay`` (a rank's steps replayed), ``trials`` (every stage's trial at a size).
"""

from __future__ import annotations

from autotune.measure.pipeline.cutting import PENDING_COLLECTIVE_INPUT, StageLayout
from autotune.measure.pipeline.schedules import (
    SCHEDULES,
    Action,
    interleaved_actions,
    pipeline_refusal,
    schedule_actions,
    stage_block_ranges,
)
from autotune.measure.pipeline.stages import ShardedStage, StageStrategy
from autotune.measure.pipeline.trials import PipelineTrials, StageFigure

__all__ = [
    "PENDING_COLLECTIVE_INPUT",
    "SCHEDULES",
    "Action",
    "PipelineTrials",
    "ShardedStage",
    "StageFigure",
    "StageLayout",
    "StageStrategy",
    "interleaved_actions",
    "pipeline_refusal",
    "schedule_actions",
    "stage_block_ranges",
]
