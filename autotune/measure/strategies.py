"""Strategies: what one device holds of the model, and the process group it runs in.

A strategy is a small object with one job: set up the process group a trial runs in, wrap the
model the way the job does, and say which micro-batches synchronise gradients.

- ``ddp`` (default): every replica holds the whole model. With world size D > 1 the model is
  wrapped in DistributedDataParallel inside a one-process group, so that its gradient buckets are
  counted; only the last micro-batch of a group all-reduces (``no_sync`` on the others).
- ``fsdp``: FSDP2 (``fully_shard``) over N ranks. One process answers for rank 0 of N through a
  fake process group of size N: ``fully_shard`` really shards (each rank holds 1/N of parameters,
  gradients and optimizer state), the collectives do nothing, and the buffers FSDP allocates for
  them are real. Each repeated block (a child of an ``nn.ModuleList``, or the task's
  ``shard_classes``) is a unit, then the root, as torchtitan's ``apply_fsdp`` wraps a llama: the last
  block is not resharded after forward (backward all-gathers it first, so freeing it would only gather
  it again at once), every other block is; FSDP2 keeps the root unsharded after forward by itself.
  Precision as torchtitan runs it: under ``bf16`` the units get FSDP2's ``MixedPrecisionPolicy``
  (parameters cast to bf16 when gathered, gradients reduced in fp32) and there is no autocast, FSDP2's
  documented way; ``bf16-autocast`` adds autocast on top of that policy (accelerate's way, and what
  ``bf16`` meant here before). fp16 keeps the policy and autocast (with GradScaler). Gradients
  are reduce-scattered after every micro-batch, as torchtitan does by default: accumulating
  unsharded gradients (``set_requires_gradient_sync(False)``) would hold a whole unsharded copy per
  unit and defeat the point of sharding.
- ``--tp N`` (``TensorParallel``, with either of the above over the data-parallel replicas): rank 0 of a
  tensor-parallel group of a ``(dp, tp)`` mesh in a fake process group of the world size, the model
  parallelized by DTensor with the plan of autotune/measure/tensor_parallel.py (docs/meshes.md). Under ddp with
  D > 1 the trial holds DDP's gradient buckets of the rank's local shards (``hold_ddp_buckets``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError, TaskError
from autotune.core.mesh import Mesh
from autotune.measure.layout import Layout
from autotune.measure.parallelize import (
    FSDP_MIN_TORCH,
    LOW_PRECISION,
    Parallelism,
    compose,
    fsdp_api,
    hold_ddp_buckets,
    shard_units,
)
from autotune.tasks.task import ProbeTask

__all__ = [
    "FSDP_MIN_TORCH",
    "FakeReplicas",
    "Replicated",
    "Sharded",
    "Strategy",
    "TensorParallel",
    "hold_ddp_buckets",
    "shard_units",
]


class Strategy(ABC):
    """How a job holds its model on one device of world_size."""

    name: str

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    @abstractmethod
    def process_group(self, device: torch.device) -> AbstractContextManager[Any]:
        """The process group the trials run in (entered once per probe)."""

    @abstractmethod
    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        """The model as the job wraps it (inside ``process_group``)."""

    def sync(self, model: nn.Module, last: bool) -> AbstractContextManager[Any]:
        """Entered around each micro-batch; ``last`` is the group's last micro-batch."""
        return nullcontext()

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        """The dtype the forward runs under autocast in, or None for no autocast: every low precision
        autocasts under ddp (the weights stay fp32)."""
        return LOW_PRECISION.get(precision)

    def autocast(self, precision: str, device: torch.device) -> AbstractContextManager[Any]:
        """The autocast context a forward runs in at ``precision`` (a null one where there is none)."""
        dtype = self.autocast_dtype(precision)
        if dtype is None:
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=dtype)

    # Whether the tp plan keeps the logits sharded by vocabulary (torchtitan's): set where the plan is applied.
    loss_parallel = False

    def loss_context(self) -> AbstractContextManager[Any]:
        """Entered around each micro-batch's forward and backward: the loss's own context (torchtitan's tensor
        parallel computes the cross entropy on vocabulary shards under ``loss_parallel()``)."""
        if not self.loss_parallel:
            return nullcontext()
        from autotune.measure.tensor_parallel import measured_loss_parallel

        return measured_loss_parallel()

    @property
    def describes_replicas(self) -> bool:
        """Whether world_size counts whole-model replicas (ddp) rather than shards."""
        return True


class Replicated(Strategy):
    """DDP: the whole model on every replica; buckets counted when world_size > 1."""

    name = "ddp"

    def __init__(self, world_size: int) -> None:
        super().__init__(world_size)
        self._group: Any = None
        self.measures_buckets = False

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        if self.world_size <= 1:
            yield None
            return
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            # Inside a running job: its default group is the real one; DDP over it would talk to the
            # other ranks. Measure the buckets only when that group is this process alone.
            self._group = dist.group.WORLD if dist.get_world_size() == 1 else None
            self.measures_buckets = self._group is not None
            try:
                yield self._group
            finally:
                self._group = None
            return
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        self._group, self.measures_buckets = dist.group.WORLD, True
        try:
            yield self._group
        finally:
            self._group = None
            dist.destroy_process_group()

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        refuse_composition(Dimensions(offload=task.offload), TaskError)  # a task file's own offload too
        # DDP itself in its one-process group; none where there is none (one replica, or inside a job's own group).
        replicas = self.world_size if self._group is not None else 1
        return compose(model, task, device, Parallelism("ddp", replicas=replicas, group=self._group)).model

    def sync(self, model: nn.Module, last: bool) -> AbstractContextManager[Any]:
        # Under DDP only the last micro-batch of a group all-reduces, as a correct job does.
        if self._group is None or last:
            return nullcontext()
        return model.no_sync()  # type: ignore[operator,no-any-return]


class FakeReplicas(Replicated):
    """DDP for fake trials: DDP's constructor broadcasts the weights and its reducer reads gradient data, which fake
    tensors do not hold, so the model is not wrapped; what DDP adds to a replica's memory is held instead: the
    gradient buckets its reducer allocates when it is built, one flat tensor per bucket, beside the gradients
    (``gradient_as_bucket_view=False``, DDP's default). DDP's first bucketing puts every trainable parameter of one
    dtype and device in one bucket (torch's ``compute_bucket_size_limits``: no cap unless find_unused_parameters);
    the buckets it rebuilds after the first backward, 1 MiB then 25 MiB each, come to the same bytes once the old
    ones are freed, and a card's caching allocator cuts them from the segment the first one left. Only the
    last micro-batch of a step all-reduces, in place in the buckets: no bytes beyond them."""

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        self.measures_buckets = self.world_size > 1
        yield None

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        refuse_composition(Dimensions(offload=task.offload), TaskError)  # a task file's own offload too
        # No group: DDP's buckets alone (apply_ddp), none for one replica.
        return compose(model, task, device, Parallelism("ddp", replicas=self.world_size)).model

    def sync(self, model: nn.Module, last: bool) -> AbstractContextManager[Any]:
        return nullcontext()


class Sharded(Strategy):
    """FSDP2 over a fake process group of world_size: the figures are rank 0's."""

    name = "fsdp"

    def __init__(self, world_size: int, *, mesh: Any = None) -> None:
        refuse_composition(Dimensions.of("fsdp", world_size))
        super().__init__(world_size)
        # A mesh of a real process group (one process per rank, as the multi-process check runs
        # it): the probe then measures this rank as it is, with no fake group of its own.
        self._given_mesh = mesh
        self._mesh: Any = mesh

    @property
    def describes_replicas(self) -> bool:
        return False

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        # bf16 under FSDP2 is the MixedPrecisionPolicy alone: the units compute in bf16 because their
        # gathered parameters are bf16 (torchtitan); bf16-autocast and fp16 add autocast on top.
        if precision == "bf16":
            return None
        return super().autocast_dtype(precision)

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        fsdp_api()  # its one-line error where this torch has no fully_shard or fake process group
        import torch.distributed as dist

        if self._given_mesh is not None:
            yield self._given_mesh.get_group()
            return
        if dist.is_initialized():
            raise AutotuneError(
                "--strategy fsdp probes rank 0 of N through a fake process group, and a process group "
                "is already initialized in this process: probe before init_process_group, or from "
                "`autotune probe` in a process of its own"
            )
        with Layout(self.world_size).fake_device_mesh(device.type) as mesh:
            try:
                self._mesh = mesh
                yield dist.group.WORLD
            finally:
                self._mesh = None

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        return compose(model, task, device, Parallelism("fsdp", shard_mesh=self._mesh)).model


class TensorParallel(Strategy):
    """Rank 0 of W: the model parallelized over tp ranks, then (``inner`` fsdp) sharded over the D replicas."""

    def __init__(self, world_size: int, mesh: Mesh, *, inner: str = "ddp", device_mesh: Any = None) -> None:
        super().__init__(world_size)
        refuse_composition(Dimensions.of(inner, world_size, mesh))
        replicas = mesh.data_parallel(world_size)
        self.name = inner
        self.mesh = mesh
        self.replicas = replicas
        self.inner = inner
        # A (dp, tp) mesh of a real process group (one process per rank): the rank is measured as it is.
        self._given_mesh = device_mesh
        self._device_mesh: Any = device_mesh

    @property
    def describes_replicas(self) -> bool:
        return False

    def autocast_dtype(self, precision: str) -> torch.dtype | None:
        if self.inner == "fsdp" and precision == "bf16":
            return None  # FSDP2's MixedPrecisionPolicy alone, as Sharded runs it
        return super().autocast_dtype(precision)

    @contextmanager
    def process_group(self, device: torch.device) -> Iterator[Any]:
        fsdp_api()  # its one-line error where this torch has no fully_shard or fake process group
        import torch.distributed as dist

        if self._given_mesh is not None:
            yield self._given_mesh.get_group("tp")
            return
        if dist.is_initialized():
            raise AutotuneError(
                "--tp probes rank 0 of N through a fake process group, and a process group is already "
                "initialized in this process: probe before init_process_group, or from `autotune probe`"
            )
        with Layout(self.world_size, self.mesh).fake_device_mesh(device.type) as mesh:  # (dp, tp)
            try:
                self._device_mesh = mesh
                yield dist.group.WORLD
            finally:
                self._device_mesh = None

    def wrap(self, model: nn.Module, task: ProbeTask, device: torch.device) -> nn.Module:
        from autotune.measure.tensor_parallel import uses_loss_parallel

        # Under ddp with D > 1, DDP over the dp sub-mesh (torch's TP + DDP: DistributedDataParallel(device_mesh=dp)
        # swaps each DTensor parameter for its local tensor, _pre_dp_module_transform) allocates one flat bucket per
        # dtype of the local shards. Held (group None), real and fake trials alike, rather than built: that
        # transform leaves the DTensors as plain attributes after the first forward, so a model reused across
        # trials would hand the next trial's optimizer its norms alone; and the fake group cannot run DDP on fake
        # tensors. The real job's other bytes of DDP (its broadcast at construction) pass before the first forward.
        mesh = self._device_mesh
        parallelism = Parallelism(
            self.inner,
            replicas=self.replicas,
            tp_mesh=mesh["tp"],
            shard_mesh=mesh["dp"] if self.inner == "fsdp" else None,
        )
        composed = compose(model, task, device, parallelism)
        self.loss_parallel = uses_loss_parallel(composed.styles)
        return composed.model
