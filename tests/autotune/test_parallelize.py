"""compose() (autotune/measure/parallelize.py): each parallel dimension applied once, in torchtitan's fixed order
(tp, then cp, then fsdp or ddp). The exact figures of every composition are held against real ranks by the
real-process truths (test_tensor_parallel, test_context_parallel, test_pipeline_fsdp, test_fsdp); these check the
order and what each applier leaves on the model, against counts taken from the model built the ordinary way."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from autotune.core.mesh import Mesh
from autotune.measure.layout import Layout
from autotune.measure.parallelize import Parallelism, apply_ddp, compose
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import TWO_LAYERS, write_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

CPU = torch.device("cpu")


def _task(tmp_path: Path):  # type: ignore[no-untyped-def]
    return hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False, **TWO_LAYERS)).at_length(16)


def test_tp_then_fsdp_leaves_every_parameter_sharded_over_both_dimensions(tmp_path: Path) -> None:
    """fsdp after tp: every parameter is a DTensor, the plan's over the (dp, tp) mesh (sharded on tp, then on dp),
    the rest (the norms) over dp alone. fsdp first would leave the plan's weights sharded on dp only."""
    from torch.distributed.tensor import DTensor, Shard

    task = _task(tmp_path)
    model = task.model()
    whole = {name: p.numel() for name, p in model.named_parameters()}  # the ordinary count
    with Layout(4, Mesh(tp=2)).fake_device_mesh("cpu") as mesh:
        composed = compose(model, task, CPU, Parallelism("fsdp", replicas=2, tp_mesh=mesh["tp"], shard_mesh=mesh["dp"]))
        assert composed.model is model and "model.layers.0.self_attn.q_proj" in composed.styles
        params = dict(model.named_parameters())
        assert all(isinstance(p, DTensor) for p in params.values())
        planned = {name for name, p in params.items() if p.device_mesh.mesh_dim_names == ("dp", "tp")}
        assert all(params[name].device_mesh.mesh_dim_names == ("dp",) for name in set(params) - planned)
        assert "model.layers.0.self_attn.q_proj.weight" in planned and "model.norm.weight" not in planned
        assert params["model.layers.0.self_attn.q_proj.weight"].placements[1] == Shard(0)  # column-wise over tp
        # Rank 0's local elements: the planned weights quartered (half on tp, then half on dp), the rest halved.
        for name, p in params.items():
            assert p.to_local().numel() == -(-whole[name] // (4 if name in planned else 2)), name


def test_ddp_over_one_replica_is_the_model_itself_and_over_more_holds_the_buckets(tmp_path: Path) -> None:
    task = _task(tmp_path)
    model = task.model()
    assert apply_ddp(model, CPU, replicas=1) is model and not hasattr(model, "_autotune_ddp_buckets")
    next(iter(model.parameters())).requires_grad_(False)  # a frozen parameter is not in DDP's buckets
    assert apply_ddp(model, CPU, replicas=2) is model  # no group: the buckets alone
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    (bucket,) = model._autotune_ddp_buckets
    assert bucket.numel() == trainable and bucket.dtype == torch.float32


def test_a_stages_parameters_it_does_not_hold_are_left_out_of_tp_and_fsdp(tmp_path: Path) -> None:
    """A pipeline stage's other blocks stay plain tensors (never parallelized, ignored by FSDP2), its own are
    DTensors, and the whole plan comes back (whether it shards the sequence is the plan's)."""
    from torch.distributed.tensor import DTensor

    task = _task(tmp_path)
    model = task.model()
    not_held = frozenset(id(p) for p in model.model.layers[1].parameters())
    with Layout(8, Mesh(tp=2, pp=2)).fake_device_mesh("cpu") as mesh:
        parallelism = Parallelism("fsdp", tp_mesh=mesh["tp"], shard_mesh=mesh["dp"], not_held=not_held)
        composed = compose(model, task, CPU, parallelism)
        assert "model.layers.1.mlp.down_proj" in composed.styles  # the whole plan, the block not held too
        assert not any(isinstance(p, DTensor) for p in model.model.layers[1].parameters())
        assert all(isinstance(p, DTensor) for p in model.model.layers[0].parameters())


def test_cp_is_applied_after_tp_and_before_fsdp(tmp_path: Path) -> None:
    """The cp applier (a strategy's hooks) sees the model tp left (its planned weights DTensors already) and before
    FSDP2 (no fully_shard state on the root yet)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    task = _task(tmp_path)
    model = task.model()
    seen: list[tuple[bool, bool]] = []

    def context(module: torch.nn.Module) -> None:
        q_proj = module.model.layers[0].self_attn.q_proj.weight
        seen.append((isinstance(q_proj, DTensor), isinstance(module, FSDPModule)))

    with Layout(4, Mesh(tp=2)).fake_device_mesh("cpu") as mesh:
        parallelism = Parallelism("fsdp", tp_mesh=mesh["tp"], shard_mesh=mesh["dp"], context=context)
        compose(model, task, CPU, parallelism)
    assert seen == [(True, False)] and isinstance(model, FSDPModule)
