"""A pipeline over FSDP2 (--pp 2 --strategy fsdp --world-size 4: pp 2 x dp 2), each stage sharded over its
data-parallel group.

The check that matters: each stage's peak equals, to the byte, the CPU allocator's count on the ranks of a real
4-process job on gloo built as torchtitan builds it (a (pp, dp) device mesh, each stage's module fully_shard-ed
over the dp sub-mesh, then PipelineStage and Schedule1F1B; tests/autotune/_pipeline_fsdp_worker.py, no code of the
probe), at m_max and m_max + 1, on the CPU meter and on fake trials; the probe's and the estimate's m_max at a
budget between them is the real one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing.spawn import ProcessException

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.pipeline import PipelineTrials, ShardedStage
from autotune.measure.strategy_choice import make_strategy
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.orchestrate.estimate import estimate
from autotune.orchestrate.probe import probe
from autotune.tasks.task import ProbeTask
from tests.autotune import _pipeline_fsdp_worker as fsdp_worker
from tests.autotune import _pipeline_worker as worker
from tests.autotune._pipeline_cli import refused_line
from tests.ranks import FORKSERVER, spawn

UNBOUNDED = 1 << 40
WORLD, STAGES, K = 4, 2, 2
SIZES = [2, 3]  # m_max and m_max + 1 at BUDGET
# Between the most loaded stage's peaks at m = 2 and m = 3 (stage 0: 858,444 and 1,097,548 bytes).
BUDGET = 1_000_000


def llama_task(layers: int = worker.LAYERS) -> ProbeTask:
    return ProbeTask(
        name="tiny-llama",
        model=worker.TinyLlama if layers == worker.LAYERS else functools.partial(worker.TinyLlama, layers),
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
    )


def _sharded_stage_peaks() -> dict[int, list[int]]:
    """Each stage's peak at each of SIZES by the probe's pipeline trials over fsdp (1F1B, pp 2 x dp 2) on the CPU."""
    strategy = ShardedStage(WORLD, STAGES)
    with strategy.process_group(torch.device("cpu")):
        trials = PipelineTrials(
            llama_task(), CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=STAGES, schedule="1f1b", microbatches=K,
            strategy=strategy,
        )  # fmt: skip
        for m in SIZES:
            trials(m)
        return {m: list(trials.stage_peaks[m]) for m in SIZES}


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[int]]:
    """Each rank's peak per size (one run: tests/autotune/_ordered_gloo.py), from one spawn of 4 real processes:
    {m: [rank 0..3]}."""
    out = tmp_path_factory.mktemp("pipeline_fsdp")
    args = (WORLD, STAGES, str(out / "rendezvous"), str(out), K, SIZES, "1f1b", 1, fsdp_worker.RUNS_PER_SIZE, False)
    try:
        spawn(fsdp_worker.run, args=args, nprocs=WORLD, join=True)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the 4-process pipeline over fsdp failed: {exc}\n{errors}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(WORLD)]
    return {m: [rank[str(m)] for rank in ranks] for m in SIZES}


def test_each_sharded_stage_equals_the_real_ranks(real_peaks: dict[int, list[int]]) -> None:
    # Ranks r // 2 run stage r // 2; the two ranks of a stage's data-parallel group hold equal shards.
    for m in SIZES:
        assert real_peaks[m][0] == real_peaks[m][1] and real_peaks[m][2] == real_peaks[m][3], real_peaks
    for meter in (CpuMeter(UNBOUNDED), FakeMeter(UNBOUNDED)):
        strategy = ShardedStage(WORLD, STAGES)
        with strategy.process_group(torch.device("cpu")):
            trials = PipelineTrials(
                llama_task(),
                meter,
                limit_bytes=UNBOUNDED,
                stages=STAGES,
                schedule="1f1b",
                microbatches=K,
                strategy=strategy,
            )
            for m in SIZES:
                assert trials(m).fake == isinstance(meter, FakeMeter)
                assert trials.stage_peaks[m] == [real_peaks[m][0], real_peaks[m][2]], (type(meter).__name__, m)
    assert max(real_peaks[2]) <= BUDGET < max(real_peaks[3])


def test_the_probe_and_the_estimate_answer_the_real_m_max(real_peaks: dict[int, list[int]]) -> None:
    mesh = Mesh(pp=STAGES, pp_microbatches=K)
    config = ProbeConfig(
        device="cpu", budget_bytes=BUDGET, headroom=0.0, strategy="fsdp", world_size=WORLD, target_batch=8, mesh=mesh
    )
    profile = probe(llama_task(), config)
    assert profile.max_micro_batch == 2
    assert profile.pipeline is not None and profile.pipeline.stage_peak_bytes == [real_peaks[2][0], real_peaks[2][2]]
    # D = 4 / 2 = 2 replicas; T = 8 = m x K x D with K = 2, m = 2.
    assert profile.plan is not None
    assert (profile.plan.micro_batch, profile.plan.accumulation_steps, profile.plan.world_size) == (2, 2, 2)
    estimated = estimate(
        llama_task(),
        EstimateConfig.of(
            device_kind="cpu",
            budget_bytes=BUDGET,
            headroom=0.0,
            strategy="fsdp",
            world_size=WORLD,
            target_batch=8,
            mesh=mesh,
        ),
    )
    assert (estimated.source, estimated.max_micro_batch) == ("estimate", 2)
    assert estimated.pipeline is not None
    assert estimated.pipeline.stage_peak_bytes == [real_peaks[2][0], real_peaks[2][2]]


def test_compiled_sharded_stages_equal_the_real_ranks(tmp_path: Path, real_peaks: dict[int, list[int]]) -> None:
    """--compile under --pp 2 --strategy fsdp (pp 2 x dp 2): each stage's blocks compiled, then sharded (torchtitan's
    apply_compile before apply_fsdp), against 4 real processes built so; the stages on the allocator's own count."""
    real = _real_rank_peaks(tmp_path, "fsdp, compiled", 1, schedule="1f1b", compiled=True)
    task = dataclasses.replace(llama_task(), compile="default")
    stage_peaks = _compiled_stage_peaks(task, ShardedStage(WORLD, STAGES))
    for m in SIZES:
        assert stage_peaks[m] == [real[0][str(m)], real[2][str(m)]], m
    # Compiled blocks hold less than eager ones here, on both stages.
    assert all(real[rank][str(3)] < real_peaks[3][rank] for rank in range(WORLD))
    # The probe at a budget between the real m = 2 and m = 3 (stage 0: 764,236 and 925,516 bytes).
    budget = 850_000
    assert max(real[rank][str(2)] for rank in range(WORLD)) <= budget < max(real[rank][str(3)] for rank in range(WORLD))
    mesh = Mesh(pp=STAGES, pp_microbatches=K)
    config = ProbeConfig(
        device="cpu", budget_bytes=budget, headroom=0.0, strategy="fsdp", world_size=WORLD, target_batch=8, mesh=mesh
    )
    profile = probe(task, config)
    assert profile.max_micro_batch == 2
    assert profile.pipeline is not None and profile.pipeline.stage_peak_bytes == [real[0]["2"], real[2]["2"]]


def _compiled_stage_peaks(task: ProbeTask, strategy: Any) -> dict[int, list[int]]:
    """Each stage's peak at each of SIZES by the pipeline trials of the compiled ``task`` (1F1B, K 2) over
    ``strategy``'s stages, on the allocator's own count."""
    from autotune.measure.meters.compiled import CompiledCpuMeter

    meter = CompiledCpuMeter(UNBOUNDED)
    try:
        with strategy.process_group(torch.device("cpu")):
            trials = PipelineTrials(
                task, meter, limit_bytes=UNBOUNDED, stages=STAGES, schedule="1f1b", microbatches=K, strategy=strategy
            )
            for m in SIZES:
                trials(m)
            return {m: list(trials.stage_peaks[m]) for m in SIZES}
    finally:
        meter.close()


def tp_task(layers: int = worker.LAYERS) -> ProbeTask:
    return ProbeTask(
        name="tiny-llama-tp",
        model=fsdp_worker.TpLlama if layers == worker.LAYERS else functools.partial(fsdp_worker.TpLlama, layers),
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
        tp_plan=fsdp_worker.TP_PLAN,
    )


def _real_rank_peaks(
    out: Path,
    what: str,
    tp: int,
    schedule: str = "interleaved-1f1b",
    sequence_parallel: bool = False,
    compiled: bool = False,
) -> list[dict[str, int]]:
    """Each of 4 real ranks' peak per size under ``schedule`` (interleaved: V 2 stages per rank, K 2; with
    ``sequence_parallel``, fsdp_worker.sp_plan over tp; ``compiled``: each block compiled before it is sharded); one
    run per size (tests/autotune/_ordered_gloo.py)."""
    try:
        spawn(
            fsdp_worker.run,
            args=(
                4,
                STAGES,
                str(out / "rendezvous"),
                str(out),
                K,
                SIZES,
                schedule,
                tp,
                1,
                sequence_parallel,
                compiled,
            ),
            nprocs=4,
            join=True,
        )
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the 4-process {schedule} pipeline over {what} failed: {exc}\n{errors}")
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_stages_over_tensor_parallelism_equal_the_real_ranks(tmp_path: Path) -> None:
    """--pp 2 --tp 2 --world-size 4 (D = 1): each stage's blocks tensor-parallel over its 2 tp ranks, against 4 real
    processes (one run per size). The same at fsdp 2 x tp 2 x pp 2 over 8
    real processes is bench/pipeline_meshes.py's (a minute and more on 2 cores): equal to the byte too."""
    # The probe's side in a process of its own: in this one, a later tp x fsdp trial (test_tp_fake's, test_tp_moe's)
    # stopped at "Could not resolve the process group registered under the name 7" (DTensor's caches kept this job's
    # meshes; every fake group now empties them, autotune/measure/fake_group.py, and test_fake_group checks it).
    with ProcessPoolExecutor(1, mp_context=FORKSERVER) as pool:
        stage_peaks = pool.submit(_tp_stage_peaks, "1f1b").result()
    real = _real_rank_peaks(tmp_path, "tp", 2, schedule="1f1b")
    for m in SIZES:
        # Ranks 0, 1: stage 0's tp pair; ranks 2, 3: stage 1's. Stage 0: 544,844 / 693,580 B at m = 2 / 3.
        assert real[0][str(m)] == real[1][str(m)] and real[2][str(m)] == real[3][str(m)], real
        assert stage_peaks[m] == [real[0][str(m)], real[2][str(m)]], m


def _tp_stage_peaks(schedule: str) -> dict[int, list[int]]:
    """Each stage's peak at each of SIZES by the probe's pipeline trials over tp 2 (--pp 2 --tp 2, W 4), under
    ``schedule`` (interleaved: V 2 stages per rank of a 4-block model)."""
    mesh = Mesh(pp=STAGES, tp=2, pp_schedule=schedule, pp_microbatches=K)  # type: ignore[arg-type]
    layers = worker.INTERLEAVED_LAYERS if mesh.virtual_stages > 1 else worker.LAYERS
    strategy = make_strategy("ddp", 4, mesh)
    with strategy.process_group(torch.device("cpu")):
        trials = PipelineTrials(
            tp_task(layers), CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=STAGES, schedule=schedule,
            microbatches=K, virtual_stages=mesh.virtual_stages, strategy=strategy,
        )  # fmt: skip
        for m in SIZES:
            trials(m)
        return {m: list(trials.stage_peaks[m]) for m in SIZES}


# Between the compiled tp stages' most loaded peaks at m = 2 and m = 3 (stage 0: 479,436 and 582,988 bytes).
COMPILED_TP_BUDGET = 530_000


def test_compiled_stages_over_tensor_parallelism_equal_the_real_ranks(tmp_path: Path) -> None:
    """--compile under --pp 2 --tp 2 (W 4, D 1): each stage's blocks tensor-parallel, then compiled (torchtitan's
    apply_tp before apply_compile), against 4 real processes built so; the stages on the allocator's own count, each
    where its compilation has settled, as the real ranks are measured after a first run at each size."""
    with ProcessPoolExecutor(1, mp_context=FORKSERVER) as pool:
        stage_peaks, probed = pool.submit(_compiled_tp_stages).result()
    real = _real_rank_peaks(tmp_path, "tp, compiled", 2, schedule="1f1b", compiled=True)
    for m in SIZES:
        assert real[0][str(m)] == real[1][str(m)] and real[2][str(m)] == real[3][str(m)], real
        assert stage_peaks[m] == [real[0][str(m)], real[2][str(m)]], m
    most_loaded = {m: max(ranks[str(m)] for ranks in real) for m in SIZES}
    assert most_loaded[2] <= COMPILED_TP_BUDGET < most_loaded[3]
    # The probe from m = 1 up (each size compiled static by a fresh compiler, as a job at that m compiles): its
    # trials' peaks are the real most loaded ranks', the one past m_max included.
    m_max, stage_peak_bytes, trial_peaks = probed
    assert (m_max, stage_peak_bytes) == (2, [real[0]["2"], real[2]["2"]])
    assert {m: trial_peaks[m] for m in SIZES} == most_loaded


def _compiled_tp_stages() -> tuple[dict[int, list[int]], tuple[int | None, list[int] | None, dict[int, int]]]:
    """The compiled tp stages' peaks at each of SIZES by the pipeline trials, and (m_max, its stage peaks, each real
    trial's peak) by the probe at COMPILED_TP_BUDGET."""
    task = dataclasses.replace(tp_task(), compile="default")
    mesh = Mesh(pp=STAGES, tp=2, pp_schedule="1f1b", pp_microbatches=K)
    peaks = _compiled_stage_peaks(task, make_strategy("ddp", 4, mesh))
    config = ProbeConfig(
        device="cpu", budget_bytes=COMPILED_TP_BUDGET, headroom=0.0, world_size=4, target_batch=4, mesh=mesh
    )
    profile = probe(task, config)
    stage_peak_bytes = profile.pipeline.stage_peak_bytes if profile.pipeline is not None else None
    trial_peaks = {trial.micro_batch: trial.peak_bytes for trial in profile.trials if not trial.fake}
    return peaks, (profile.max_micro_batch, stage_peak_bytes, trial_peaks)


def test_compiled_tp_stages_fed_a_pending_collective_are_refused_in_one_line(tmp_path: Path) -> None:
    """An hf: Llama under transformers' tp plan shards its embedding row-wise, so the first compiled block of stage 0
    gets funcol's AsyncCollectiveTensor, whose gradient torch's compiled backward hands back plain (DTensor's
    backward then fails; bench/compiled_collective_input.py shows it on a job built by hand): the probe stops at its
    first trial with one line naming the limit, exit 2, nothing written. In a process of its own (DTensor's caches)."""
    import subprocess
    import sys

    from autotune.measure.pipeline import PENDING_COLLECTIVE_INPUT

    config = {
        "model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    output = tmp_path / "profile.json"
    flags = ["--seq-len", "32", "--world-size", "4", "--pp", "2", "--tp", "2", "--compile", "--output", str(output)]
    argv = [sys.executable, "-m", "autotune.cli", "probe", f"hf:{tmp_path}", "--device", "cpu", "--budget", "8MiB"]
    done = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=600, check=False)
    said = [line for line in done.stderr.splitlines() if line.startswith("autotune: error: ")]
    assert done.returncode == 2, done.stderr[-2000:]
    assert said == [f"autotune: error: {PENDING_COLLECTIVE_INPUT}"]
    assert "Traceback" not in done.stderr and "unwaited collective" not in done.stderr
    assert not output.exists()


SP_SLACK_BYTES = 64


def sp_task() -> ProbeTask:
    """The tiny Llama under sequence and loss parallel (the truth's plan, fsdp_worker.sp_plan, as the task's own)."""
    return ProbeTask(
        name="tiny-llama-sp",
        model=fsdp_worker.TpLlama,
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
        tp_plan=fsdp_worker.sp_plan(),
    )


def _sp_stage_peaks(meter_kind: str) -> dict[int, list[int]]:
    """Each stage's peak at each of SIZES by the pipeline trials of sp_task over pp 2 x tp 2 (1F1B, W 4)."""
    mesh = Mesh(pp=STAGES, tp=2, pp_schedule="1f1b", pp_microbatches=K)
    strategy = make_strategy("ddp", 4, mesh)
    meter = CpuMeter(UNBOUNDED) if meter_kind == "cpu" else FakeMeter(UNBOUNDED)
    with strategy.process_group(torch.device("cpu")):
        trials = PipelineTrials(
            sp_task(), meter, limit_bytes=UNBOUNDED, stages=STAGES, schedule="1f1b", microbatches=K,
            strategy=strategy,
        )  # fmt: skip
        for m in SIZES:
            trials(m)
        return {m: list(trials.stage_peaks[m]) for m in SIZES}


def test_sequence_parallel_stages_equal_the_real_ranks(tmp_path: Path) -> None:
    """--pp 2 --tp 2 under sequence and loss parallel (torchtitan's plan on the tiny Llama): the activations that cross
    the stages are each rank's L / tp positions, the last stage's loss is computed on the logits' vocabulary shards.
    Against 4 real processes running PipelineStage and Schedule1F1B over torch's own SequenceParallel, sharded
    row-wise outputs and loss_parallel() (one run per size), on the CPU meter and on fake trials."""
    with ProcessPoolExecutor(1, mp_context=FORKSERVER) as pool:  # see the 1F1B tp test
        peaks = {kind: pool.submit(_sp_stage_peaks, kind).result() for kind in ("cpu", "fake")}
    real = _real_rank_peaks(tmp_path, "sequence-parallel tp", 2, schedule="1f1b", sequence_parallel=True)
    print("probe's stages:", peaks)
    for m in SIZES:
        assert real[0][str(m)] == real[1][str(m)] and real[2][str(m)] == real[3][str(m)], real
        for kind, stage_peaks in peaks.items():
            # Within SP_SLACK_BYTES: the stages read 16 bytes above the real ranks where the peak falls in a backward
            # (534,092 equal on stage 0 at m = 2; 686,684 against 686,668 at m = 3), as the one-process tp probe
            # holds 8 bytes the ordinary loop does not (tests/autotune/test_tensor_parallel.py): not yet found.
            for stage, real_rank in enumerate((0, 2)):
                assert 0 <= stage_peaks[m][stage] - real[real_rank][str(m)] <= SP_SLACK_BYTES, (kind, m, stage_peaks)
    assert peaks["cpu"] == peaks["fake"]


INTERLEAVED = Mesh(pp=STAGES, pp_schedule="interleaved-1f1b", pp_microbatches=K)  # V 2: stages r, r + 2 on rank r
# Between the most loaded interleaved stage's peaks at m = 2 and m = 3 (rank 0, blocks 0 and 2: 878,924 / 1,126,220 B).
INTERLEAVED_BUDGET = 1_000_000


def test_interleaved_stages_over_fsdp_equal_the_real_ranks(tmp_path: Path) -> None:
    """--pp 2 --pp-schedule interleaved-1f1b --strategy fsdp --world-size 4: each rank holds 2 stages of a 4-block
    Llama (r, r + 2), each fully_shard-ed on its own over dp 2, driven by torch's multi-stage runtime (all of a
    rank's stages gathered when the step starts, each reduce-scattered right after its last backward). One run per
    size (at K 4 the probe equals them too: 1,165,644 / 1,491,532 B on rank 0 at m = 2 / 3)."""
    probed: dict[str, dict[int, list[int]]] = {}
    for meter in (CpuMeter(UNBOUNDED), FakeMeter(UNBOUNDED)):
        strategy = make_strategy("fsdp", WORLD, INTERLEAVED)
        with strategy.process_group(torch.device("cpu")):
            trials = PipelineTrials(
                llama_task(worker.INTERLEAVED_LAYERS), meter, limit_bytes=UNBOUNDED, stages=STAGES,
                schedule="interleaved-1f1b", microbatches=K, virtual_stages=INTERLEAVED.virtual_stages,
                strategy=strategy,
            )  # fmt: skip
            for m in SIZES:
                trials(m)
            probed[type(meter).__name__] = {m: list(trials.stage_peaks[m]) for m in SIZES}
    real = _real_rank_peaks(tmp_path, "fsdp", 1)
    for kind, stage_peaks in probed.items():
        for m in SIZES:
            # Ranks 0, 1 hold stages 0 and 2; ranks 2, 3 stages 1 and 3. Rank 0: 878,924 / 1,126,220 B.
            assert real[0][str(m)] == real[1][str(m)] and real[2][str(m)] == real[3][str(m)], real
            assert stage_peaks[m] == [real[0][str(m)], real[2][str(m)]], (kind, m)
    assert max(r["2"] for r in real) <= INTERLEAVED_BUDGET < max(r["3"] for r in real)
    config = ProbeConfig(
        device="cpu", budget_bytes=INTERLEAVED_BUDGET, headroom=0.0, strategy="fsdp", world_size=WORLD, mesh=INTERLEAVED
    )
    profile = probe(llama_task(worker.INTERLEAVED_LAYERS), config)
    assert profile.max_micro_batch == 2
    assert profile.pipeline is not None and profile.pipeline.stage_peak_bytes == [real[0]["2"], real[2]["2"]]


def test_interleaved_stages_over_tensor_parallelism_equal_the_real_ranks(tmp_path: Path) -> None:
    """--pp 2 --tp 2 --pp-schedule interleaved-1f1b --world-size 4 (D = 1): each rank's 2 stages tensor-parallel over
    its tp pair, against 4 real processes, one run per size (one CI run of the old way, the least of three, read rank 2
    4,096 B above rank 3 at m = 2, 576,092 against 571,996 B: gloo's late releases, tests/autotune/_ordered_gloo.py)."""
    with ProcessPoolExecutor(1, mp_context=FORKSERVER) as pool:  # see the 1F1B tp test
        stage_peaks = pool.submit(_tp_stage_peaks, "interleaved-1f1b").result()
    real = _real_rank_peaks(tmp_path, "tp", 2)
    for m in SIZES:
        # Ranks 0, 1: stages 0 and 2's tp pair (565,324 / 722,252 B); ranks 2, 3: stages 1 and 3 (571,996 / 714,460 B):
        # the most loaded rank changes with m.
        assert real[0][str(m)] == real[1][str(m)] and real[2][str(m)] == real[3][str(m)], real
        assert stage_peaks[m] == [real[0][str(m)], real[2][str(m)]], m


def _moved_by_params_offload(stage: int) -> int:
    """What FSDP2's CPUOffloadPolicy takes off a dp rank's device at the stage's peak (in the backward, every unit
    gathered and its gradients unsharded): the rank's half of the stage's weights and of AdamW's moments, and AdamW's
    step counts (one per parameter, whole on each rank). Counted on the stage cut by hand from the model built the
    ordinary way and stepped once by torch's own AdamW."""
    model = worker.cut_to_stage(worker.TinyLlama(), stage, STAGES)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer = torch.optim.AdamW(model.parameters())
    optimizer.step()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    state = [value for each in optimizer.state.values() for value in each.values()]
    moments = sum(t.numel() * t.element_size() for t in state if t.dim() > 0)
    steps = sum(t.numel() * t.element_size() for t in state if t.dim() == 0)
    return (weights + moments) // (WORLD // STAGES) + steps


def test_params_offload_over_a_pipelines_fsdp_moves_each_stages_shards_and_state_to_the_host() -> None:
    """--pp 2 --strategy fsdp --world-size 4 --offload params: each stage's fully_shard takes FSDP2's CPUOffloadPolicy,
    as a whole model's does. At every size each stage's device peak is the plain stage's less exactly its rank's
    weight and moment shards and step counts (_moved_by_params_offload); the host holds those, the gradient shards
    and the CPU step's own, the same at every size; the receive buffers stay on the device through the step. The
    estimate's fake trials read the same."""
    found = {}
    for offload, meter in (
        ("none", CpuMeter(UNBOUNDED)),
        ("params", CpuMeter(UNBOUNDED)),
        ("fake", FakeMeter(UNBOUNDED)),
    ):
        task = dataclasses.replace(llama_task(), offload="none" if offload == "none" else "params")
        strategy = ShardedStage(WORLD, STAGES)
        with strategy.process_group(torch.device("cpu")):
            trials = PipelineTrials(
                task, meter, limit_bytes=UNBOUNDED, stages=STAGES, schedule="1f1b", microbatches=K, strategy=strategy
            )
            found[offload] = {m: (trials(m), list(trials.stage_peaks[m]), dict(trials.stage_host_peaks)) for m in SIZES}
    print({offload: {m: (peaks, hosts) for m, (_, peaks, hosts) in by_m.items()} for offload, by_m in found.items()})
    # The estimate's fake trials (the CPU's semantics) hold what the real ones do, on the device and on the host.
    assert {m: found["fake"][m][1:] for m in SIZES} == {m: found["params"][m][1:] for m in SIZES}
    for m in SIZES:
        plain, offloaded = found["none"][m], found["params"][m]
        for stage in range(STAGES):
            assert plain[1][stage] - offloaded[1][stage] == _moved_by_params_offload(stage), (m, stage)
        # Host: the same at every size, more than what left the device (the gradient shards, the step's own).
        assert offloaded[2] == found["params"][SIZES[0]][2]
        assert all(offloaded[2][stage] > _moved_by_params_offload(stage) for stage in range(STAGES))
        assert offloaded[0].host_peak_bytes == max(offloaded[2].values())
        # The step ran on the host: on the device only stage 0's receive buffers for the gradients are left.
        assert offloaded[0].step_bytes == K * m * worker.SEQ_LEN * worker.DIM * 4


def test_what_is_not_measured_over_fsdp_is_refused_in_one_line() -> None:
    with pytest.raises(AutotuneError, match=r"^--strategy fsdp with --world-size 2 over pp 2: FSDP2 shards"):
        make_strategy("fsdp", 2, Mesh(pp=2))


@pytest.mark.parametrize(
    ("flags", "said"),
    [(["--world-size", "2", "--pp", "2"], "--strategy fsdp with --world-size 2 over pp 2: FSDP2 shards")],
)
def test_bad_pipelines_over_fsdp_are_one_line_exit_2_nothing_written(
    flags: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in refused_line(["--strategy", "fsdp", *flags], tmp_path, monkeypatch, capsys)
