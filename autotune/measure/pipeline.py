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
"""

from __future__ import annotations

import functools
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.consistency import exceeds_host_budget
from autotune.core.errors import AutotuneError, TaskError
from autotune.core.mesh import Mesh
from autotune.core.schemas import MemoryBreakdown, Trial
from autotune.measure.breakdown import with_host_parts
from autotune.measure.layout import Layout
from autotune.measure.meters import FORWARD_BACKWARD, STEP, MemoryReading, Meter
from autotune.measure.meters.compiled import compiles_on, graphs_compiled, static_shapes
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.meters.host import HOST
from autotune.measure.offload import apply_offload, offload_params_to_host, step_on_host
from autotune.measure.oom import is_oom, release_failed_backward
from autotune.measure.parallelize import Parallelism, apply_ddp, compose, fsdp_api
from autotune.measure.policies import apply_policy
from autotune.measure.strategies import Strategy
from autotune.measure.trial import _fake_step, _initialise, build_on_meta, make_batch, recorder_of
from autotune.tasks.batches import map_tensors
from autotune.tasks.task import ProbeTask

__all__ = [
    "SCHEDULES",
    "Action",
    "PipelineTrials",
    "StageLayout",
    "ShardedStage",
    "StageStrategy",
    "pipeline_refusal",
    "schedule_actions",
    "stage_block_ranges",
]

SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")
OPTIMIZER_STEPS = 2
# A compiled stage's replays at most, until one compiles nothing: the first graphs, a recompilation for the size, one
# for a stage whose inputs guard otherwise (PipelineTrials.measure_stage).
SETTLING_REPLAYS = 4

# ("F", micro-batch) or ("B", micro-batch).
Action = tuple[Literal["F", "B"], int]


def stage_block_ranges(blocks: int, stages: int) -> list[range]:
    """The blocks of each stage: contiguous runs, the first ``blocks % stages`` stages one more
    (``torch.tensor_split``'s cut).

    >>> stage_block_ranges(5, 2)
    [range(0, 3), range(3, 5)]
    """
    base, extra = divmod(blocks, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (1 if stage < extra else 0)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> list[Action]:
    """The order of one step's forwards and backwards on stage ``stage`` of ``stages``.

    >>> schedule_actions("1f1b", 0, 2, 4)
    [('F', 0), ('F', 1), ('B', 0), ('F', 2), ('B', 1), ('F', 3), ('B', 2), ('B', 3)]
    >>> schedule_actions("1f1b", 1, 2, 3)
    [('F', 0), ('B', 0), ('F', 1), ('B', 1), ('F', 2), ('B', 2)]
    >>> schedule_actions("gpipe", 1, 2, 2)
    [('F', 0), ('F', 1), ('B', 0), ('B', 1)]
    """
    k = microbatches
    if schedule == "gpipe":
        return [("F", i) for i in range(k)] + [("B", i) for i in range(k)]
    if schedule != "1f1b":
        raise AutotuneError(f"--pp-schedule {schedule} has no single-stage order (measured: 1f1b, gpipe)")
    warmup = min(k, stages - stage)
    actions: list[Action] = [("F", i) for i in range(warmup)]
    forward, backward = warmup, 0
    while backward < k:
        actions.append(("B", backward))
        backward += 1
        if forward < k:
            actions.append(("F", forward))
            forward += 1
    return actions


def interleaved_actions(rank: int, ranks: int, microbatches: int, virtual: int) -> list[tuple[str, int, int]]:
    """The order of one step's forwards and backwards on pipeline rank ``rank`` under interleaved 1F1B with
    ``virtual`` stages per rank (rank r holds stages r, r + ranks, ...): (kind, local chunk, micro-batch).

    ScheduleInterleaved1F1B's own rule (Narayanan et al. 2021, relaxed to K not a multiple of pp): rounds of
    ``K // max(1, K // pp)`` micro-batches; a warm-up of ``(V - 1) x round + 2 (pp - 1 - rank)`` forwards (at most
    V K), the forwards going chunk by chunk a round at a time; then one forward and one backward, the backwards
    going from the last chunk down; then the remaining backwards.

    >>> interleaved_actions(1, 2, 2, 2)
    [('F', 0, 0), ('F', 0, 1), ('F', 1, 0), ('B', 1, 0), ('F', 1, 1), ('B', 1, 1), ('B', 0, 0), ('B', 0, 1)]
    """
    rounds = max(1, microbatches // ranks)
    per_round = microbatches // rounds
    warmup = min((virtual - 1) * per_round + 2 * (ranks - 1 - rank), microbatches * virtual)
    both = microbatches * virtual - warmup
    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    actions: list[tuple[str, int, int]] = []

    def forward(step: int) -> None:
        chunk = (step // per_round) % virtual
        actions.append(("F", chunk, forwards.get(chunk, 0)))
        forwards[chunk] = forwards.get(chunk, 0) + 1

    def backward(step: int) -> None:
        chunk = virtual - 1 - ((step - warmup) // per_round) % virtual
        actions.append(("B", chunk, backwards.get(chunk, 0)))
        backwards[chunk] = backwards.get(chunk, 0) + 1

    for step in range(warmup + both + warmup):
        if step < warmup:
            forward(step)
        elif step < warmup + both:
            forward(step)
            backward(step)
        else:
            backward(step)
    return actions


def pipeline_refusal(schedule: str, stages: int, microbatches: int, blocks: int | None) -> str | None:
    """Why this pipeline cannot be measured on this model (one line naming the flag), or None."""
    if schedule not in SCHEDULES:
        return f"--pp-schedule {schedule} is not measured yet (measured: {', '.join(SCHEDULES)})"
    if schedule != "gpipe" and microbatches < stages:
        return (
            f"--pp-microbatches {microbatches} is below --pp {stages}: under --pp-schedule {schedule} every stage "
            "needs a micro-batch in flight (K >= pp)"
        )
    rounds = max(1, microbatches // stages)
    if schedule == "interleaved-1f1b" and microbatches % rounds:
        return (
            f"--pp-microbatches {microbatches}: interleaved 1F1B runs rounds of K // max(1, K // pp) micro-batches, "
            f"and {microbatches} is not a multiple of its {rounds} rounds"
        )
    if blocks is not None and blocks < stages:
        return f"--pp {stages}: the model has {blocks} block(s) to cut, fewer than the stages"
    return None


class StageStrategy(Strategy):
    """How a pipeline stage holds its part of the model here: whole, in no process group (the replay stands in
    for the pipeline's sends and receives), one of ``replicas`` data-parallel replicas. A sharding strategy
    (:class:`ShardedStage`) shards the stage on ``meta`` before it is given storage and takes part in the replay
    through the hooks below, as ``PipelineStage`` drives its wrapper.

    Under ddp with more than one replica the job wraps each stage's module in DDP over its data-parallel group
    (``PipelineStage(DistributedDataParallel(stage))``: forwards and every backward but the step's last under
    ``no_sync``, the last one all-reducing in place in the buckets): once the stage has its storage, it holds the
    buckets DDP's reducer allocates, one flat tensor per dtype of the stage's own trainable parameters
    (``strategies.hold_ddp_buckets``, real and fake trials alike; truth: tests/autotune/test_ddp_buckets_meshes.py).
    """

    name = "ddp"
    # Whether the stage is wrapped on meta (shard_stage) before its parameters are given storage.
    shards = False

    def __init__(self, world_size: int = 1, *, replicas: int = 1) -> None:
        super().__init__(world_size)
        self.replicas = replicas

    def process_group(self, device: torch.device) -> AbstractContextManager[Any]:
        return nullcontext()

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        return model

    def shard_stage(self, model: nn.Module, task: ProbeTask, not_held: set[int]) -> None:
        """Wrap the stage's module (on ``meta``, its other blocks dropped) in place; ``not_held``: the ids of the
        parameters the stage does not hold (they stay on ``meta`` and are never run)."""

    def stage_built(self, model: nn.Module) -> None:
        """After the stage's parameters (or shards) were given storage, inside the measured span: DDP's buckets
        where DDP wraps the stage (ddp over more than one replica)."""
        if self.name == "ddp":
            apply_ddp(model, torch.device("meta"), replicas=self.replicas)  # no group: the buckets alone

    def forward_ended(self, model: nn.Module, output: Any) -> Any:
        """The stage's output when its forward stopped at its last block, before the model's own end."""
        return output

    def backward_begins(self, model: nn.Module) -> None:
        """Before each micro-batch's backward."""

    def grads_reduced(self, model: nn.Module) -> None:
        """After the step's last backward, before the gradients are divided by K."""

    def unshard_begins(self, model: nn.Module) -> list[Any]:
        """When the interleaved schedule's step starts (its UNSHARD action): the pending gathers of the stage."""
        return []

    def unshard_waited(self, pending: list[Any]) -> None:
        """Before the stage's first forward or backward of the step: the gathers waited on."""

    def stage_resharded(self, model: nn.Module) -> None:
        """After the stage's last backward of the step and its reduction (the interleaved schedule's RESHARD)."""

    def crossing_meta(self, meta: tuple[torch.Size, torch.dtype]) -> tuple[torch.Size, torch.dtype]:
        """The shape and dtype of an activation crossing the stage's boundary as the rank holds it."""
        return meta

    def arriving(self, arrival: torch.Tensor) -> torch.Tensor:
        """The receive buffer as the stage's first block takes it."""
        return arrival

    def leaving(self, output: torch.Tensor) -> torch.Tensor:
        """The stage's output as it is sent (and held until its backward)."""
        return output

    @contextmanager
    def step_batches(self, task: ProbeTask, micro_batch: int, microbatches: int, device: torch.device) -> Iterator[Any]:
        """A step's K micro-batches, for its forwards and backwards within (``--cp``: the step's whole batch sharded
        along the sequence and the ring attention's, as torchtitan's train context wraps the schedule's step)."""
        yield [make_batch(task, micro_batch, device) for _ in range(microbatches)]


class ShardedStage(StageStrategy):
    """A stage wrapped over its data-parallel and tensor-parallel groups, torchtitan's pp x fsdp (x tp): rank 0 of a
    ``(pp, dp, tp)`` device mesh in a fake process group of the world size W (D = W / (pp x tp)). With tp > 1 the
    stage's modules are first parallelized by DTensor with the task's plan (autotune/measure/tensor_parallel.py)
    over the tp sub-mesh, the modules the stage does not hold left out; under fsdp the stage's blocks then its root
    are ``fully_shard``-ed over the dp sub-mesh (the last block not resharded after forward, as :class:`Sharded`
    wraps a whole model). All on ``meta``: only the shards are ever given storage (torchtitan's ``to_empty`` after
    ``parallelize_module`` and ``fully_shard``). The parameters the stage does not hold stay on ``meta``, ignored
    by FSDP2.

    ``PipelineStage`` drives an FSDP2 module its own way (torch/distributed/pipelining/stage.py): before every
    micro-batch's backward it turns gradient sync and resharding after backward off, so each unit stays gathered
    and its gradient accumulates unsharded over the K micro-batches; after the step's last backward
    (``perform_reduce_grad``) it turns them on, runs every unit's ``post_backward`` (reduce-scatter, reshard) and
    the root's final callback, then divides the sharded gradients by K. The replay calls the same methods at the
    same points.

    With cp > 1 (torchtitan's pp x cp) the mesh is ``(pp, dp, cp[, tp])`` and each stage's attention runs torch's ring
    over the stage's cp group (autotune/measure/context_parallel.py, rank cp 0 measured): each step's whole batch is
    sharded along the sequence inside ``context_parallel`` for the step and cut into the micro-batches' views
    (:meth:`step_batches`); the crossing activations are the rank's L / cp positions; DDP's buckets are over dp x cp,
    FSDP2 shards over dp x cp. Truth: ``tests/autotune/test_cp_pipeline.py`` (4 real processes, pp 2 x cp 2)."""

    shards = True

    def __init__(self, world_size: int, stages: int, *, tp: int = 1, cp: int = 1, inner: str = "fsdp") -> None:
        refuse_composition(Dimensions(strategy=inner, world_size=world_size, pp=stages, tp=tp, cp=cp))
        replicas = world_size // (stages * tp * cp)
        # Under cp the cp ranks hold the same parameters: DDP (its buckets) runs over dp x cp, FSDP2 shards over it.
        super().__init__(world_size, replicas=max(1, replicas * cp))
        self.name = inner
        self.stages, self.tp, self.cp, self.inner = stages, tp, cp, inner
        self._device_mesh: Any = None
        self._shard_mesh: Any = None
        self._tp_mesh: Any = None
        self._entered = 0
        # --cp: each micro-batch's shift_labels and position_ids, by its input_ids (step_batches), for its forward.
        self._sequence_kwargs: dict[int, dict[str, torch.Tensor]] = {}
        # The plan shards the sequence between the blocks (sequence parallel: the activations that cross the
        # stages are each rank's L / tp positions, as torchtitan's stages send them): set by shard_stage, with
        # loss_parallel.
        self._sequence_sharded = False

    @property
    def describes_replicas(self) -> bool:
        return False

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        # bf16 under FSDP2 is its MixedPrecisionPolicy alone, as Sharded runs it.
        if self.inner == "fsdp" and precision == "bf16":
            return None
        return super().autocast_dtype(precision)

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        if self._entered:  # the probe enters it around the search, and the search again
            self._entered += 1
            try:
                yield None
            finally:
                self._entered -= 1
            return
        fsdp_api()  # its one-line error where this torch has no fully_shard or fake process group
        import torch.distributed as dist

        if dist.is_initialized():
            raise AutotuneError(
                f"--strategy {self.inner} --pp probes rank 0 of N through a fake process group, and a process group "
                "is already initialized in this process: probe before init_process_group, or from `autotune probe`"
            )
        from autotune.measure.context_parallel import ring_ready

        mesh_of_job = Mesh(pp=self.stages, tp=self.tp, cp=self.cp)
        # The measured rank: (pp 0, dp 0[, cp 0][, tp 0]), cp rank 0 the most loaded of its ring (context_parallel.py).
        ring = ring_ready(device) if self.cp > 1 else nullcontext()
        with ring, Layout(self.world_size, mesh_of_job).fake_device_mesh(device.type) as mesh:  # (pp, dp[, cp][, tp])
            self._entered = 1
            try:
                self._device_mesh = mesh
                if self.inner == "fsdp":  # made here, outside the fake trials' modes (its rank map is a real tensor)
                    self._shard_mesh = mesh["dp", "cp"]._flatten("dp_cp") if self.cp > 1 else mesh["dp"]
                # One tp sub-mesh for every stage built (torchtitan slices it once): a slice is a new object each
                # time, while a parameter's DTensor spec keeps the first one it was made with, and a compiled block
                # guards on whether its hooks' mesh is its parameters' (a stage rebuilt with a fresh slice would
                # recompile where the job does not).
                self._tp_mesh = mesh["tp"] if self.tp > 1 else None
                yield dist.group.WORLD
            finally:
                self._entered = 0
                self._device_mesh = self._shard_mesh = self._tp_mesh = None

    def shard_stage(self, model: nn.Module, task: ProbeTask, not_held: set[int]) -> None:
        from autotune.measure.tensor_parallel import shards_sequence, uses_loss_parallel

        if self._device_mesh is None:
            raise AutotuneError(f"--strategy {self.inner} --pp: the stage was built outside its process group")

        # tp over the modules the stage holds, then (fsdp) its blocks and root sharded over dp; under ddp the
        # buckets come once the stage has its storage (stage_built), so nothing here.
        parallelism = Parallelism(
            self.inner,
            tp_mesh=self._tp_mesh,
            shard_mesh=self._shard_mesh,
            not_held=frozenset(not_held),
            context=self._install_cp if self.cp > 1 else None,
        )
        styles = compose(model, task, torch.device("meta"), parallelism).styles
        self._sequence_sharded = shards_sequence(styles)
        self.loss_parallel = uses_loss_parallel(styles)

    def stage_built(self, model: nn.Module) -> None:
        super().stage_built(model)
        if self.inner == "ddp" and self.tp > 1 and self.replicas > 1:
            # torch's TP + DDP over the stage's replicas keeps each gradient as its parameter's shard (parallelize.py).
            from autotune.measure.parallelize import grads_as_local_shards

            grads_as_local_shards(model)

    def _install_cp(self, model: nn.Module) -> None:
        """cp's applier on the stage (as ContextParallel's on a whole model): each attention's mask dropped, and each
        forward given its micro-batch's shift_labels and position_ids, sharded with it by :meth:`step_batches`."""
        from autotune.measure.context_parallel import check_cp_model, drop_masks

        check_cp_model(model, self.cp)
        drop_masks(model)
        model.register_forward_pre_hook(self._sequence_inputs, with_kwargs=True)

    def _sequence_inputs(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        more = self._sequence_kwargs.get(id(kwargs.get("input_ids")))
        if more is None:
            raise AutotuneError(f"--cp {self.cp} --pp {self.stages}: a stage's forward ran outside its step's context")
        return args, {**kwargs, **more}

    @contextmanager
    def step_batches(self, task: ProbeTask, micro_batch: int, microbatches: int, device: torch.device) -> Iterator[Any]:
        if self.cp == 1:
            with super().step_batches(task, micro_batch, microbatches, device) as batches:
                yield batches
            return
        from autotune.measure.context_parallel import sequence_buffers, sequence_sharded

        # torchtitan's way: the step's whole batch made on every rank and sharded along the sequence once, inside
        # context_parallel for the step (whose frame keeps the shards it made, the last buffer's clone among them);
        # then the schedule cuts each buffer into the K micro-batches' views.
        whole = sequence_buffers(make_batch(task, micro_batch * microbatches, device), self.cp)
        try:
            with sequence_sharded(self._device_mesh["cp"], whole):
                input_ids, labels, shift_labels, position_ids = (b.tensor_split(microbatches) for b in whole)
                batches = []
                for index in range(microbatches):
                    batches.append({"input_ids": input_ids[index], "labels": labels[index]})
                    self._sequence_kwargs[id(input_ids[index])] = {
                        "shift_labels": shift_labels[index],
                        "position_ids": position_ids[index],
                    }
                del input_ids, labels, shift_labels, position_ids, whole
                yield batches
        finally:
            self._sequence_kwargs = {}

    def crossing_meta(self, meta: tuple[torch.Size, torch.dtype]) -> tuple[torch.Size, torch.dtype]:
        if not self._sequence_sharded and self.cp == 1:
            return meta
        shape, dtype = meta
        length = shape[1] // (self.tp if self._sequence_sharded else 1) // self.cp
        return torch.Size((shape[0], length, *shape[2:])), dtype

    def arriving(self, arrival: torch.Tensor) -> torch.Tensor:
        if not self._sequence_sharded:
            return arrival
        from torch.distributed.tensor import DTensor, Shard

        # The rank's positions of the residual stream, as the previous stage's last block left them.
        return DTensor.from_local(arrival, self._tp_mesh, [Shard(1)], run_check=False)

    def leaving(self, output: torch.Tensor) -> torch.Tensor:
        local = getattr(output, "to_local", None)
        return local() if self._sequence_sharded and callable(local) else output

    def forward_ended(self, model: nn.Module, output: Any) -> Any:
        if self.inner != "fsdp":
            return output
        # The root's forward did not return (the stage stopped at its last block): its post-forward, which the
        # real stage's module runs when it returns, registers the pre-backward hook on the output.
        from torch.distributed.fsdp import fully_shard

        return fully_shard.state(model)._post_forward(model, (), output)  # type: ignore[attr-defined]

    def backward_begins(self, model: nn.Module) -> None:
        if self.inner != "fsdp":
            return
        model.set_is_last_backward(False)  # type: ignore[operator]
        model.set_reshard_after_backward(False)  # type: ignore[operator]
        model.set_requires_gradient_sync(False)  # type: ignore[operator]

    def grads_reduced(self, model: nn.Module) -> None:
        if self.inner != "fsdp":
            return
        from torch.distributed.fsdp import fully_shard

        model.set_is_last_backward(True)  # type: ignore[operator]
        model.set_reshard_after_backward(True)  # type: ignore[operator]
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
        state = fully_shard.state(model)  # type: ignore[attr-defined]
        for each in state._state_ctx.all_states:
            for group in each._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()

    def unshard_begins(self, model: nn.Module) -> list[Any]:
        return [unit.unshard(async_op=True) for unit in self._fsdp_units(model)]

    def unshard_waited(self, pending: list[Any]) -> None:
        for handle in pending:
            handle.wait()

    def stage_resharded(self, model: nn.Module) -> None:
        for unit in self._fsdp_units(model):
            unit.reshard()

    def _fsdp_units(self, model: nn.Module) -> list[Any]:
        """The stage's FSDP2 units (none but under fsdp), in module order."""
        if self.inner != "fsdp":
            return []
        from torch.distributed.fsdp import FSDPModule

        return [unit for unit in model.modules() if isinstance(unit, FSDPModule)]


class _StageExit(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by the stage's last block to end the model's forward there; carries the block's output."""

    def __init__(self, output: Any) -> None:
        super().__init__("pipeline stage output")
        self.output = output


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    if isinstance(value, dict):
        for item in value.values():
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _hidden_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The activation a block is called on: its first positional tensor, else ``hidden_states``."""
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    value = kwargs.get("hidden_states")
    return value if isinstance(value, torch.Tensor) else _first_tensor(kwargs)


def _owns_parameters(module: nn.Module) -> bool:
    return any(p is not None for p in module._parameters.values())


@dataclass
class StageLayout:
    """Where a model is cut: its blocks' list, which parameters each stage holds, which modules run before
    the blocks (a later stage hands on the arriving activation in their place)."""

    container: str
    block_count: int
    ranges: list[range]
    prefix_modules: list[str]
    stage_parameters: list[set[str]]

    @classmethod
    def of(cls, task: ProbeTask, model: nn.Module, stages: int, micro_batch: int, flag: str = "") -> StageLayout:
        """The layout of ``model`` (on ``meta``), read off one ``meta`` forward at micro_batch.

        Raises:
            TaskError: no single list of blocks, fewer blocks than stages, a module with parameters called
                between two blocks, or a forward that cannot run on ``meta``.
        """
        container, blocks = _blocks_of(model, task)
        if len(blocks) < stages:
            raise TaskError(
                f"{flag or f'--pp {stages}'}: {type(model).__name__} of task {task.name!r} has {len(blocks)} block(s) "
                "to cut, fewer than the stages"
            )
        calls = _record_calls(task, model, container, blocks, micro_batch)
        ranges = stage_block_ranges(len(blocks), stages)
        before, after, unused = calls
        names_of: dict[str, list[str]] = {}
        for name, module in model.named_modules():
            names_of[name] = [
                f"{name}.{pname}" if name else pname for pname, p in module._parameters.items() if p is not None
            ]
        stage_parameters: list[set[str]] = [set() for _ in range(stages)]
        for stage, blocks_range in enumerate(ranges):
            for index in blocks_range:
                prefix = f"{container}.{index}"
                for name in names_of:
                    if name == prefix or name.startswith(prefix + "."):
                        stage_parameters[stage].update(names_of[name])
        for name in before + unused:
            stage_parameters[0].update(names_of[name])
        for name in after:
            stage_parameters[-1].update(names_of[name])
        return cls(container, len(blocks), ranges, before, stage_parameters)


def _blocks_of(model: nn.Module, task: ProbeTask) -> tuple[str, list[nn.Module]]:
    lists = [(name, module) for name, module in model.named_modules() if isinstance(module, nn.ModuleList)]
    if task.shard_classes:
        blocks = [m for m in model.modules() if isinstance(m, task.shard_classes)]
        for name, module in lists:
            if blocks and list(module.children()) == blocks:
                return name, blocks
        raise TaskError(
            f"--pp: the blocks of task {task.name!r} (its shard_classes) are not the children of one nn.ModuleList"
        )
    top = [(n, m) for n, m in lists if not any(n.startswith(other + ".") for other, _ in lists if other != n)]
    if len(top) != 1:
        raise TaskError(
            f"--pp: {type(model).__name__} of task {task.name!r} has {len(top)} top-level nn.ModuleList(s), not one "
            "list of blocks to cut into stages; name the block classes (ProbeTask(shard_classes=(Block,)))"
        )
    return top[0][0], list(top[0][1].children())


def _meta_batch(task: ProbeTask, micro_batch: int) -> Any:
    return map_tensors(lambda tensor: tensor.to("meta"), task.batch(micro_batch))


def _meta_forward(task: ProbeTask, model: nn.Module, micro_batch: int) -> None:
    """The task's loss on ``meta`` up to the end of the model's forward (what the loss does after it, a
    ``.item()`` on a count of tokens, say, cannot run on ``meta`` and calls no module)."""

    def stop(module: nn.Module, args: Any, output: Any) -> None:
        raise _StageExit(output)

    handle = model.register_forward_hook(stop)
    # A memory policy turns an hf: model's KV cache off (autotune/measure/policies.py), on the config the stages
    # share with this meta copy; without a cache transformers looks for packed sequences in the position ids, a
    # value read that cannot run on meta. The cache changes no shape that crosses a stage (Llama 3.1 8B at
    # --ac full stopped here).
    config: Any = getattr(model, "config", None)
    cache = getattr(config, "use_cache", None)
    if cache is False:
        config.use_cache = True
    try:
        with torch.no_grad(), torch.device("meta"):
            task.compute_loss(model, _meta_batch(task, micro_batch))
    except _StageExit:
        pass
    finally:
        handle.remove()
        if cache is False:
            config.use_cache = False


def _record_calls(
    task: ProbeTask, model: nn.Module, container: str, blocks: list[nn.Module], micro_batch: int
) -> tuple[list[str], list[str], list[str]]:
    """The modules with parameters (outside the blocks) that one meta forward calls before the first block,
    after the last, and never."""
    inside = {name for name, _ in model.named_modules() if name == container or name.startswith(container + ".")}
    owners = [(name, m) for name, m in model.named_modules() if name not in inside and _owns_parameters(m)]
    state = {"blocks_started": 0, "blocks_done": 0}
    before: list[str] = []
    after: list[str] = []
    between: list[str] = []
    handles = []

    def block_pre(module: nn.Module, args: Any) -> None:
        state["blocks_started"] += 1

    def block_post(module: nn.Module, args: Any, output: Any) -> None:
        state["blocks_done"] += 1

    for block in blocks:
        handles.append(block.register_forward_pre_hook(block_pre))
        handles.append(block.register_forward_hook(block_post))

    def owner_pre(name: str) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if state["blocks_started"] == 0:
                where = before
            elif state["blocks_done"] == len(blocks):
                where = after
            else:
                where = between
            if name not in where:
                where.append(name)

        return hook

    for name, module in owners:
        if not name:  # parameters on the root itself: held by every stage (below)
            continue
        handles.append(module.register_forward_pre_hook(owner_pre(name)))
    try:
        _meta_forward(task, model, micro_batch)
    except TaskError:
        raise
    except Exception as exc:
        first_line = (str(exc).strip().splitlines() or [""])[0]
        raise TaskError(
            f"--pp: the forward of task {task.name!r} could not run on the meta device to find its stages: "
            f"{type(exc).__name__}: {first_line}"
        ) from None
    finally:
        for handle in handles:
            handle.remove()
    if between:
        raise TaskError(
            f"--pp: task {task.name!r} calls {', '.join(between)} between its blocks: a module with parameters "
            "outside the blocks cannot be placed on one stage"
        )
    if any(not name for name, _ in owners):
        before.insert(0, "")
    called = set(before) | set(after)
    unused = [name for name, _ in owners if name and name not in called]
    return before, after, unused


@dataclass
class _Shapes:
    """What crosses stage boundaries at one micro-batch size: each block's input and output, and the output of
    each module that runs before the blocks (shape, dtype)."""

    block_inputs: list[tuple[torch.Size, torch.dtype]]
    block_outputs: list[tuple[torch.Size, torch.dtype]]
    prefix_outputs: dict[str, tuple[torch.Size, torch.dtype] | None]


def _record_shapes(task: ProbeTask, model: nn.Module, layout: StageLayout, micro_batch: int) -> _Shapes:
    container = model.get_submodule(layout.container)
    blocks = list(container.children())
    inputs: list[tuple[torch.Size, torch.dtype]] = []
    outputs: list[tuple[torch.Size, torch.dtype]] = []
    prefix: dict[str, tuple[torch.Size, torch.dtype] | None] = {}
    handles = []

    def pre(module: nn.Module, args: Any, kwargs: Any) -> None:
        hidden = _hidden_of(args, kwargs)
        if hidden is None:
            raise TaskError(f"--pp: a block of task {task.name!r} was called with no tensor to pass between stages")
        inputs.append((hidden.shape, hidden.dtype))

    def post(module: nn.Module, args: Any, output: Any) -> None:
        out = _first_tensor(output)
        if out is None:
            raise TaskError(f"--pp: a block of task {task.name!r} returned no tensor to pass between stages")
        outputs.append((out.shape, out.dtype))

    def prefix_post(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            out = _first_tensor(output)
            prefix[name] = (out.shape, out.dtype) if out is not None else None

        return hook

    for block in blocks:
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post))
    for name in layout.prefix_modules:
        if name:
            handles.append(model.get_submodule(name).register_forward_hook(prefix_post(name)))
    try:
        _meta_forward(task, model, micro_batch)
    finally:
        for handle in handles:
            handle.remove()
    return _Shapes(inputs, outputs, prefix)


def _materialize_parameters(model: nn.Module, keep: set[str], device: torch.device) -> None:
    """Storage on ``device`` for the parameters named in keep (shared ones stay shared) and every buffer; the
    other parameters stay on ``meta``."""
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules(remove_duplicate=False):
            for name, param in module._parameters.items():
                full = f"{module_name}.{name}" if module_name else name
                if param is None or (full not in keep and id(param) not in made):
                    continue
                if id(param) not in made:
                    made[id(param)] = nn.Parameter(
                        torch.empty_like(param, device=device), requires_grad=param.requires_grad
                    )
                module._parameters[name] = made[id(param)]  # type: ignore[assignment]
            for name, buffer in module._buffers.items():
                if buffer is None:
                    continue
                if id(buffer) not in made:
                    made[id(buffer)] = torch.empty_like(buffer, device=device)
                module._buffers[name] = made[id(buffer)]


@dataclass
class _Flow:
    """What the stage's hooks read and write during one forward."""

    arrival: torch.Tensor | None = None
    output: Any = None
    shapes: _Shapes | None = None


@dataclass
class _Stage:
    index: int
    stages: int
    model: nn.Module
    flow: _Flow
    first_block: int
    block_count: int
    handles: list[Any] = field(default_factory=list)

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1


def _meta_model(task: ProbeTask) -> nn.Module:
    model = build_on_meta(task)
    if model is None:
        raise TaskError(f"--pp: model() of task {task.name!r} cannot be built on the meta device to cut it into stages")
    return model


def _keep_blocks(layout: StageLayout, stage: int, model: nn.Module) -> list[nn.Module]:
    """Drop the blocks the stage does not hold from the model's list; the blocks kept."""
    parent_name, _, attribute = layout.container.rpartition(".")
    parent = model.get_submodule(parent_name)
    blocks = list(getattr(parent, attribute).children())
    kept = [blocks[i] for i in layout.ranges[stage]]
    setattr(parent, attribute, nn.ModuleList(kept))
    return kept


def _shard_on_meta(
    task: ProbeTask, layout: StageLayout, stage: int, model: nn.Module, strategy: StageStrategy
) -> set[int]:
    """A sharding strategy's stage, on ``meta`` (outside the meter's span: no storage yet): the other blocks
    dropped, the task's memory policy applied, then wrapped. The ids of the parameters it does not hold (they
    keep their identity; the ones it holds are replaced by their shards)."""
    keep = layout.stage_parameters[stage]
    held = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in keep}
    _keep_blocks(layout, stage, model)
    model.train()
    apply_policy(model, task.activation_checkpointing, task.shard_classes, task_name=task.name)
    # Its blocks' saved activations in host memory, around the policy's wrapper, before FSDP2 wraps them (as
    # build_model leaves a whole model for compose()).
    apply_offload(model, task.offload, task.shard_classes, task_name=task.name)
    not_held = {id(p) for p in model.parameters() if id(p) not in held}
    strategy.shard_stage(model, task, not_held)
    return not_held


def _materialize_shards(model: nn.Module, not_held: set[int], device: torch.device) -> None:
    """Storage on ``device`` for the shards of the parameters the stage holds (``to_empty`` module by module, as
    torchtitan gives a sharded model storage) and for every buffer; small normal values for the shards."""
    made: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for module in model.modules():
            params = [p for p in module._parameters.values() if p is not None]
            if any(id(p) not in not_held for p in params):
                module.to_empty(device=device, recurse=False)
            for name, buffer in module._buffers.items():
                if buffer is None or not buffer.is_meta:
                    continue
                if id(buffer) not in made:
                    made[id(buffer)] = torch.empty_like(buffer, device=device)
                module._buffers[name] = made[id(buffer)]
        for param in model.parameters():
            if param.is_meta:
                continue
            local = param.to_local() if hasattr(param, "to_local") else param
            if local.is_floating_point():
                local.normal_(0.0, 0.02)
            else:
                local.zero_()
        for buffer in model.buffers():
            buffer.zero_()


def _build_stage(
    task: ProbeTask,
    layout: StageLayout,
    stage: int,
    device: torch.device,
    model: nn.Module,
    not_held: set[int] | None = None,
    compile_blocks: bool = False,
) -> _Stage:
    """The stage's module: ``model``, the task's model on ``meta`` (built outside any meter's span: under the
    fake meter's mode meta tensors would come out fake), its own parameters given storage and initialised, the
    other blocks dropped, hooks that make its forward the stage's. ``not_held`` (from :func:`_shard_on_meta`):
    the model is already cut and sharded, and only its shards are given storage."""
    stages = len(layout.ranges)
    if not_held is not None:
        _materialize_shards(model, not_held, device)
        kept = list(model.get_submodule(layout.container).children())
    else:
        _materialize_parameters(model, layout.stage_parameters[stage], device)
        kept = _keep_blocks(layout, stage, model)
        _initialise(model)
        model.train()
        # The task's memory policy and offload on the stage's blocks, as build_model applies them to a whole model.
        apply_policy(model, task.activation_checkpointing, task.shard_classes, task_name=task.name)
        apply_offload(model, task.offload, task.shard_classes, task_name=task.name)
    if task.compile is not None and compile_blocks:
        _compile_blocks(kept, task.compile, task.activation_checkpointing)
    flow = _Flow()
    built = _Stage(stage, stages, model, flow, layout.ranges[stage].start, len(kept))

    if stage < stages - 1:

        def stop(module: nn.Module, args: Any, output: Any) -> None:
            raise _StageExit(output)

        built.handles.append(kept[-1].register_forward_hook(stop))
    if stage > 0:

        def arrive(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            assert flow.arrival is not None
            if args and isinstance(args[0], torch.Tensor):
                if args[0] is flow.arrival:
                    return None
                return (flow.arrival, *args[1:]), kwargs
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": flow.arrival}
            return None

        # prepend: before a wrapper's own pre-hook (FSDP2's), which then sees the arrival as the real stage's does.
        built.handles.append(kept[0].register_forward_pre_hook(arrive, with_kwargs=True, prepend=True))
        for name in layout.prefix_modules:
            if name:
                _stub(model.get_submodule(name), name, flow, layout.ranges[stage].start)

    def capture(module: nn.Module, args: Any, output: Any) -> None:
        flow.output = output

    built.handles.append(model.register_forward_hook(capture))
    return built


def _compile_blocks(blocks: list[nn.Module], mode: str, policy: str) -> None:
    """Each block's forward compiled (torchtitan's ``apply_compile`` under a pipeline: one graph per block, the stage's
    cut and its hooks outside them), lazily: its first call compiles, under ``budget:R`` with the compiler's
    activation memory budget at R (each block's graph partitioned under it)."""
    from autotune.measure.meters.compiled import (
        compile_model,
        fresh_compiler_for,
        quiet_grad_reads,
        under_memory_budget,
    )

    fresh_compiler_for(policy)
    for block in blocks:
        compiled = compile_model(block.forward, mode)  # type: ignore[arg-type]
        forward = quiet_grad_reads(under_memory_budget(compiled, policy))
        block.forward = _no_pending_collective_inputs(forward)  # type: ignore[method-assign]


# torch's limit the composition meets where a tp plan parallelizes a module before the blocks (transformers' plans
# shard the embedding row-wise): the one line a compiled stage's first block says (_no_pending_collective_inputs).
PENDING_COLLECTIVE_INPUT = (
    "--compile under --pp with --tp: the stage's first compiled block gets the tp-parallel embedding's output as "
    "funcol's AsyncCollectiveTensor (the all-reduce not waited yet), and in this torch a compiled function given one "
    "that requires grad hands its gradient back as a plain tensor, which DTensor's backward cannot take "
    "(AttributeError: '_local_tensor'; the same job built by hand fails so): probe it eager, or compile it without "
    "--pp"
)


def _no_pending_collective_inputs(forward: Callable[..., Any]) -> Callable[..., Any]:
    """``forward``, refusing in one line (:data:`PENDING_COLLECTIVE_INPUT`) an input that is funcol's
    AsyncCollectiveTensor requiring grad, before the compiled graph runs: its backward would fail in DTensor's."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    def call(*args: Any, **kwargs: Any) -> Any:
        for value in (*args, *kwargs.values()):
            if isinstance(value, AsyncCollectiveTensor) and value.requires_grad:
                value.trigger_wait()  # its collective done, not left for c10d's warning at the process's exit
                raise TaskError(PENDING_COLLECTIVE_INPUT)
        return forward(*args, **kwargs)

    return call


def _stub(module: nn.Module, name: str, flow: _Flow, first_block: int) -> None:
    """Run in place of a module the stage does not hold that the model calls before its blocks: the arriving
    activation where the module's output is what crosses into the stage's first block (the embedding: the same shape
    and dtype in the whole model's forward), else zeros broadcast to the shape (a stride-0 view of one element: no
    activation's worth of memory). Compared in the whole model's shapes, not the arrival's: under --cp (and a tp plan
    that shards the sequence) the arrival is the rank's part of the sequence, as the real stage's ``inputs_embeds``
    is, and what the model computes from it (the causal mask of transformers' models) must see that length too."""

    def forward(*args: Any, **kwargs: Any) -> torch.Tensor:
        assert flow.arrival is not None and flow.shapes is not None
        recorded = flow.shapes.prefix_outputs.get(name)
        if recorded is None or recorded == flow.shapes.block_inputs[first_block]:
            return flow.arrival
        shape, dtype = recorded
        return torch.zeros((), dtype=dtype, device=flow.arrival.device).expand(shape)

    module.forward = forward  # type: ignore[method-assign]


class _Replay:
    """One stage's steps: the schedule's forwards and backwards with the tensors torch's pipelining keeps."""

    def __init__(
        self,
        task: ProbeTask,
        stage: _Stage,
        strategy: StageStrategy,
        device: torch.device,
        schedule: str,
        microbatches: int,
        micro_batch: int,
        recorder: Any,
    ) -> None:
        self.task, self.stage, self.strategy, self.device = task, stage, strategy, device
        self.schedule, self.k, self.micro_batch = schedule, microbatches, micro_batch
        # The breakdown's recorder the steps tell what they do (trial.recorder_of: one that hears nothing unless the
        # stage's steps are recorded).
        self.recorder = recorder
        shapes = stage.flow.shapes
        assert shapes is not None
        # The crossing activations as the rank holds them (sequence parallel: its L / tp positions).
        self.input_meta = strategy.crossing_meta(shapes.block_inputs[stage.first_block])
        self.output_meta = strategy.crossing_meta(shapes.block_outputs[stage.first_block + stage.block_count - 1])

    def run(self, meter: Meter) -> None:
        stage, k, recorder = self.stage, self.k, self.recorder
        recorder.classify_model(stage.model)
        recorder.phase("step")  # the optimizer's construction
        optimizer = self.task.make_optimizer(stage.model)
        arrivals, grads_in = self.receive_buffers()
        for _ in range(OPTIMIZER_STEPS):
            recorder.phase("inputs")
            with self.strategy.step_batches(self.task, self.micro_batch, k, self.device) as batches:
                if self.schedule == "gpipe":
                    self._gpipe(batches, arrivals, grads_in)
                else:
                    self._one_f_one_b(batches, arrivals, grads_in)
                del batches
                # Within the step (torchtitan's train context wraps schedule.step, which reduces and scales them).
                self._backwards_ended()
            meter.checkpoint(FORWARD_BACKWARD)
            recorder.phase("step")
            # --offload params: the step runs on the host; a compiled step (torchao's) runs eagerly on fake tensors.
            with step_on_host(self.task.offload, optimizer), _fake_step(self.task, meter):
                optimizer.step()
                recorder.classify_optimizer(optimizer)
                optimizer.zero_grad(set_to_none=self.task.zero_grad_to_none)
            meter.checkpoint(STEP)

    def receive_buffers(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """PipelineStage's receive buffers, one per micro-batch, made once and kept for the schedule's life: the
        activations arriving from the previous stage and the gradients from the next (what the pipeline adds to a
        rank, its ``collectives`` in a breakdown)."""
        arrivals = [] if self.stage.first else [self._buffer(self.input_meta, fill="normal") for _ in range(self.k)]
        grads_in = [] if self.stage.last else [self._buffer(self.output_meta, fill="zero") for _ in range(self.k)]
        self.recorder.classify([*arrivals, *grads_in], "collectives")
        return arrivals, grads_in

    def _backwards_ended(self) -> None:
        """After the stage's last backward of the step: its gradients reduced by the strategy (FSDP2's
        reduce-scatter), then divided by K, as the schedule scales them before the step."""
        self.recorder.phase("step")
        self.strategy.grads_reduced(self.stage.model)
        with torch.no_grad():
            for param in self.stage.model.parameters():
                if param.grad is not None:
                    param.grad.div_(self.k)
        self.recorder.classify_gradients(self.stage.model)

    def _buffer(self, meta: tuple[torch.Size, torch.dtype], fill: str) -> torch.Tensor:
        shape, dtype = meta
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        with torch.no_grad():
            if fill == "normal" and buffer.is_floating_point():
                buffer.normal_()
            else:
                buffer.zero_()
        return buffer

    def _forward(self, index: int, batches: list[Any], arrivals: list[torch.Tensor]) -> tuple[Any, Any]:
        """One forward: (what the stage keeps for its backward, its output)."""
        stage, flow = self.stage, self.stage.flow
        self.recorder.phase("forward")
        if not stage.first:
            flow.arrival = self.strategy.arriving(arrivals[index].requires_grad_(True))
        flow.output = None
        loss = None
        try:
            with (
                self.strategy.loss_context(),
                self.strategy.autocast(self.task.precision, self.device),
                warnings.catch_warnings(),
            ):
                # Under tp a stage's output (a block's, or the gathered logits) is a DTensor's local view, as the real
                # stage returns it; FSDP2 warns of in-place ops on such a view, which the replay does not run.
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
                try:
                    loss = self.task.compute_loss(stage.model, batches[index])
                except _StageExit as stop:
                    stop.output = self.strategy.forward_ended(stage.model, stop.output)
                    raise
        except _StageExit as stop:
            output = _first_tensor(stop.output)
            if output is not None:
                output = self.strategy.leaving(output)
        else:
            output = flow.output
        finally:
            flow.arrival = None
            flow.output = None
        return (output, loss), output

    def _backward(self, index: int, cache: dict[int, Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]):
        """One backward: the gradient of the stage's input (None on the first stage)."""
        (output, loss) = cache.pop(index)
        self.recorder.phase("backward")
        self.strategy.backward_begins(self.stage.model)
        if self.stage.last:
            with self.strategy.loss_context():
                torch.autograd.backward([loss])
        else:
            torch.autograd.backward([output], grad_tensors=[grads_in[index]])
        del output, loss
        self.recorder.classify_gradients(self.stage.model)
        if self.stage.first:
            return None
        grad = arrivals[index].grad
        arrivals[index].grad = None
        return grad

    def _gpipe(self, batches: list[Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]) -> None:
        cache: dict[int, Any] = {}
        losses: list[Any] = []
        sent_outputs: list[torch.Tensor] = []  # every forward send is waited on after the forward phase
        output = None
        for index in range(self.k):
            kept, output = self._forward(index, batches, arrivals)
            cache[index] = kept
            losses.append(kept[1])
            if not self.stage.last:
                sent_outputs.append(output.detach())
        sent_grads: list[torch.Tensor] = []  # and every backward send after the backward phase
        for index in range(self.k):
            grad = self._backward(index, cache, arrivals, grads_in)
            if grad is not None:
                sent_grads.append(grad)
            del grad
        del losses, sent_outputs, sent_grads, output

    def _one_f_one_b(self, batches: list[Any], arrivals: list[torch.Tensor], grads_in: list[torch.Tensor]) -> None:
        stage, k = self.stage, self.k
        cache: dict[int, Any] = {}
        losses: list[Any] = []
        warmup = min(k, stage.stages - stage.index)
        send_work: list[torch.Tensor] = []
        fwd_sends: list[torch.Tensor] = []
        bwd_sends: list[torch.Tensor] = []
        output = None
        forward = backward = 0
        for _ in range(warmup):
            kept, output = self._forward(forward, batches, arrivals)
            cache[forward] = kept
            losses.append(kept[1])
            del kept
            fwd_sends = [] if stage.last else [output.detach()]
            if forward != warmup - 1:
                send_work = list(fwd_sends)
            forward += 1
        while True:
            grad = self._backward(backward, cache, arrivals, grads_in)
            bwd_sends = [] if grad is None else [grad]
            del grad
            backward += 1
            if forward == k:
                break
            kept, output = self._forward(forward, batches, arrivals)
            cache[forward] = kept
            losses.append(kept[1])
            del kept
            fwd_sends = [] if stage.last else [output.detach()]
            forward += 1
        send_work = list(bwd_sends)
        while backward < k:
            grad = self._backward(backward, cache, arrivals, grads_in)
            bwd_sends = [] if grad is None else [grad]
            del grad
            send_work = list(bwd_sends)
            backward += 1
        del losses, send_work, fwd_sends, bwd_sends, output


class _InterleavedReplay:
    """One rank's steps under interleaved 1F1B: its V stages (chunks) built side by side, each with its receive
    buffers and its own optimizer (torchtitan builds one per model part), the actions in the schedule's order.
    The runtime of torch's multi-stage schedules waits on every send only when the step ends: every output
    and every input gradient sent in a step stays referenced until then.

    Over FSDP2 the runtime (``_PipelineScheduleRuntime``, lowered by ``_add_unshard_reshard`` and
    ``_add_reduce_grad``) adds its own actions, replayed through the strategy's hooks: every chunk's units are
    gathered when the step starts (UNSHARD, asynchronously, in the order the chunks first compute; waited on before
    the chunk's first compute), and right after a chunk's last backward its gradients are reduce-scattered and
    divided by K (REDUCE_GRAD, ``perform_reduce_grad``), then its units resharded (RESHARD), while the other chunk
    may still run backwards."""

    def __init__(self, chunks: list[_Replay], ranks: int) -> None:
        self.chunks, self.ranks = chunks, ranks

    def run(self, meter: Meter) -> None:
        chunks = self.chunks
        task, k, strategy = chunks[0].task, chunks[0].k, chunks[0].strategy
        recorder = chunks[0].recorder
        for chunk in chunks:
            recorder.classify_model(chunk.stage.model)
        recorder.phase("step")  # the optimizers' construction
        optimizers = [task.make_optimizer(chunk.stage.model) for chunk in chunks]
        buffers = [chunk.receive_buffers() for chunk in chunks]
        arrivals = [arriving for arriving, _ in buffers]
        grads_in = [grads for _, grads in buffers]
        del buffers
        rank = chunks[0].stage.index
        actions = interleaved_actions(rank, self.ranks, k, len(chunks))
        first_computes = list(dict.fromkeys(local for _, local, _ in actions))
        last_backward = {local: position for position, (kind, local, _) in enumerate(actions) if kind == "B"}
        for _ in range(OPTIMIZER_STEPS):
            recorder.phase("inputs")
            with strategy.step_batches(task, chunks[0].micro_batch, k, chunks[0].device) as batches:
                pending = {local: strategy.unshard_begins(chunks[local].stage.model) for local in first_computes}
                caches: list[dict[int, Any]] = [{} for _ in chunks]
                losses: list[Any] = []
                sent: list[torch.Tensor] = []
                for position, (kind, local, index) in enumerate(actions):
                    chunk = chunks[local]
                    strategy.unshard_waited(pending.pop(local, []))
                    if kind == "F":
                        kept, output = chunk._forward(index, batches, arrivals[local])
                        caches[local][index] = kept
                        if chunk.stage.last:
                            losses.append(kept[1])
                        else:
                            sent.append(output.detach())
                        del kept, output
                        continue
                    grad = chunk._backward(index, caches[local], arrivals[local], grads_in[local])
                    if grad is not None:
                        sent.append(grad)
                    del grad
                    if position == last_backward[local]:
                        chunk._backwards_ended()
                        strategy.stage_resharded(chunk.stage.model)
                del batches
            del sent, losses, caches, pending
            meter.checkpoint(FORWARD_BACKWARD)
            recorder.phase("step")
            for optimizer in optimizers:
                # --offload params: the step runs on the host; a compiled step runs eagerly on fake tensors.
                with step_on_host(task.offload, optimizer), _fake_step(task, meter):
                    optimizer.step()
                    recorder.classify_optimizer(optimizer)
                    optimizer.zero_grad(set_to_none=task.zero_grad_to_none)
            meter.checkpoint(STEP)


@contextmanager
def _hooks_removed(stages: list[_Stage]) -> Iterator[None]:
    try:
        yield
    finally:
        for stage in stages:
            for handle in stage.handles:
                handle.remove()


# One stage's measurement (the meter's reading, oom) -> the figure the search decides on, with oom.
StageFigure = Callable[[Callable[[], tuple[MemoryReading, bool]]], tuple[MemoryReading, bool]]


class PipelineTrials:
    """Trials of every stage of a pipeline at a micro-batch size, one stage at a time on one meter.

    Called with m, it measures each stage's two steps (the stage built inside the measured span, so its
    weights are counted and only one stage is alive at a time) and returns one Trial for the pipeline: the
    most loaded stage's peak (``stage_peaks[m]`` keeps every stage's), fitting when every stage fits; an OOM
    on any stage is the size's OOM.
    """

    def __init__(
        self,
        task: ProbeTask,
        meter: Meter,
        *,
        limit_bytes: int,
        stages: int,
        schedule: str,
        microbatches: int,
        virtual_stages: int = 1,
        strategy: Strategy | None = None,
        stage_figure: StageFigure | None = None,
        host_limit_bytes: int | None = None,
    ) -> None:
        refusal = pipeline_refusal(schedule, stages, microbatches, None)
        if refusal is not None:
            raise AutotuneError(refusal)
        self.task, self.meter, self.limit_bytes = task, meter, limit_bytes
        # --host-budget under --offload: a size whose most loaded rank holds more host bytes does not fit either.
        self.host_limit_bytes = host_limit_bytes
        self.stages, self.schedule, self.microbatches = stages, schedule, microbatches
        self.virtual_stages = virtual_stages if schedule == "interleaved-1f1b" else 1
        strategy = strategy or StageStrategy(1)
        if not isinstance(strategy, StageStrategy):  # autotune/measure/strategy_choice.py makes one for pp > 1
            raise AutotuneError(f"--pp {stages}: a stage is held by a stage strategy, not {type(strategy).__name__}")
        self.strategy: StageStrategy = strategy
        # The task's own compile and offload too (a task file's), not only the flags', over the stages' strategy.
        refuse_composition(
            Dimensions(
                strategy=getattr(strategy, "inner", "ddp"),
                world_size=max(stages, getattr(strategy, "world_size", stages)),
                pp=stages,
                tp=getattr(strategy, "tp", 1),
                cp=getattr(strategy, "cp", 1),
                compile=task.compile,
                offload=task.offload,
            )
        )
        # An emulated card's figure of a stage (autotune/emulation/card_search.py): the stage's allocations
        # replayed through the caching allocator; None: the meter's own reading.
        self.stage_figure = stage_figure
        self.warnings: list[str] = []
        self.stage_peaks: dict[int, list[int]] = {}
        # Under --offload: each stage's host bytes (autotune/measure/offload.py) at the size being measured.
        self.stage_host_peaks: dict[int, int] = {}
        # With a dict here, each stage's steps on a CPU or fake meter are recorded (autotune/measure/breakdown.py)
        # and the most loaded stage's peak broken down, kept by micro-batch (its stage named).
        self.breakdowns: dict[int, MemoryBreakdown] | None = None
        self.stage_breakdowns: dict[int, MemoryBreakdown | None] = {}  # the size being measured, by stage
        recorder = build_on_meta(task, self.warnings)
        if recorder is None:
            raise TaskError(
                f"--pp: model() of task {task.name!r} cannot be built on the meta device to cut it into stages"
            )
        # A meta copy of the whole model, whose forward at each size says what crosses the stages' boundaries.
        self._recorder: nn.Module = recorder
        flag = f"--pp {stages}" + (
            f" x --pp-virtual-stages {self.virtual_stages} = {stages * self.virtual_stages} stages"
            if self.virtual_stages > 1
            else ""
        )
        self.layout = StageLayout.of(task, recorder, stages * self.virtual_stages, 1, flag)

    def most_loaded(self, micro_batch: int) -> int:
        """The stage with the largest peak at micro_batch (the first of equals)."""
        peaks = self.stage_peaks[micro_batch]
        return peaks.index(max(peaks))

    def measure_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        """(the meter's reading, oom) of one stage's two steps at micro_batch; a compiled job's as a job that trains
        at micro_batch runs them: compiled static there by a fresh compiler, where its compilation has settled.

        A graph compiled for another size first (dynamo's automatic dynamic shapes make the second size's graph
        dynamic) holds other bytes than the static one a job at one m compiles (3,968 B less at m = 2 on the tiny tp
        Llama's stage 0 after m = 1), so each size starts from a fresh compiler at its first stage (as the static
        confirmation of a compiled trial does, autotune/search/static.py), whose later stages' graphs are static
        too. And a replay's first steps compile (the blocks' graphs, a recompilation for a stage whose inputs guard
        otherwise), where dynamo's guard tensors are made, the compiler's bytes and not the job's: a replay that
        compiled is replayed again, and the one that compiled nothing is the stage's (as a compiled trial is measured
        after its warm-up)."""
        if self.task.compile is None or not compiles_on(self.meter):
            return self._recorded_stage(stage_index, micro_batch)
        if stage_index == 0:
            torch._dynamo.reset()
            gc.collect()
        with static_shapes():
            for _ in range(SETTLING_REPLAYS):
                compiled_before = graphs_compiled()
                reading, oom = self._recorded_stage(stage_index, micro_batch)
                if graphs_compiled() == compiled_before:  # an OOM's too: its figure is the settled one's
                    break
        return reading, oom

    def _recorded_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        recorder = self._breakdown_recorder()
        with recorder.recording(self.meter) if recorder is not None else nullcontext():
            reading, oom = self._measure_stage(stage_index, micro_batch)
        if recorder is not None:
            fits = not oom and reading.peak_bytes <= self.limit_bytes
            found = recorder.breakdown(micro_batch, fits, reading.peak_bytes)
            if found is not None:  # the stage's host by part: the ledger's take at the stage's end
                found = with_host_parts(found, self.stage_host_peaks.get(stage_index), HOST.peak_parts)
            self.stage_breakdowns[stage_index] = found
        return reading, oom

    def _breakdown_recorder(self) -> Any:
        """A breakdown's recorder for a stage's steps where breakdowns are asked for and the meter is the CPU's (its
        dispatch count, the compiled job's allocator count) or fake tensors (an estimate's; an emulated card's, whose
        figure the stage's live parts are then completed to: :meth:`__call__`). Not a compiled job's fake stages, which
        run it eager (a plain estimate's fake trials of one are not broken down either)."""
        from autotune.measure.breakdown import BreakdownRecorder
        from autotune.measure.meters.cpu import CpuMeter

        eager_stand_in = self.task.compile is not None and isinstance(self.meter, FakeMeter)
        wanted = self.breakdowns is not None and not eager_stand_in
        return BreakdownRecorder() if wanted and isinstance(self.meter, CpuMeter | FakeMeter) else None

    def _measure_stage(self, stage_index: int, micro_batch: int) -> tuple[MemoryReading, bool]:
        shapes = _record_shapes(self.task, self._recorder, self.layout, micro_batch)
        meter = self.meter
        oom = False
        # Rank r holds stages r, r + pp, ... (one but under interleaved 1F1B).
        indices = [stage_index + chunk * self.stages for chunk in range(self.virtual_stages)]
        metas = [_meta_model(self.task) for _ in indices]
        # A sharding strategy cuts and wraps each stage on meta first, each on its own (torchtitan's model parts):
        # only its shards are ever given storage.
        not_held = [
            _shard_on_meta(self.task, self.layout, index, meta, self.strategy) if self.strategy.shards else None
            for index, meta in zip(indices, metas, strict=True)
        ]
        # A compiled job's blocks run compiled where the meter runs real tensors (fake ones run eager: dynamo does not
        # trace them, autotune/measure/meters/compiled.py).
        compiled = compiles_on(meter)
        HOST.take_peak()  # the host's peak restarts with the stage's, as a trial's does
        try:
            with meter.measure():
                replays = []
                recorder = recorder_of(meter)
                for index, held in zip(indices, not_held, strict=True):
                    stage = _build_stage(
                        self.task, self.layout, index, meter.device, metas.pop(0), held, compile_blocks=compiled
                    )
                    self.strategy.stage_built(stage.model)
                    # --offload params: the stage's shards and, from their reduce-scatter on, its gradients'
                    # are host memory (FSDP2's CPUOffloadPolicy, applied where fsdp shards the stage).
                    offload_params_to_host(stage.model, self.task.offload, meter)
                    # DDP's buckets over the stage's replicas: what the mesh adds (ddp with D > 1).
                    recorder.classify(getattr(stage.model, "_autotune_ddp_buckets", ()), "collectives")
                    stage.flow.shapes = shapes
                    replays.append(
                        _Replay(
                            self.task,
                            stage,
                            self.strategy,
                            meter.device,
                            self.schedule,
                            self.microbatches,
                            micro_batch,
                            recorder,
                        )
                    )
                del stage
                with _hooks_removed([replay.stage for replay in replays]):
                    if self.schedule == "interleaved-1f1b":
                        _InterleavedReplay(replays, self.stages).run(meter)
                    else:
                        replays[0].run(meter)
                del replays
        except Exception as exc:
            release_failed_backward()  # a graph whose backward raised is autograd's until the next backward
            if not is_oom(exc):
                raise
            oom = True
        reading = meter.reading()
        if self.task.offload != "none":
            self.stage_host_peaks[stage_index] = HOST.take_peak()
        meter.release()
        return reading, oom

    def __call__(self, micro_batch: int) -> Trial:
        started = time.perf_counter()
        readings: list[MemoryReading] = []
        oom = False
        self.stage_breakdowns = {}
        self.stage_host_peaks = {}
        for stage_index in range(self.stages):
            if self.stage_figure is None:
                reading, oom = self.measure_stage(stage_index, micro_batch)
            else:
                reading, oom = self.stage_figure(functools.partial(self.measure_stage, stage_index, micro_batch))
                self._on_card(stage_index, reading, oom)
            readings.append(reading)
            if oom:
                break
        peaks = [reading.peak_bytes for reading in readings]
        if not oom:
            self.stage_peaks[micro_batch] = peaks
        heaviest_index = len(readings) - 1 if oom else peaks.index(max(peaks))
        heaviest = readings[heaviest_index]
        found = self.stage_breakdowns.get(heaviest_index)
        if self.breakdowns is not None and found is not None:
            self.breakdowns[micro_batch] = found.model_copy(update={"stage": heaviest_index})
        # Each rank's host bytes are its own (a stage's offloaded activations): the trial's is the most any holds.
        host_peak = max(self.stage_host_peaks.values()) if self.stage_host_peaks else None
        over_host = exceeds_host_budget(host_peak, self.host_limit_bytes)
        return Trial(
            micro_batch=micro_batch,
            peak_bytes=heaviest.peak_bytes,
            fits=(not oom) and heaviest.peak_bytes <= self.limit_bytes and not over_host,
            oom=oom,
            seconds=round(time.perf_counter() - started, 6),
            forward_backward_bytes=None if oom else heaviest.forward_backward_bytes,
            step_bytes=None if oom else heaviest.step_bytes,
            allocated_bytes=heaviest.allocated_bytes,
            outside_allocator_bytes=heaviest.outside_allocator_bytes,
            host_peak_bytes=host_peak,
            fake=isinstance(self.meter, FakeMeter),
        )

    def _on_card(self, stage_index: int, reading: MemoryReading, oom: bool) -> None:
        """A stage's live breakdown completed to its card figure (reserved + outside the allocator: the allocator's
        reserve beyond the live peak and the memory outside it as parts of their own), or dropped where the figure
        cannot be broken down (an OOM, a reserve below the live peak)."""
        from autotune.measure.breakdown import with_card_parts

        live = self.stage_breakdowns.pop(stage_index, None)
        if live is None or oom:
            return
        outside = reading.outside_allocator_bytes or 0
        on_card = with_card_parts(
            live,
            reserved_bytes=reading.peak_bytes - outside,
            outside_bytes=outside,
            fits=reading.peak_bytes <= self.limit_bytes,
        )
        if on_card is not None:
            self.stage_breakdowns[stage_index] = on_card

    def build(self) -> float:
        return 0.0

    def close(self) -> None:
        self.meter.release()
