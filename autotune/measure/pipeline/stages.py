"""How a pipeline stage holds its part of the model: whole (over ddp, with the buckets of its data-parallel DDP) or
sharded (FSDP2, tp and cp over the stage's groups), and the hooks through which the replay drives its wrapper as
``PipelineStage`` does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.measure.layout import Layout
from autotune.measure.parallelize import Parallelism, apply_ddp, compose, fsdp_api
from autotune.measure.strategies import Strategy
from autotune.measure.trial import make_batch
from autotune.tasks.task import ProbeTask


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
