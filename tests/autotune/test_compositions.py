"""One table of the compositions autotune refuses (autotune/core/compositions.py), asked by every asker: the CLI
before the task loads, the configs before any trial, the strategies where a library would fail. Each refusal is
the same one line wherever it fires, names both flags, exits 2 and writes nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.compositions import COMPOSITIONS, Dimensions, ModelShape, composition_refusal, composition_table
from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh
from autotune.measure.pipeline import ShardedStage
from autotune.measure.strategies import Sharded, TensorParallel
from autotune.measure.strategy_choice import make_strategy
from autotune.orchestrate.config import ProbeConfig
from tests.autotune._tasks import linear_task

REPO = Path(__file__).resolve().parents[2]
# The tiny Llama of examples/configs/tiny-llama.json as the mesh rows read it, and a task file's model without an hf:
# config (examples/gpt.py:task).
LLAMA = ModelShape(name="llama-107K", heads=4, kv_heads=2, blocks=2, family="llama", causal_lm_sdpa=True,
                   tp_plans=("torchtitan",))  # fmt: skip
GPT = ModelShape(name="gpt-small", blocks=2)

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
    Dimensions(world_size=3, cp=3, seq_lens=(32,)),
    Dimensions(world_size=2, ep=2),
    Dimensions(strategy="fsdp", world_size=4, ep=2, tp=2),
    Dimensions(strategy="fsdp", world_size=2, ep=2, compile="default"),
    Dimensions(strategy="fsdp", world_size=2, ep=2, model=LLAMA),  # a dense model
    Dimensions(strategy="fsdp", world_size=3, ep=3, model=dataclasses.replace(LLAMA, experts=8)),
    Dimensions(world_size=3, tp=3, model=dataclasses.replace(LLAMA, kv_heads=4)),  # the heads alone
    Dimensions(world_size=4, tp=4, model=LLAMA),  # the key/value heads alone
    Dimensions(world_size=4, pp=4, model=LLAMA),
    Dimensions(world_size=2, cp=2, model=GPT),
    Dimensions(world_size=2, tp=2, tp_plan="torchtitan", model=GPT),
]
# The rows that read the model name the one flag and the model's number (issue 62, item 6), not two flags.
MODEL_ROWS = {"the model's attention heads", "the model's key/value heads", "the model's blocks",
              "a model other than an hf: causal LM", "a model of another family", "a dense model",
              "the model's experts"}  # fmt: skip


def test_each_rule_is_reached_by_a_job_and_names_both_of_its_flags() -> None:
    assert len(REFUSED) == len(COMPOSITIONS)
    for dims, rule in zip(REFUSED, COMPOSITIONS, strict=True):
        applying = [r for r in COMPOSITIONS if r.applies(dims)]
        assert applying == [rule], (dims, [r.first for r in applying])
        line = composition_refusal(dims)
        assert line is not None and "\n" not in line
        flags, _, reason = line.partition(": ")
        # Both dimensions are named by their flags, before the reason (a model row: the flag and the model).
        assert flags.startswith(rule.first.split()[0]), (flags, rule.first)
        if rule.second in MODEL_ROWS:
            assert flags.count("--") == 1 and " the model" in flags and reason, line
        else:
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
        # ... nor, before the task loads, the model's heads and blocks.
        Dimensions(world_size=3, tp=3),
        Dimensions(world_size=4, pp=4),
        # A mesh the model takes.
        Dimensions(world_size=2, tp=2, tp_plan="torchtitan", model=LLAMA, seq_lens=(32,)),
        Dimensions(world_size=4, cp=2, pp=2, model=LLAMA, seq_lens=(32, 64)),
        Dimensions(world_size=2, pp=2, model=GPT),
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
    ):
        replicas = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, strategy=strategy, mesh=mesh)
        assert replicas.applied_to(adam4).name == "linear"
    # cp runs an hf: causal LM only (the model's row, issue 62): the optimizer composes with it there.
    from autotune.tasks.load import load_task

    llama = dataclasses.replace(load_task("hf:examples/configs/tiny-llama.json").at_length(32), optimizer="adamw4bit")
    cp = ProbeConfig(device="cpu", budget_bytes=1 << 30, world_size=2, mesh=Mesh(cp=2))
    assert cp.applied_to(llama).name == "llama-107K"
    assert _raised(lambda: cp.applied_to(adam4)).startswith("--cp 2 on the model of linear: torch's context")


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


TINY_LLAMA = "hf:examples/configs/tiny-llama.json"  # 4 heads, 2 key/value heads, 2 blocks


@pytest.mark.parametrize(
    ("task", "flags", "said"),
    [
        (TINY_LLAMA, ["--tp", "3", "--world-size", "3"], "--tp 3 on the model's 4 attention heads (llama-107K): "),
        (TINY_LLAMA, ["--tp", "4", "--world-size", "4"], "--tp 4 on the model's 2 key/value heads (llama-107K): "),
        (TINY_LLAMA, ["--pp", "4", "--world-size", "4"], "--pp 4 on the model's 2 block(s) (llama-107K): "),
        (TINY_LLAMA, ["--cp", "3", "--world-size", "3"], "--cp 3 at --seq-len 32: "),
        ("examples/gpt.py:task", ["--cp", "2", "--world-size", "2"], "--cp 2 on the model of gpt-small: "),
        (
            "examples/gpt.py:task",
            ["--tp", "2", "--world-size", "2", "--tp-plan", "torchtitan"],
            "--tp-plan torchtitan on the model of gpt-small (no hf: config): ",
        ),
    ],
)
@pytest.mark.parametrize("command", ["probe", "estimate"])
def test_a_mesh_the_model_cannot_take_is_refused_before_any_trial(
    command: str, task: str, flags: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 62, item 6: `--tp 3` on 4 heads, `--pp 4` on 2 blocks, `--cp 3` at L 32 and `--tp-plan torchtitan` on a
    task file were refused 16-25 s in, inside the search ("the search of hf:... on an emulated h100 failed: ...").
    Now the composition table's model rows refuse them once the task is loaded: one line, the flag and the model's
    number, exit 2, before the first trial (no trial line, no "estimating" or "probing" line), nothing written."""
    out = tmp_path / "profile.json"
    on_cpu = ["--device", "cpu"] if command == "probe" else ["--device-kind", "cpu"]
    lengths = ["--seq-len", "32"] if task == TINY_LLAMA else []
    argv = [command, task, *on_cpu, "--budget", "64MiB", *lengths, "--output", str(out), *flags]
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and err[0].startswith(f"autotune: error: {said}"), err
    assert not out.exists()


def test_an_estimate_for_a_card_refuses_before_its_child_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The issue's h100 case: the key/value heads refused in this process, not by the emulated card's search."""
    out = tmp_path / "profile.json"
    argv = ["estimate", TINY_LLAMA, "--gpu", "h100", "--seq-len", "32", "--tp", "4", "--world-size", "4",
            "--output", str(out)]  # fmt: skip
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert err == [
        "autotune: error: --tp 4 on the model's 2 key/value heads (llama-107K): tensor parallelism shards the key and "
        "value projections by head over the tp ranks: --tp must divide the key/value heads (grouped-query attention "
        "has fewer of them than query heads)"
    ]
