"""One job setup (issue 40, autotune/core/setup.py): what it derives (D, DDP's buckets, the planner, the
fingerprint's setup part, how two setups differ), that the probe's profile, the query and the client build the same
one, the resolved tp plan of an hf: model in the fingerprint, the integrations' reading of a trainer's ranks, and
the no-fit diagnosis under the mesh, DDP's buckets and the host budget (its advice fits when used)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from autotune.core.errors import CannotFitError
from autotune.core.mesh import Mesh
from autotune.core.plan import plan_with_single_step
from autotune.core.setup import JobSetup
from autotune.orchestrate.config import EstimateConfig, ProbeConfig
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.load import load_task

TINY_LLAMA = Path(__file__).resolve().parents[2] / "examples" / "configs" / "tiny-llama.json"


def test_the_setup_derives_d_and_ddps_buckets_by_dimension() -> None:
    assert JobSetup(world_size=4).data_parallel == 4
    assert JobSetup(world_size=4, mesh=Mesh(tp=2)).data_parallel == 2
    assert JobSetup(world_size=2, mesh=Mesh(tp=2)).holds_ddp_buckets is False  # D = 1: no DDP at all
    assert JobSetup(world_size=4, mesh=Mesh(tp=2)).holds_ddp_buckets is True
    assert JobSetup(world_size=2, mesh=Mesh(cp=2)).holds_ddp_buckets is True  # DDP runs over the cp ranks
    assert JobSetup(strategy="fsdp", world_size=4).holds_ddp_buckets is False
    with pytest.raises(ValueError, match="not a multiple of --tp x --pp x --cp"):
        JobSetup(world_size=3, mesh=Mesh(tp=2))
    with pytest.raises(ValueError, match="host_budget_bytes needs an offload"):
        JobSetup(host_budget_bytes=2**20)


def test_a_pipeline_is_planned_within_its_k_bounds_and_plain_jobs_as_before() -> None:
    gpipe = JobSetup(world_size=2, mesh=Mesh(pp=2, pp_schedule="gpipe", pp_microbatches=2))
    assert gpipe.planner == "pipeline" and gpipe.pipeline_microbatches == (1, 2)
    chosen = gpipe.plan(20, 64)
    assert chosen.accumulation_steps <= 2 and chosen.micro_batches == [(20, 2)] and not chosen.exact
    one_f_one_b = JobSetup(world_size=2, mesh=Mesh(pp=2, pp_microbatches=4))
    assert one_f_one_b.pipeline_microbatches == (2, 4) and one_f_one_b.plan(24, 8).accumulation_steps >= 2
    plain = JobSetup(world_size=4)
    assert plain.planner == "accumulate" and plain.plan(26, 256) == plan_with_single_step(26, 256, 4)
    # The probe's plan is the setup's (ProbeConfig.plan_for).
    config = ProbeConfig(world_size=4, mesh=Mesh(tp=2), target_batch=64)
    assert config.plan_for(4, []) == JobSetup(world_size=4, mesh=Mesh(tp=2)).plan(4, 64)


def test_differences_name_the_fields_that_change_memory_or_d() -> None:
    base = JobSetup(world_size=4)
    assert base.differences(JobSetup(world_size=8)) == ()  # both hold DDP's buckets: one kind
    assert base.differences(JobSetup(world_size=1)) == ("world_size",)
    assert base.differences(JobSetup(world_size=4, mesh=Mesh(tp=2))) == ("mesh",)
    assert JobSetup(strategy="fsdp", world_size=4).differences(JobSetup(strategy="fsdp", world_size=8)) == (
        "world_size",
    )
    offloaded = JobSetup(offload="activations", host_budget_bytes=2**20)
    assert offloaded.differences(JobSetup(offload="activations")) == ("host_budget_bytes",)
    assert JobSetup(compile="default", world_size=4).differences(base) == ("compile",)
    assert base.kind() == JobSetup(world_size=2).kind() != JobSetup(world_size=1).kind()


def test_the_fingerprints_setup_part_is_the_setups() -> None:
    # The plain setup adds nothing (every fingerprint from before setups stays), fsdp its world size and layout.
    assert JobSetup(world_size=8).fingerprint_tags() == {}
    assert JobSetup(strategy="fsdp", world_size=4).fingerprint_tags() == {
        "autotune.strategy": "fsdpx4",
        "autotune.fsdp_layout": "torchtitan",
    }
    tags = JobSetup(world_size=4, mesh=Mesh(tp=2), tp_plan='{"x":"colwise"}').fingerprint_tags()
    assert tags == {"autotune.mesh": "tp=2", "autotune.tp_plan": '{"x":"colwise"}'}


def test_an_hf_models_own_tp_plan_enters_the_fingerprint(tmp_path: Path) -> None:
    # Finding 4: two configs whose plans differ shared a key (only a task's own tp_plan was tagged).
    config = json.loads(TINY_LLAMA.read_text())
    other = tmp_path / "tiny-llama-rowwise-mlp.json"
    other.write_text(json.dumps({**config, "base_model_tp_plan": {"layers.*.mlp.down_proj": "colwise"}}))
    ours, theirs = load_task(f"hf:{TINY_LLAMA}"), load_task(f"hf:{other}")
    assert task_fingerprint(ours) == task_fingerprint(theirs)  # without --tp the plan holds nothing
    assert task_fingerprint(ours, world_size=2, mesh=Mesh(tp=2)) != task_fingerprint(
        theirs, world_size=2, mesh=Mesh(tp=2)
    )


def test_the_probes_profile_and_the_client_share_the_setups_fingerprint() -> None:
    # Finding 6: the client fingerprinted an fsdp job without the fsdp tags, so it never found its profiles.
    from autotune_client._suggest import job_fingerprint
    from examples import gpt

    model = gpt.task.model()
    for strategy, world, mesh in (("fsdp", 2, ""), ("ddp", 4, "tp=2"), ("ddp", 1, "")):
        expected = task_fingerprint(gpt.task, strategy=strategy, world_size=world, mesh=Mesh.parse(mesh))
        got = job_fingerprint(
            model, example=gpt.task.batch, tags=gpt.task.tags, strategy=strategy, world_size=world, mesh=mesh
        )
        assert got == expected, (strategy, world, mesh)


def test_tune_trainer_reads_the_trainers_ranks_fsdp_and_checkpointing(tmp_path: Path) -> None:
    # Finding 7: tp and cp ranks were counted as replicas; fsdp and the Trainer's checkpointing were ignored.
    from accelerate.parallelism_config import ParallelismConfig
    from transformers import TrainingArguments

    from autotune_client.integrations.transformers import _memory_policy, trainer_layout

    plain = TrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert (trainer_layout(plain).replicas, trainer_layout(plain).mesh, _memory_policy(plain)) == (1, "", "none")
    meshed = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, parallelism_config=ParallelismConfig(tp_size=2))
    meshed_layout = dataclasses.replace(trainer_layout(meshed), world_size=4)  # as a 4-process job reads it
    assert (meshed_layout.mesh, meshed_layout.replicas, meshed_layout.strategy) == ("tp=2", 2, "ddp")
    sharded = TrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        fsdp=True,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"every_n_layers": 2},
    )
    assert (trainer_layout(sharded).strategy, _memory_policy(sharded)) == ("fsdp", "every-2")


def _advised_budget(error: CannotFitError) -> int:
    found = re.search(r"a budget of (\d+) bytes", str(error))
    assert found is not None, str(error)
    return int(found.group(1))


@pytest.mark.parametrize(
    "setup",
    [
        {"world_size": 2},  # DDP's buckets: the advice left them out and failed again
        {"world_size": 2, "mesh": Mesh(pp=2, pp_microbatches=2)},  # the whole model's budget, not a stage's
    ],
    ids=["ddp-x2", "pp-2"],
)
def test_the_no_fit_advice_is_computed_under_the_setup_and_fits_when_used(setup: dict[str, object]) -> None:
    # Finding 10: exit 4's advice ignored the mesh and DDP's buckets.
    from autotune.orchestrate.estimate import estimate
    from examples import gpt

    def at(budget: int) -> EstimateConfig:
        return EstimateConfig.of(device_kind="cpu", device_name="cpu", budget_bytes=budget, **setup)

    with pytest.raises(CannotFitError) as refused:
        estimate(gpt.task, at(2**20))
    if "mesh" in setup:
        assert "pp 2 (1f1b, K 2) over world size 2 (the most loaded rank)" in str(refused.value)
    advised = _advised_budget(refused.value)
    assert estimate(gpt.task, at(advised)).max_micro_batch >= 1
    with pytest.raises(CannotFitError):  # and the advice is the least: a little less does not fit
        estimate(gpt.task, at(int(advised * 0.97)))


def test_a_host_budget_failure_is_said_as_one() -> None:
    from autotune.orchestrate.probe import probe
    from examples import gpt

    config = ProbeConfig(device="cpu", budget_bytes=24 << 20, offload="activations", host_budget_bytes=100 << 10)
    with pytest.raises(CannotFitError, match=r"does not fit the host budget: it keeps \d+ bytes .* on the host"):
        probe(gpt.task, config)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # An optimizer whose step cannot take DTensors, refused for an estimate as for a probe (the AdamW hint before).
        (
            ["estimate", f"hf:{TINY_LLAMA}?optimizer=adamw8bit", "--seq-len", "64", "--device-kind", "cpu",
             "--budget", "24MiB", "--world-size", "2", "--strategy", "fsdp"],
            "--optimizer adamw8bit under --strategy fsdp: bitsandbytes' update ops",
        ),
        # The target's bound under a mesh is D (2 here), not W.
        (
            ["estimate", "examples/gpt.py:task", "--device-kind", "cpu", "--budget", "24MiB", "--world-size", "4",
             "--tp", "2", "--target-batch", "1"],
            "target-batch 1 is smaller than world-size 4 over tp 2 (2 replicas)",
        ),
    ],
    ids=["adamw8bit-fsdp", "target-below-d"],
)  # fmt: skip
def test_setup_refusals_are_one_line(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    # The last line is the refusal (bitsandbytes and torchao log their loading on import, in this process).
    assert message in err.strip().splitlines()[-1] and "Traceback" not in err, err
