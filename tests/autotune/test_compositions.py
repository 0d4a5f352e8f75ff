"""One table of the compositions autotune refuses (autotune/core/compositions.py), asked by every asker: the CLI
before the task loads, the configs before any trial, the strategies where a library would fail. Each refusal is
the same one line wherever it fires, names both flags, exits 2 and writes nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.compositions import COMPOSITIONS, Dimensions, composition_refusal, composition_table
from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.measure.pipeline import ShardedStage
from autotune.measure.strategies import Sharded, TensorParallel
from autotune.measure.strategy_choice import make_strategy
from autotune.orchestrate.config import ProbeConfig
from tests.autotune._tasks import linear_task

REPO = Path(__file__).resolve().parents[2]

# One job per rule that the rule, and only it, refuses: the table's rows are each reachable.
REFUSED = [
    Dimensions(world_size=2, cp=2, compile="default"),
    Dimensions(strategy="fsdp", world_size=1),
    Dimensions(strategy="fsdp", world_size=2, tp=2),
    Dimensions(offload="params"),
    Dimensions(host_budget=True),
    Dimensions(quantize="nf4", lora=False),
    Dimensions(strategy="fsdp", world_size=2, quantize="nf4", lora=True),
    Dimensions(world_size=2, tp=2, quantize="nf4", lora=True),
    Dimensions(world_size=2, tp=2, optimizer="adamw8bit", optimizer_library="bitsandbytes"),
    Dimensions(activation_checkpointing="budget:0.5"),
    Dimensions(world_size=2, tp=2, lm_loss="fused-linear"),
    Dimensions(world_size=2, pp=2, lm_loss="chunked:256"),
    Dimensions(world_size=2, cp=2, lm_loss="fused-linear"),
    Dimensions(weights_dtype="fp16", precision="fp16"),
]


def test_each_rule_is_reached_by_a_job_and_names_both_of_its_flags() -> None:
    assert len(REFUSED) == len(COMPOSITIONS)
    for dims, rule in zip(REFUSED, COMPOSITIONS, strict=True):
        applying = [r for r in COMPOSITIONS if r.applies(dims)]
        assert applying == [rule], (dims, [r.first for r in applying])
        line = composition_refusal(dims)
        assert line is not None and "\n" not in line
        flags, _, reason = line.partition(": ")
        # Both dimensions are named by their flags, before the reason.
        assert flags.startswith(rule.first.split()[0]), (flags, rule.first)
        assert flags.count("--") == 2 and reason, line


@pytest.mark.parametrize(
    "dims",
    [
        Dimensions(strategy="fsdp", world_size=4, tp=2),
        Dimensions(strategy="fsdp", world_size=4, cp=2, tp=2),
        Dimensions(world_size=4, cp=2, tp=2),  # test_context_parallel.py: against real ranks (torch's TP + DDP)
        Dimensions(world_size=4, pp=2, tp=2),
        Dimensions(strategy="fsdp", world_size=4, pp=2, offload="none", compile=None),
        Dimensions(world_size=2, pp=2, offload="activations"),  # test_pipeline.py: against real ranks
        Dimensions(strategy="fsdp", world_size=4, pp=2, offload="params"),  # test_pipeline_fsdp.py
        Dimensions(strategy="fsdp", world_size=2, offload="params", host_budget=True),
        Dimensions(world_size=2, optimizer="adamw8bit", optimizer_library="bitsandbytes"),
        Dimensions(quantize="nf4", lora=True, world_size=2),
        Dimensions(activation_checkpointing="budget:0.5", compile="default"),
        Dimensions(world_size=2, pp=2, compile="default", activation_checkpointing="budget:0.5"),
        Dimensions(strategy="fsdp", world_size=4, pp=2, compile="default"),
        Dimensions(world_size=4, pp=2, tp=2, compile="default"),  # test_pipeline_fsdp.py: against real ranks
        Dimensions(world_size=2, tp=2, lora=True),
        Dimensions(strategy="fsdp", world_size=4, cp=2),
        # test_losses.py: against the allocator, under ddp and FSDP2 x 2.
        Dimensions(strategy="fsdp", world_size=2, lm_loss="fused-linear"),
        # What the asker does not know yet waits: the CLI cannot tell whether a spec carries LoRA.
        Dimensions(quantize="nf4"),
    ],
)
def test_what_composes_is_not_refused(dims: Dimensions) -> None:
    assert composition_refusal(dims) is None


def test_the_pages_table_is_the_codes() -> None:
    page = (REPO / "docs" / "meshes.md").read_text()
    found = re.search(r"<!-- compositions: begin -->\n(.*)\n<!-- compositions: end -->", page, re.S)
    assert found is not None and found.group(1) == composition_table()


def _raised(call: object) -> str:
    with pytest.raises(AutotuneError) as caught:
        call()  # type: ignore[operator]
    return str(caught.value)


def test_every_asker_says_the_same_line() -> None:
    pp_one_shard = composition_refusal(Dimensions(strategy="fsdp", world_size=2, pp=2))
    assert pp_one_shard is not None and pp_one_shard.startswith("--strategy fsdp with --world-size 2 over pp 2")
    config = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, strategy="fsdp", mesh=Mesh(pp=2))
    assert _raised(config.validate) == pp_one_shard
    assert _raised(lambda: make_strategy("fsdp", 2, Mesh(pp=2))) == pp_one_shard
    assert _raised(lambda: ShardedStage(2, 2, inner="fsdp")) == pp_one_shard

    one_shard = composition_refusal(Dimensions(strategy="fsdp", world_size=2, tp=2))
    assert one_shard is not None and one_shard.startswith("--strategy fsdp with --world-size 2 over tp 2")
    assert _raised(lambda: TensorParallel(2, Mesh(tp=2), inner="fsdp")) == one_shard
    assert (
        _raised(
            ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, strategy="fsdp", mesh=Mesh(tp=2)).validate
        )
        == one_shard
    )
    stage = composition_refusal(Dimensions(strategy="fsdp", world_size=2, pp=2))
    assert _raised(lambda: ShardedStage(2, 2)) == stage

    alone = composition_refusal(Dimensions(strategy="fsdp", world_size=1))
    assert _raised(lambda: Sharded(1)) == alone
    assert _raised(ProbeConfig(device="cpu", budget_bytes=1 << 30, strategy="fsdp").validate) == alone


def test_the_config_asks_with_the_tasks_own_dimensions() -> None:
    """What only the task knows (its compile or offload, its optimizer's library) is asked before any trial."""
    offloaded = dataclasses.replace(linear_task(), offload="params")
    config = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2)
    said = composition_refusal(Dimensions(world_size=2, offload="params"))
    assert _raised(lambda: config.applied_to(offloaded)) == said
    # Over ddp, fsdp or tp stages a compiled pipeline is measured (test_pipeline, test_pipeline_fsdp): not refused.
    task = dataclasses.replace(linear_task(), compile="default")
    for strategy, world_size, mesh in (("ddp", 2, Mesh(pp=2)), ("fsdp", 4, Mesh(pp=2)), ("ddp", 4, Mesh(pp=2, tp=2))):
        stages = ProbeConfig(device="cpu", budget_bytes=1 << 30, strategy=strategy, world_size=world_size, mesh=mesh)
        assert stages.applied_to(task).name == "linear"
    adam8 = dataclasses.replace(linear_task(), optimizer="adamw8bit")
    fsdp = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, strategy="fsdp")
    assert _raised(lambda: fsdp.applied_to(adam8)).startswith(
        "--optimizer adamw8bit under --strategy fsdp: bitsandbytes'"
    )
    adam4 = dataclasses.replace(linear_task(), optimizer="adamw4bit")
    # Measured over ddp and under fsdp (test_optimizer_ranks), under tp (test_tensor_parallel), over a pipeline's
    # stages (test_pipeline), under cp (test_context_parallel): not refused.
    for strategy, mesh in (
        ("ddp", Mesh()),
        ("fsdp", Mesh()),
        ("ddp", Mesh(tp=2)),
        ("ddp", Mesh(pp=2)),
        ("ddp", Mesh(cp=2)),
    ):
        replicas = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, strategy=strategy, mesh=mesh)
        assert replicas.applied_to(adam4).name == "linear"


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--world-size", "2", "--cp", "2", "--compile"], "--cp 2 with --compile default: "),
        (["--strategy", "fsdp", "--world-size", "2", "--tp", "2"], "--strategy fsdp with --world-size 2 over tp 2: "),
        (["--offload", "params"], "--offload params with --strategy ddp: "),
        (["--weights-dtype", "fp16", "--precision", "fp16"], "--weights-dtype fp16 with --precision fp16: "),
    ],
)
@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_the_cli_refuses_before_the_task_loads_in_one_line(
    command: str, flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "profile.json"
    # A task that does not exist: the refusal comes before anything loads it.
    on_cpu = ["--device", "cpu"] if command == "probe" else ["--device-kind", "cpu"]
    argv = [command, "no_such_module.py:task", *on_cpu, "--budget", "64MiB", "--output", str(out), *flags]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0], err
    assert not out.exists()
