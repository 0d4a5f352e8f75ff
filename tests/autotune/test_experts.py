"""--ep N, expert parallelism (issue 63): a tiny Mixtral's experts sharded over ep ranks, tokens dispatched by
all-to-all into receive buffers of the routing's size (autotune/measure/experts.py). The truth: real gloo ranks
running expert parallelism written the ordinary way (tests/autotune/_ep_worker.py), each rank counted by the CPU
allocator's own running total, the router forced to the same assignment on every rank; the probe's fake trials route
by the same assignment (--moe-load-factor) and answer for rank 0, the most loaded."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import ProcessException

from autotune.measure.experts import ExpertParallel
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter, moe_routing
from autotune.measure.trial import TrialRunner
from autotune.tasks.hf import hf_task
from tests.ranks import spawn

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]
LIMIT_BYTES = 1 << 30
# The probe's trial holds 4 bytes per rank of the job that the ordinary loop does not (8 at 2 ranks, as under --tp:
# tests/autotune/test_tp_moe.py; 16 at 4 ranks, whatever ep and the routing), the same at every size.
PROBE_HOLDS_BYTES_PER_RANK = 4
EXPERTS, TOP_K = 8, 2
CONFIG: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": EXPERTS,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}


def _mixtral(tmp_path: Path) -> Any:
    where = tmp_path / "mixtral"
    where.mkdir()
    (where / "config.json").write_text(json.dumps({"model_type": "mixtral", **CONFIG}))
    return hf_task(where).at_length(16)


def _probe(
    meter: CpuMeter,
    task: Any,
    world_size: int,
    ep: int,
    sizes: tuple[int, ...],
    factor: float = 1.0,
    capacity: float | None = None,
) -> dict[int, int]:
    strategy = ExpertParallel(world_size, ep, capacity_factor=capacity)
    with moe_routing(factor), strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=LIMIT_BYTES, strategy=strategy)
        try:
            return {m: runner(m).peak_bytes for m in sizes}
        finally:
            runner.close()


def _truth(
    tmp_path: Path, world_size: int, ep: int, sizes: tuple[int, ...], busiest: float | None
) -> dict[int, list[int]]:
    from tests.autotune import _ep_worker

    out = tmp_path / "truth"
    out.mkdir()
    args = (world_size, ep, str(out / "rendezvous"), str(out), CONFIG, list(sizes), busiest)
    try:
        spawn(_ep_worker.run, args=args, nprocs=world_size)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the {world_size}-process job failed: {exc}\n{errors}")
    return {int(m): peaks for m, peaks in json.loads((out / "peaks.json").read_text()).items()}


def test_each_rank_holds_its_experts_and_the_rest_sharded(tmp_path: Path) -> None:
    task = _mixtral(tmp_path)
    strategy = ExpertParallel(4, 2)
    with strategy.process_group(torch.device("cpu")):
        model = strategy.wrap(task.model(), task, torch.device("cpu"))
        experts = model.model.layers[0].mlp.experts
        # 4 of 8 experts (ep 2), then FSDP2 over the 2 experts' data-parallel ranks: 2 rows each
        assert tuple(experts.gate_up_proj.to_local().shape) == (2, 96, 32)
        assert tuple(experts.gate_up_proj.shape) == (4, 96, 32)
        router = model.model.layers[0].mlp.gate.weight
        assert tuple(router.to_local().shape) == (2, 32)  # the router under fsdp over all 4 ranks
        loss = model(**task.batch(2)).loss
        loss.backward()
        assert experts.gate_up_proj.grad is not None


def _routed_as_forced(task: Any, sizes: tuple[int, ...], busiest: float | None) -> Any:
    """task whose model's routers pick the worker's forced assignment (a real trial routed as a fake one)."""
    from tests.autotune import _ep_worker

    for m in sizes:
        tokens = m * 16
        count = None if busiest is None else round(busiest * tokens)
        _ep_worker._FORCED[tokens] = _ep_worker.forced_assignment(tokens, EXPERTS, TOP_K, count)

    def model() -> Any:
        built = task.model()
        for layer in built.model.layers:
            _ep_worker._forced_router(layer.mlp.gate)
        return built

    return dataclasses.replace(task, model=model)


@pytest.mark.parametrize(("factor", "busiest"), [(1.0, None), (2.0, 0.5)], ids=["balanced", "skewed"])
def test_a_fake_ep_trial_counts_what_the_real_one_routed_alike_does(
    tmp_path: Path, factor: float, busiest: float | None
) -> None:
    task = _mixtral(tmp_path)
    real = _probe(CpuMeter(LIMIT_BYTES), _routed_as_forced(task, (1, 2), busiest), 2, 2, (1, 2))
    fake = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, (1, 2), factor)
    assert fake == real
    assert real[2] > real[1]


@pytest.mark.parametrize(("factor", "busiest"), [(1.0, None), (2.0, 0.5)], ids=["balanced", "skewed"])
def test_rank_0_is_the_most_loaded_rank_of_a_real_ep_job(tmp_path: Path, factor: float, busiest: float | None) -> None:
    """ep 2 under fsdp 2: skewed, expert 0 takes twice its fair share (2 x T k / E = T / 2 of the T tokens)."""
    task = _mixtral(tmp_path)
    sizes = (1, 2)
    probed = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, sizes, factor)
    truth = _truth(tmp_path, 2, 2, sizes, busiest)
    print(f"ep 2 x fsdp 2, {'skewed' if busiest else 'balanced'}: probe {probed}, real ranks {truth}")
    for m in sizes:
        assert truth[m][0] == max(truth[m])
        assert probed[m] - truth[m][0] == 2 * PROBE_HOLDS_BYTES_PER_RANK


def test_a_capacity_factor_drops_what_the_busiest_expert_takes_beyond_it(tmp_path: Path) -> None:
    """Token dropping (--moe-capacity-factor 1): expert 0 routed twice its fair share keeps its fair share, so rank 0
    and the other experts share what is left: rank 0 holds no more than under balanced routing, less than dropless; a
    real trial routed alike drops the same picks."""
    task = _mixtral(tmp_path)
    dropped = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, (2,), 2.0, capacity=1.0)
    real = _probe(CpuMeter(LIMIT_BYTES), _routed_as_forced(task, (2,), 0.5), 2, 2, (2,), capacity=1.0)
    balanced = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, (2,), 1.0)
    dropless = _probe(FakeMeter(LIMIT_BYTES, "cpu"), task, 2, 2, (2,), 2.0)
    print(f"capacity 1: skewed {dropped}, real {real}; dropless balanced {balanced}, skewed {dropless}")
    assert dropped == real
    assert dropped[2] < balanced[2] < dropless[2]


def test_the_routing_default_under_ep_is_the_dropless_worst_case_and_the_setup_carries_ep(tmp_path: Path) -> None:
    """Under --ep the fake trials route every token to expert 0 unless told otherwise (experts / top_k); without it,
    balanced. ep and the capacity factor are coordinates of the mesh: in the fingerprint's tags and the store's kind."""
    from autotune.core.mesh import Mesh
    from autotune.core.setup import JobSetup
    from autotune.orchestrate.routing import moe_routing_for

    task = _mixtral(tmp_path)
    assert moe_routing_for(task, None, ep=2)[1] == EXPERTS / TOP_K
    assert moe_routing_for(task, None)[1] == 1.0 and moe_routing_for(task, 1.5, ep=2)[1] == 1.5
    dropless = JobSetup(strategy="fsdp", world_size=4, mesh=Mesh(ep=2))
    dropping = JobSetup(strategy="fsdp", world_size=4, mesh=Mesh(ep=2, ep_capacity=1.25))
    assert dropless.fingerprint_tags()["autotune.mesh"] == "ep=2"
    assert dropping.fingerprint_tags()["autotune.mesh"] == "ep=2,ep_capacity=1.25"
    assert dropless.kind() != dropping.kind() != JobSetup(strategy="fsdp", world_size=4).kind()
    assert dropless.data_parallel == 4  # ep borrows the ranks fsdp shards over: D stays W
