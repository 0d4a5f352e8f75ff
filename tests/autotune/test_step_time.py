"""The predicted step time's arithmetic (autotune/core/step_time.py), each rule on a hand-derived case: an operator
against the card, a collective by NCCL's model, the overlap each strategy allows, DDP's buckets, a pipeline's bubble,
and the figures a prediction needs (a missing one is named, never guessed)."""

from __future__ import annotations

import math

import pytest

from autotune.core.cards import PERFORMANCE, lookup, resolve_card
from autotune.core.step_records import CollectiveRecord, OpRecord, Segment, StepRecord
from autotune.core.step_time import (
    CONSTANTS,
    CardSpeed,
    Fabric,
    FigureOverrides,
    collective_seconds,
    op_seconds,
    predict_update,
    resolve_figures,
)

# A card whose figures make the arithmetic plain: 1 PFLOP/s bf16, 2 TB/s, matmuls at 80 %, 128 SMs.
SPEED = CardSpeed(dense_flops={"bf16": 1e15}, memory_bytes_per_s=2e12, gemm_fraction=0.8, sm_count=128,
                  capability_major=9)  # fmt: skip
FABRIC = Fabric(nvlink_bytes_per_s=450e9, nvlink_gpus=8, pcie_bytes_per_s=64e9, network_bytes_per_s=50e9)
ELEMENTWISE = 0.80  # the stated share of the memory's bandwidth (CONSTANTS), written here by hand


def elementwise(seconds: float, phase: str = "forward") -> OpRecord:
    """An elementwise op that takes ``seconds`` on SPEED: its bytes at 80 % of 2 TB/s."""
    return OpRecord(op=f"aten.add.Tensor:{seconds}:{phase}", kind="elementwise", dtype="bf16", phase=phase,  # type: ignore[arg-type]
                    flops=0, bytes=round(seconds * 2e12 * ELEMENTWISE))  # fmt: skip


def gather(seconds: float, overlap: str, phase: str = "forward", kind: str = "all_gather") -> CollectiveRecord:
    """A collective of 2 ranks on NVLink that takes ``seconds``: NCCL's 8.4 us base and one 3.4 us step, and half
    the buffer at 370 GB/s."""
    moved = (seconds - 8.4e-6 - 3.4e-6) * 370e9 * 2
    return CollectiveRecord(kind=kind, bytes=round(moved), group_size=2, phase=phase, overlap=overlap)  # type: ignore[arg-type]


def test_a_large_matmul_is_its_flops_at_the_cards_matmul_share() -> None:
    # 8192^3 in bf16: 2 x 8192^3 FLOPs at 0.8 x 1 PFLOP/s; 64 x 64 tiles of 128 fill 32 waves of 128 SMs exactly.
    mm = OpRecord(op="aten.mm.default", kind="gemm", dtype="bf16", phase="forward", flops=2 * 8192**3,
                  bytes=3 * 8192 * 8192 * 2, shape=(1, 8192, 8192, 8192))  # fmt: skip
    assert op_seconds(mm, SPEED) == pytest.approx(2 * 8192**3 / 0.8e15, rel=1e-9)


def test_a_small_matmul_pays_for_the_sms_its_tiles_leave_idle() -> None:
    # 256 x 256 out: 4 tiles on 128 SMs, 1/32 busy; K large enough to be compute-bound over the kernel floor.
    mm = OpRecord(op="aten.mm.default", kind="gemm", dtype="bf16", phase="forward", flops=2 * 256 * 256 * 65536,
                  bytes=2 * (256 * 65536 * 2 + 256 * 256), shape=(1, 256, 256, 65536))  # fmt: skip
    compute = 2 * 256 * 256 * 65536 / (0.8e15 * 4 / 128)
    memory = mm.bytes / (2e12 * ELEMENTWISE)
    assert op_seconds(mm, SPEED) == pytest.approx(max(compute, memory), rel=1e-9)


def test_a_causal_attention_kernel_computes_half_its_scores_at_its_familys_share() -> None:
    # FlashAttention-2 on Hopper: 35 % of the peak (FlashAttention-3's paper); causal: half of the counted FLOPs.
    flash = OpRecord(op="aten._scaled_dot_product_flash_attention.default", kind="attention", dtype="bf16",
                     phase="forward", flops=4 * 10**12, bytes=10**8, kernel="flash", causal=True)  # fmt: skip
    assert op_seconds(flash, SPEED) == pytest.approx(2e12 / (1e15 * 0.35), rel=1e-9)
    full = flash.model_copy(update={"causal": False})
    assert op_seconds(full, SPEED) == pytest.approx(2 * op_seconds(flash, SPEED), rel=1e-9)


def test_memory_bound_kernels_are_their_bytes_and_never_below_the_kernel_floor() -> None:
    assert op_seconds(elementwise(1e-3), SPEED) == pytest.approx(1e-3, rel=1e-6)
    reduction = OpRecord(op="aten.sum.default", kind="reduction", dtype="bf16", phase="forward", flops=0, bytes=10**9)
    assert op_seconds(reduction, SPEED) == pytest.approx(1e9 / (2e12 * 0.70), rel=1e-9)
    tiny = OpRecord(op="aten.add.Tensor", kind="elementwise", dtype="bf16", phase="forward", flops=0, bytes=8)
    assert op_seconds(tiny, SPEED) == CONSTANTS["kernel_floor_seconds"].value == 4e-6


def test_nccl_ring_times_inside_a_node_and_over_nodes() -> None:
    gib = float(2**30)
    inside = CollectiveRecord(kind="reduce_scatter", bytes=2**30, group_size=8, phase="backward", overlap="deferred")
    # NCCL: 8.4 us + 7 NVLink steps of 3.4 us; 7/8 of the buffer at 450 GB/s x 370/450.
    assert collective_seconds(inside, FABRIC) == pytest.approx(8.4e-6 + 7 * 3.4e-6 + 7 / 8 * gib / 370e9, rel=1e-9)
    # 128 ranks, 8 a node: 16 nodes, rings per NIC at 8 x 50 GB/s x 0.94 = 376 > 370: NVLink still bounds it; 112
    # NVLink steps and 15 network steps (9.6 us).
    wide = inside.model_copy(update={"group_size": 128})
    expected = 8.4e-6 + 112 * 3.4e-6 + 15 * 9.6e-6 + 127 / 128 * gib / 370e9
    assert collective_seconds(wide, FABRIC) == pytest.approx(expected, rel=1e-9)
    # Every other rank of a (dp, tp 2) layout: 4 of a group's ranks share a node, 4 x 47 GB/s bound the bus.
    strided = inside.model_copy(update={"group_size": 64, "stride": 2})
    expected = 8.4e-6 + (63 - 15) * 3.4e-6 + 15 * 9.6e-6 + 63 / 64 * gib / (4 * 50e9 * 0.94)
    assert collective_seconds(strided, FABRIC) == pytest.approx(expected, rel=1e-9)
    # An all-reduce moves the buffer twice; over nodes NCCL takes the tree where it is faster.
    reduce_all = inside.model_copy(update={"kind": "all_reduce"})
    assert collective_seconds(reduce_all, FABRIC) == pytest.approx(8.4e-6 + 14 * 3.4e-6 + 14 / 8 * gib / 370e9)
    small = reduce_all.model_copy(update={"group_size": 1024, "bytes": 4096})
    ring = 8.4e-6 + 2 * (1023 - 127) * 3.4e-6 + 2 * 127 * 9.6e-6 + 2 * 1023 / 1024 * 4096 / 370e9
    tree = 2 * (7 * 28e-6 + 7 * 50e-6) + 2 * 4096 / (370e9 * 0.9)
    assert collective_seconds(small, FABRIC) == pytest.approx(min(ring, tree), rel=1e-9)
    assert tree < ring


def record(last: list[Segment], ops: list[OpRecord], step: list[Segment] | None = None, **more: object) -> StepRecord:
    return StepRecord(micro_batch=1, ops=ops, last=last, other=last, step=step or [], **more)  # type: ignore[arg-type]


def test_fsdp_prefetches_each_all_gather_behind_the_compute_before_it() -> None:
    # compute 1 s, all-gather 0.5 s, compute 1 s: the gather starts with the first compute and is done by its end.
    ops = [elementwise(1.0)]
    overlapped = record([Segment(ops=[(0, 1)], collective=gather(0.5, "prefetched")), Segment(ops=[(0, 1)])], ops)
    time = predict_update({1: overlapped}, [(1, 1)], SPEED, FABRIC)
    assert time.seconds == pytest.approx(2.0, rel=1e-6)
    assert time.exposed_communication_seconds == pytest.approx(0.0, abs=1e-6)
    # A gather longer than the compute it hides behind shows its excess: 1.5 s against 1 s.
    longer = record([Segment(ops=[(0, 1)], collective=gather(1.5, "prefetched")), Segment(ops=[(0, 1)])], ops)
    assert predict_update({1: longer}, [(1, 1)], SPEED, FABRIC).exposed_communication_seconds == pytest.approx(0.5)


def test_tensor_parallels_collectives_are_exposed_and_reductions_wait_for_the_step_only() -> None:
    ops = [elementwise(1.0), elementwise(0.25, "backward"), elementwise(0.1, "step")]
    exposed = record([Segment(ops=[(0, 1)], collective=gather(0.5, "exposed")), Segment(ops=[(0, 1)])], ops)
    time = predict_update({1: exposed}, [(1, 1)], SPEED, FABRIC)
    assert (time.seconds, time.exposed_communication_seconds) == (pytest.approx(2.5), pytest.approx(0.5))
    # A reduce-scatter after the last backward compute: the step waits for it (0.5 s), nothing else does.
    deferred = record(
        [
            Segment(ops=[(1, 1)], collective=gather(0.5, "deferred", "backward", "reduce_scatter")),
            Segment(ops=[(1, 1)]),
        ],
        ops,
        step=[Segment(ops=[(2, 1)])],
    )
    time = predict_update({1: deferred}, [(1, 1)], SPEED, FABRIC)
    assert time.compute_seconds == pytest.approx(0.5)
    assert time.exposed_communication_seconds == pytest.approx(0.25)  # 0.25 s + 0.5 s of reduction against 0.5 s
    assert time.optimizer_seconds == pytest.approx(0.1)
    assert time.seconds == pytest.approx(0.85)


def test_ddps_buckets_reduce_behind_backward_and_the_last_one_shows() -> None:
    # Forward 1 s, backward 1 s; two buckets of equal bytes, 0.3 s each: the first is full half-way through backward
    # (at 1.5 s, done 1.8), the second at its end (2 s, done 2.3): the last bucket's 0.3 s is exposed.
    ops = [elementwise(1.0), elementwise(1.0, "backward")]
    # A 2-rank ring all-reduce: 8.4 us, two steps of 3.4 us, and the buffer (twice half of it) at 370 GB/s.
    moved = round((0.3 - 8.4e-6 - 2 * 3.4e-6) * 370e9)
    buckets = [CollectiveRecord(kind="all_reduce", bytes=moved, group_size=2, phase="backward", overlap="deferred")] * 2
    bucket_seconds = collective_seconds(buckets[0], FABRIC)
    assert bucket_seconds == pytest.approx(0.3)
    ddp = record([Segment(ops=[(0, 1)]), Segment(ops=[(1, 1)])], ops, ddp_buckets=buckets)
    time = predict_update({1: ddp}, [(1, 1)], SPEED, FABRIC)
    assert bucket_seconds < 0.5  # the first bucket is done before the second is full
    assert time.exposed_communication_seconds == pytest.approx(bucket_seconds)
    # Accumulating: the first micro-batch (no_sync) reduces nothing; only the update's last one does.
    twice = predict_update({1: ddp.model_copy(update={"other": [Segment(ops=[(0, 1)]), Segment(ops=[(1, 1)])]})},
                           [(1, 2)], SPEED, FABRIC)  # fmt: skip
    assert twice.compute_seconds == pytest.approx(4.0)
    assert twice.exposed_communication_seconds == pytest.approx(time.exposed_communication_seconds)


def test_a_pipelines_bubble_is_its_schedules() -> None:
    # 4 stages, 8 micro-batches of 1 s each: 1F1B idles 3 micro-batches' time, interleaved with V = 2 half of it.
    ops = [elementwise(1.0)]
    stage = record([Segment(ops=[(0, 1)])], ops)
    one_f_one_b = predict_update({1: stage}, [(1, 8)], SPEED, FABRIC, pipeline_stages=4)
    assert one_f_one_b.bubble_seconds == pytest.approx(3.0)
    assert one_f_one_b.seconds == pytest.approx(11.0)
    interleaved = predict_update({1: stage}, [(1, 8)], SPEED, FABRIC, pipeline_stages=4, virtual_stages=2)
    assert interleaved.bubble_seconds == pytest.approx(1.5)


def test_recomputation_is_compute_and_said_apart() -> None:
    ops = [elementwise(1.0), elementwise(0.5, "recompute"), elementwise(2.0, "backward")]
    checkpointed = record([Segment(ops=[(0, 1)]), Segment(ops=[(1, 1)]), Segment(ops=[(2, 1)])], ops)
    time = predict_update({1: checkpointed}, [(1, 1)], SPEED, FABRIC)
    assert (time.compute_seconds, time.recompute_seconds) == (pytest.approx(3.5), pytest.approx(0.5))


def test_the_parts_add_up_and_price_each_size() -> None:
    ops = [elementwise(1.0), elementwise(0.1, "step")]
    one = record([Segment(ops=[(0, 1)])], ops, step=[Segment(ops=[(1, 1)])])
    time = predict_update({1: one}, [(1, 3)], SPEED, FABRIC)
    parts = time.compute_seconds + time.exposed_communication_seconds + time.bubble_seconds + time.optimizer_seconds
    assert parts == pytest.approx(time.seconds) == pytest.approx(3.1)
    assert time.micro_batch_seconds == {1: pytest.approx(1.0)}


def test_the_catalogs_figures_and_a_missing_one_is_named_never_guessed() -> None:
    h100 = lookup("h100")
    found = resolve_figures("h100", h100.performance, sm_count=132, capability_major=9, precision="bf16")
    assert found.missing is None and found.peak_flops == 989.4e12
    assert found.fabric is not None and found.fabric.network_bytes_per_s == 400e9 / 8
    # The A10G (AWS's card: no NVIDIA data sheet) has no peaks: said, with the flags that give them.
    a10g = lookup("a10g")
    assert a10g.performance is None
    missing = resolve_figures("a10g", None, sm_count=80, capability_major=8, precision="bf16").missing
    assert missing == (
        "the a10g's dense bf16 peak and memory bandwidth are not in the catalog (give --peak-tflops and "
        "--memory-tbytes-per-s)"
    )
    # A T4 has no bf16 tensor cores: a bf16 job's peak is missing from its data sheet.
    t4 = resolve_figures("t4", PERFORMANCE["t4"], sm_count=40, capability_major=7, precision="bf16")
    assert t4.missing == "the t4's dense bf16 peak is not on the t4's data sheet (give --peak-tflops)"
    # Given, the figure stands in; a card of another name is another chip (none), one of the catalog's with other
    # memory keeps its figures.
    given = resolve_figures("a10g", None, sm_count=80, capability_major=8, precision="bf16",
                            overrides=FigureOverrides(peak_tflops=125, memory_tbytes_per_s=0.6))  # fmt: skip
    assert given.missing is None and given.peak_flops == 125e12 and given.fabric is not None
    assert given.fabric.network_bytes_per_s is None  # no reference system: a group over nodes will say so
    assert resolve_card("h100", 64 * 2**30).performance == h100.performance


def test_a_group_over_nodes_without_a_network_figure_is_refused() -> None:
    no_network = Fabric(nvlink_bytes_per_s=None, nvlink_gpus=1, pcie_bytes_per_s=32e9, network_bytes_per_s=None)
    wide = CollectiveRecord(kind="all_gather", bytes=2**20, group_size=16, phase="forward", overlap="prefetched")
    with pytest.raises(KeyError, match="network"):
        collective_seconds(wide, no_network)
    # Inside a node of PCIe cards: PCIe at its stated share.
    inside = wide.model_copy(update={"group_size": 8})
    expected = 8.4e-6 + 7 * 5.7e-6 + 7 / 8 * 2**20 / (32e9 * 0.8)
    assert math.isclose(collective_seconds(inside, no_network), expected, rel_tol=1e-9)
