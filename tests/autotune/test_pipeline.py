"""Pipeline parallelism per rank (--pp): each stage's trial replays its schedule on one device.

The check that matters: every stage's peak equals, to the byte, the CPU allocator's count on that rank of a
real 2-process pipeline run by torch.distributed.pipelining itself (PipelineStage with Schedule1F1B and
ScheduleGPipe, gloo), the model cut by hand as torchtitan cuts it (tests/autotune/_pipeline_worker.py, no
code of the probe), at m_max and m_max + 1; and the probe's m_max at a budget between them is the real one.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.multiprocessing.spawn import ProcessException

from autotune.core.errors import AutotuneError, TaskError
from autotune.core.mesh import Mesh
from autotune.core.plan import pipeline_plan
from autotune.core.schemas import PipelineStages, Profile
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.pipeline import PipelineTrials, interleaved_actions, schedule_actions, stage_block_ranges
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.tasks.task import ProbeTask
from tests.autotune import _pipeline_worker as worker
from tests.autotune._pipeline_cli import refused_line
from tests.ranks import spawn

UNBOUNDED = 1 << 40
K = 2
SIZES = [2, 3]  # m_max and m_max + 1 at BUDGET
# Between the most loaded stage's peaks at m = 2 and m = 3 (stage 0: 930,380 and 1,169,484 bytes).
BUDGET = 1_000_000


def llama_task(layers: int = worker.LAYERS) -> ProbeTask:
    return ProbeTask(
        name="tiny-llama",
        model=worker.TinyLlama if layers == worker.LAYERS else functools.partial(worker.TinyLlama, layers),
        batch=worker.make_batch,
        loss=lambda model, batch: worker.lm_loss(model(batch[0]), batch[1]),
    )


@pytest.fixture(scope="module")
def real_peaks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Each rank's peak per schedule and size, from one spawn of 2 real processes: {"1f1b/2/3": [rank0, rank1]}."""
    out = tmp_path_factory.mktemp("pipeline")
    jobs = [
        ("1f1b", K, SIZES),
        ("gpipe", K, SIZES),
        ("interleaved-1f1b", K, SIZES),
        ("1f1b+full", K, [3]),
        ("1f1b+offload", K, SIZES),
        ("1f1b+adamw4bit", K, SIZES),
        ("1f1b+compile", K, SIZES),
        ("1f1b+compile+budget:0.5", K, SIZES),
    ]
    try:
        spawn(worker.run, args=(2, str(out / "rendezvous"), str(out), jobs), nprocs=2, join=True)
    except ProcessException as exc:
        errors = "\n".join(path.read_text() for path in sorted(out.glob("rank*.error")))
        pytest.fail(f"the 2-process pipeline failed: {exc}\n{errors}")
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    return {key: [rank[key] for rank in ranks] for key in ranks[0]}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved-1f1b"])
def test_each_stage_equals_the_real_pipeline_rank(schedule: str, real_peaks: dict[str, list[int]]) -> None:
    interleaved = schedule == "interleaved-1f1b"
    trials = PipelineTrials(
        llama_task(worker.INTERLEAVED_LAYERS if interleaved else worker.LAYERS),
        CpuMeter(UNBOUNDED),
        limit_bytes=UNBOUNDED,
        stages=2,
        schedule=schedule,
        microbatches=K,
        virtual_stages=worker.INTERLEAVED_VIRTUAL if interleaved else 1,
    )
    for m in SIZES:
        trials(m)
        assert trials.stage_peaks[m] == real_peaks[f"{schedule}/{K}/{m}"], (schedule, m)
    # The budget sits between the most loaded rank's peaks at m_max and m_max + 1, on both sides.
    assert max(real_peaks[f"{schedule}/{K}/2"]) <= BUDGET < max(real_peaks[f"{schedule}/{K}/3"])
    assert trials.most_loaded(2) == 0


def test_probe_answers_the_most_loaded_stage_and_plans_k(real_peaks: dict[str, list[int]]) -> None:
    config = ProbeConfig(
        device="cpu",
        budget_bytes=BUDGET,
        headroom=0.0,
        # The truth's two ranks, D = 1: with D > 1 each stage would also hold the buckets of the DDP over it
        # (test_ddp_buckets_meshes.py), which this truth does not run.
        world_size=2,
        target_batch=4,
        mesh=Mesh(pp=2, pp_microbatches=K),
    )
    profile = probe(llama_task(), config)
    assert profile.max_micro_batch == 2
    assert max(real_peaks[f"1f1b/{K}/2"]) <= BUDGET < max(real_peaks[f"1f1b/{K}/3"])
    assert profile.plan is not None
    # D = 2 / 2 = 1 replica; T = 4 = m x K x D with K = 2, m = 2.
    assert (profile.plan.micro_batch, profile.plan.accumulation_steps, profile.plan.world_size) == (2, 2, 1)
    assert profile.plan.exact
    line = next(w for w in profile.warnings if w.startswith("pipeline "))
    assert "the most loaded is stage 0" in line and "bubble (pp - 1) / (K + pp - 1) = 0.333" in line
    assert profile.pipeline is not None
    assert profile.pipeline.stage_peak_bytes == real_peaks[f"1f1b/{K}/2"]
    assert (profile.pipeline.most_loaded_stage, profile.pipeline.microbatches) == (0, K)
    assert profile.pipeline.bubble_fraction == pytest.approx(1 / 3)
    assert Profile.model_validate_json(profile.model_dump_json()) == profile


def test_schedules_hold_what_they_say() -> None:
    for stages, k in [(2, 4), (4, 8), (3, 3)]:
        for stage in range(stages):
            for name, most in (("1f1b", stages - stage), ("gpipe", k)):
                actions = schedule_actions(name, stage, stages, k)
                assert sorted(actions) == sorted([("F", i) for i in range(k)] + [("B", i) for i in range(k)])
                in_flight = peak = 0
                for kind, index in actions:
                    in_flight += 1 if kind == "F" else -1
                    peak = max(peak, in_flight)
                    assert kind == "F" or ("F", index) in actions[: actions.index((kind, index))]
                assert peak == most, (name, stage, stages, k)
    assert stage_block_ranges(7, 3) == [range(0, 3), range(3, 5), range(5, 7)]


def test_the_interleaved_order_is_torchs() -> None:
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B, _ComputationType

    for ranks, virtual, k in [(2, 2, 2), (2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 2, 5), (3, 3, 7)]:
        rounds = max(1, k // ranks)
        if k % rounds:
            continue
        setup = SimpleNamespace(
            n_local_stages=virtual, microbatches_per_round=k // rounds, pp_group_size=ranks, _n_microbatches=k
        )
        for rank in range(ranks):
            ops = ScheduleInterleaved1F1B._calculate_single_rank_operations(setup, rank)  # type: ignore[arg-type]
            theirs = [
                (
                    "F" if a.computation_type == _ComputationType.FORWARD else "B",
                    a.stage_index // ranks,
                    a.microbatch_index,
                )
                for a in ops
                if a is not None
            ]
            assert interleaved_actions(rank, ranks, k, virtual) == theirs, (ranks, virtual, k, rank)


def test_pipeline_plan_prefers_the_largest_k_measured_and_says_when_t_is_not_reached() -> None:
    exact = pipeline_plan(8, 64, 2, stages=4, max_microbatches=16, min_microbatches=4)
    assert (exact.micro_batch, exact.accumulation_steps, exact.exact) == (2, 16, True)
    assert "bubble (pp - 1) / (K + pp - 1) = 0.158" in exact.note
    # K = 16 would need m = 1.5 and K = 13 to 15 no whole m: K = 12 with m = 2.
    some = pipeline_plan(4, 48, 2, stages=2, max_microbatches=16, min_microbatches=2)
    assert (some.micro_batch, some.accumulation_steps, some.effective_batch) == (2, 12, 48)
    inexact = pipeline_plan(2, 100, 3, stages=2, max_microbatches=4, min_microbatches=2)
    assert not inexact.exact and inexact.micro_batch <= 2 and "no m x K x D equals target 100" in inexact.note
    with pytest.raises(ValueError, match="below the schedule's least"):
        pipeline_plan(2, 8, 1, stages=4, max_microbatches=2, min_microbatches=4)


def test_fewer_blocks_than_stages_is_one_line() -> None:
    with pytest.raises(TaskError, match=r"^--pp 4: TinyLlama of task 'tiny-llama' has 3 block\(s\) to cut"):
        PipelineTrials(
            llama_task(), CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=4, schedule="gpipe", microbatches=4
        )


def test_unmeasured_schedules_and_compositions_are_refused_in_one_line() -> None:
    with pytest.raises(AutotuneError, match="^--pp-microbatches 5: interleaved 1F1B runs rounds"):
        PipelineTrials(
            llama_task(),
            CpuMeter(UNBOUNDED),
            limit_bytes=UNBOUNDED,
            stages=2,
            schedule="interleaved-1f1b",
            microbatches=5,
        )
    with pytest.raises(AutotuneError, match="^--pp-microbatches 1 is below --pp 2"):
        PipelineTrials(
            llama_task(), CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=1
        )
    # --cp under a pipeline runs an hf: causal LM's stages (tests/autotune/test_cp_pipeline.py); this task's is not one.
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, world_size=4, mesh=Mesh(pp=2, cp=2))
    with pytest.raises(TaskError, match="^--cp 2 on the model of tiny-llama: torch's context parallelism is measured"):
        probe(llama_task(), config)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--pp", "4", "--pp-microbatches", "4"], "--pp 4 on the model's 3 block(s) (tiny-llama): a pipeline cuts"),
        (["--pp", "2", "--pp-microbatches", "1"], "--pp-microbatches 1 is below --pp 2"),
        (
            ["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--pp-microbatches", "5"],
            "--pp-microbatches 5: interleaved 1F1B runs rounds",
        ),
    ],
)
def test_bad_pipelines_are_one_line_exit_2_nothing_written(
    flags: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert said in refused_line(["--world-size", "4", *flags], tmp_path, monkeypatch, capsys)


def test_an_hf_llama_is_cut_by_its_decoder_layers() -> None:
    pytest.importorskip("transformers")
    from autotune.tasks.load import load_task

    task = load_task("hf:examples/configs/tiny-llama.json").at_length(16)
    trials = PipelineTrials(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=2)
    layout = trials.layout
    assert (layout.container, layout.prefix_modules) == ("model.layers", ["model.embed_tokens"])
    first, last = layout.stage_parameters
    assert "model.embed_tokens.weight" in first and "model.layers.0.self_attn.q_proj.weight" in first
    assert {"lm_head.weight", "model.norm.weight", "model.layers.1.mlp.up_proj.weight"} <= last
    assert not first & last
    names = {name for name, _ in trials._recorder.named_parameters()}
    assert first | last == names
    trial = trials(1)
    assert trial.fits and len(trials.stage_peaks[1]) == 2


def test_an_hf_llama_whose_blocks_are_checkpointed_is_cut_at_every_stage() -> None:
    """--ac turns the model's KV cache off on the config every stage shares; the next stage's meta forward then
    looked for packed sequences, a value read meta cannot answer (Llama 3.1 8B, --pp 2 --ac full, stopped there)."""
    pytest.importorskip("transformers")
    from autotune.tasks.load import load_task

    task = dataclasses.replace(
        load_task("hf:examples/configs/tiny-llama.json").at_length(16), activation_checkpointing="full"
    )
    trials = PipelineTrials(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=2)
    assert trials(1).fits and len(trials.stage_peaks[1]) == 2


def test_the_estimate_is_the_fake_replay_and_equals_the_real_ranks(real_peaks: dict[str, list[int]]) -> None:
    from autotune.measure.meters.fake import FakeMeter
    from autotune.orchestrate.config import EstimateConfig
    from autotune.orchestrate.estimate import estimate

    trials = PipelineTrials(
        llama_task(), FakeMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K
    )
    for m in SIZES:
        assert trials(m).fake
        assert trials.stage_peaks[m] == real_peaks[f"1f1b/{K}/{m}"], m
    config = EstimateConfig.of(
        device_kind="cpu",
        budget_bytes=BUDGET,
        headroom=0.0,
        world_size=2,  # the truth's D = 1 (no DDP over the stages), as in the probe's test above
        target_batch=4,
        mesh=Mesh(pp=2, pp_microbatches=K),
    )
    profile = estimate(llama_task(), config)
    assert (profile.source, profile.max_micro_batch) == ("estimate", 2)
    assert profile.trials and all(trial.fake for trial in profile.trials)
    assert profile.pipeline is not None and profile.pipeline.stage_peak_bytes == real_peaks[f"1f1b/{K}/2"]
    assert profile.plan is not None and (profile.plan.micro_batch, profile.plan.accumulation_steps) == (2, 2)


def test_the_most_loaded_stage_must_be_the_largest() -> None:
    with pytest.raises(ValueError, match="most_loaded_stage 1 is not the stage with the largest peak"):
        PipelineStages(microbatches=2, stage_peak_bytes=[5, 4], most_loaded_stage=1, bubble_fraction=0.25)


def test_a_gpt_whose_loss_reads_a_count_is_cut_too() -> None:
    # examples/gpt.py's loss divides by the count of supervised tokens (.item(): no value on meta); the cut reads
    # the model's own forward only. Its token and position embeddings both go with the first stage.
    from examples import gpt

    trials = PipelineTrials(
        gpt.task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="gpipe", microbatches=2
    )
    assert (trials.layout.container, trials.layout.prefix_modules) == ("blocks", ["tok", "pos"])
    assert {"tok.weight", "pos.weight"} <= trials.layout.stage_parameters[0]
    assert not {"tok.weight", "pos.weight"} & trials.layout.stage_parameters[1]


def test_checkpointed_stages_equal_the_real_ranks(real_peaks: dict[str, list[int]]) -> None:
    task = dataclasses.replace(llama_task(), activation_checkpointing="full")
    trials = PipelineTrials(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K)
    trials(3)
    # What the meter cannot see (tests/autotune/test_policy_truth.py says it too): torch.utils.checkpoint keeps the
    # CPU generator's state, a tensor made below the dispatcher, for each checkpointed call until its backward.
    # The real ranks are above by whole such states, at most one per block per micro-batch in flight (pp - s);
    # seen: 2 on stage 0, 1 on stage 1.
    rng_state = torch.get_rng_state().nbytes
    for stage, (probed, real) in enumerate(zip(trials.stage_peaks[3], real_peaks[f"1f1b+full/{K}/3"], strict=True)):
        states, rest = divmod(real - probed, rng_state)
        assert rest == 0 and 1 <= states <= len(trials.layout.ranges[stage]) * (2 - stage), (stage, probed, real)
    assert all(f < p for f, p in zip(trials.stage_peaks[3], real_peaks[f"1f1b/{K}/3"], strict=True))


def test_offloaded_stages_equal_the_real_ranks_on_the_device_and_the_host(real_peaks: dict[str, list[int]]) -> None:
    """--offload activations under --pp: each stage's blocks save their activations in host memory. The real ranks
    wrap each block's forward in save_on_cpu's hooks as a card runs them (the host copies in numpy's memory,
    tests/autotune/_pipeline_worker.py): the device's peak is the allocator's, the host's the copies' own."""
    task = dataclasses.replace(llama_task(), offload="activations")
    trials = PipelineTrials(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K)
    fake = PipelineTrials(
        task, FakeMeter(UNBOUNDED, "cpu", "cpu"), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K
    )
    for m in SIZES:
        trial = trials(m)
        host = [trials.stage_host_peaks[stage] for stage in range(2)]
        assert (trials.stage_peaks[m], host) == (
            real_peaks[f"1f1b+offload/{K}/{m}"],
            real_peaks[f"1f1b+offload/{K}/{m}/host"],
        )
        assert trial.host_peak_bytes == max(host)
        # The estimate's fake trials count the same (CPU semantics, no storage).
        fake_trial = fake(m)
        assert (fake.stage_peaks[m], fake_trial.host_peak_bytes) == (trials.stage_peaks[m], trial.host_peak_bytes)
    # The blocks' activations left the device: every stage holds less than without offload.
    assert all(o < p for o, p in zip(real_peaks[f"1f1b+offload/{K}/3"], real_peaks[f"1f1b/{K}/3"], strict=True))


def test_a_host_budget_decides_an_offloaded_pipeline_too(real_peaks: dict[str, list[int]]) -> None:
    host = real_peaks[f"1f1b+offload/{K}/2/host"]
    config = ProbeConfig(
        device="cpu",
        budget_bytes=UNBOUNDED,
        world_size=2,
        target_batch=4,
        mesh=Mesh(pp=2, pp_microbatches=K),
        offload="activations",
        host_budget_bytes=max(host),  # m = 2's most loaded rank fits it exactly; m = 3's does not
        max_micro_batch=8,
    )
    profile = probe(llama_task(), config)
    assert profile.max_micro_batch == 2
    assert profile.host_peak_bytes == max(host)
    above = next(t for t in profile.trials if t.micro_batch == 3)
    assert (
        not above.fits
        and above.peak_bytes < UNBOUNDED
        and above.host_peak_bytes == max(real_peaks[f"1f1b+offload/{K}/3/host"])
    )


def test_params_offload_over_a_pipelines_ddp_stages_is_refused_in_one_line() -> None:
    """A task file's own --offload params over stages that are not sharded (test_pipeline_fsdp measures it over
    fsdp)."""
    task = dataclasses.replace(llama_task(), offload="params")
    said = "^--offload params with --strategy ddp: it is FSDP2's CPUOffloadPolicy"
    with pytest.raises(AutotuneError, match=said):
        PipelineTrials(task, CpuMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=2)


def assert_compiled_stages_equal(task: ProbeTask, real_peaks: dict[str, list[int]], job: str) -> None:
    """The 1F1B stages of a job whose step compiles (torchao's optimizer, --compile), measured on the allocator's own
    count (CompiledCpuMeter), equal the real ranks' ``job`` at each of SIZES."""
    from autotune.measure.meters.compiled import CompiledCpuMeter

    meter = CompiledCpuMeter(UNBOUNDED)
    try:
        trials = PipelineTrials(task, meter, limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K)
        for m in SIZES:
            trials(m)
            assert trials.stage_peaks[m] == real_peaks[f"{job}/{K}/{m}"], m
    finally:
        meter.close()


# Between the most loaded stage's peaks at m = 2 and m = 3 under torchao's AdamW4bit (stage 0: 760,656 and 999,760).
BUDGET_4BIT = 900_000


def test_torchaos_adamw4bit_over_the_stages_equals_the_real_pipeline(real_peaks: dict[str, list[int]]) -> None:
    """--optimizer adamw4bit under --pp: torchao steps each stage's parameters through torch.compile, so the probe's
    stages run on the allocator's own count (CompiledCpuMeter); the real ranks step with torchao's own AdamW4bit.
    The estimate's fake stages run torchao's step eagerly (its states built by its own constructors)."""
    from autotune.measure.meters.fake import FakeMeter
    from autotune.orchestrate.config import EstimateConfig
    from autotune.orchestrate.estimate import estimate

    task = dataclasses.replace(llama_task(), optimizer="adamw4bit")
    assert_compiled_stages_equal(task, real_peaks, "1f1b+adamw4bit")
    fake = PipelineTrials(task, FakeMeter(UNBOUNDED), limit_bytes=UNBOUNDED, stages=2, schedule="1f1b", microbatches=K)
    for m in SIZES:
        fake(m)
        assert fake.stage_peaks[m] == real_peaks[f"1f1b+adamw4bit/{K}/{m}"], m
    # 4-bit states: every stage holds less than under torch's AdamW.
    assert all(a < b for a, b in zip(real_peaks[f"1f1b+adamw4bit/{K}/3"], real_peaks[f"1f1b/{K}/3"], strict=True))
    assert max(real_peaks[f"1f1b+adamw4bit/{K}/2"]) <= BUDGET_4BIT < max(real_peaks[f"1f1b+adamw4bit/{K}/3"])
    config = ProbeConfig(
        device="cpu",
        budget_bytes=BUDGET_4BIT,
        headroom=0.0,
        world_size=2,
        target_batch=4,
        mesh=Mesh(pp=2, pp_microbatches=K),
    )
    probed = probe(task, config)
    assert probed.max_micro_batch == 2
    assert probed.pipeline is not None and probed.pipeline.stage_peak_bytes == real_peaks[f"1f1b+adamw4bit/{K}/2"]
    estimated = estimate(task, EstimateConfig(probe=config, device_kind="cpu"))
    assert estimated.max_micro_batch == 2
    assert estimated.pipeline is not None
    assert estimated.pipeline.stage_peak_bytes == real_peaks[f"1f1b+adamw4bit/{K}/2"]


def test_compiled_stages_equal_the_real_pipeline(real_peaks: dict[str, list[int]]) -> None:
    """--compile under --pp: each stage's blocks compiled (torchtitan's apply_compile, one graph per block), the
    stages on the allocator's own count (CompiledCpuMeter), against the real 2-rank pipeline whose blocks are
    torch.compile'd in their places."""

    task = dataclasses.replace(llama_task(), compile="default")
    assert_compiled_stages_equal(task, real_peaks, "1f1b+compile")
    # Compiled blocks hold less than eager ones here, on every stage.
    assert all(c < e for c, e in zip(real_peaks[f"1f1b+compile/{K}/3"], real_peaks[f"1f1b/{K}/3"], strict=True))
    # The probe at a budget between the compiled pipeline's m = 2 and m = 3 (stage 0: 815,692 and 997,452 bytes),
    # its most loaded stage broken down, the parts summing to the real rank's peak.
    budget = 900_000
    assert max(real_peaks[f"1f1b+compile/{K}/2"]) <= budget < max(real_peaks[f"1f1b+compile/{K}/3"])
    config = ProbeConfig(
        device="cpu",
        budget_bytes=budget,
        headroom=0.0,
        world_size=2,
        target_batch=4,
        mesh=Mesh(pp=2, pp_microbatches=K),
        breakdown=True,
    )
    probed = probe(task, config)
    assert probed.max_micro_batch == 2
    assert probed.pipeline is not None and probed.pipeline.stage_peak_bytes == real_peaks[f"1f1b+compile/{K}/2"]
    assert any(w.startswith("compiled (default) under --pp 2: each stage's blocks") for w in probed.warnings)
    assert probed.breakdown is not None
    found = {b.micro_batch: b for b in probed.breakdown}
    assert found[2].stage == 0 and sum(found[2].parts.values()) == max(real_peaks[f"1f1b+compile/{K}/2"])
    assert found[2].peak_where.startswith("compiled code in the")
    # The estimate's fake stages run the blocks eager: not broken down, and the datasheet says so.
    from autotune.orchestrate.config import EstimateConfig
    from autotune.orchestrate.estimate import estimate

    estimated = estimate(task, EstimateConfig(probe=config, device_kind="cpu"))
    assert estimated.breakdown is None
    assert any(w.startswith("the peak is not broken down for this compiled job") for w in estimated.warnings)


def test_compiled_stages_under_a_memory_budget_equal_the_real_pipeline(real_peaks: dict[str, list[int]]) -> None:
    """--compile --ac budget:0.5 under --pp: each block's graph partitioned under the compiler's activation memory
    budget, against the real pipeline whose ranks set torch._functorch.config.activation_memory_budget = 0.5."""

    task = dataclasses.replace(llama_task(), compile="default", activation_checkpointing="budget:0.5")
    assert_compiled_stages_equal(task, real_peaks, "1f1b+compile+budget:0.5")
    # The budget recomputes part of each block's forward: the first stage holds less than compiled alone.
    assert real_peaks[f"1f1b+compile+budget:0.5/{K}/3"][0] < real_peaks[f"1f1b+compile/{K}/3"][0]
