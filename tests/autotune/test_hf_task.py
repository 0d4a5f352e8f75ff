"""hf: task specs: the causal LM transformers builds from a config.json, sequence-aware, one-line refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.hf import parameter_count_text, with_options
from autotune.tasks.load import load_task
from tests.autotune._hf_configs import CONFIGS, SEQ_LEN, VOCAB, write_config

MiB = 1 << 20


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_model_is_transformers_own_causal_lm_and_the_batch_is_tokens_at_a_length(tmp_path: Path, arch: str) -> None:
    directory = write_config(tmp_path, arch)
    task = load_task(f"hf:{directory}")
    expected = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    model = task.model()
    assert type(model) is type(expected)
    assert model.config._attn_implementation == expected.config._attn_implementation == "sdpa"
    count = sum(p.numel() for p in expected.parameters())
    assert task.name == f"{arch}-{parameter_count_text(count)}"
    assert task.tags == {"hf_model_type": arch, "attn_implementation": "sdpa"}
    assert task.optimizer is None  # the probe's AdamW
    assert task.shard_classes and all(cls.__name__.endswith(("DecoderLayer", "Block")) for cls in task.shard_classes)

    batch = task.batch(3, seq_len=SEQ_LEN)
    assert batch["input_ids"].shape == (3, SEQ_LEN) and batch["input_ids"].max() < VOCAB
    assert torch.equal(batch["labels"], batch["input_ids"])
    assert torch.equal(task.batch(3, seq_len=SEQ_LEN)["input_ids"], batch["input_ids"])  # same shape, same tokens
    assert task.batch(3, seq_len=2 * SEQ_LEN)["input_ids"].shape == (3, 2 * SEQ_LEN)
    # Past the config's positions the model refuses the length (a trial reports it as the model's limit).
    with pytest.raises(ValueError, match="longer than the config's max_position_embeddings 64"):
        task.batch(1, seq_len=65)
    model.eval()  # dropout (GPT-2 has it) off, so that two forwards agree
    loss = task.compute_loss(model, batch)
    assert torch.equal(loss, model(**batch).loss)
    assert task.loss_sum is not None
    total, supervised = task.loss_sum(model, batch)
    assert supervised == 3 * (SEQ_LEN - 1)
    assert torch.allclose(total / supervised, loss)


def test_a_config_file_and_its_directory_are_the_same_task(tmp_path: Path) -> None:
    directory = write_config(tmp_path, "llama")
    by_dir, by_file = load_task(f"hf:{directory}"), load_task(f"hf:{directory / 'config.json'}")
    assert by_dir.name == by_file.name == "llama-26K"


def test_the_optimizer_options_travel_in_the_spec(tmp_path: Path) -> None:
    directory = write_config(tmp_path, "gpt2")
    spec = with_options(f"hf:{directory}", optimizer="SGD", lr=0.05)
    assert spec == f"hf:{directory}?optimizer=SGD&lr=0.05"
    task = load_task(spec)
    optimizer = task.make_optimizer([torch.nn.Parameter(torch.zeros(2))])
    assert type(optimizer) is torch.optim.SGD and optimizer.defaults["lr"] == 0.05
    dotted = load_task(with_options(f"hf:{directory}", optimizer="torch.optim.Adagrad"))
    assert type(dotted.make_optimizer([torch.nn.Parameter(torch.zeros(2))])) is torch.optim.Adagrad
    with pytest.raises(TaskError, match="apply to hf: tasks"):
        with_options("examples/mlp.py:task", optimizer="SGD")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "the folder has no config.json (hf: reads a config.json, or a folder holding one)"),
        ("{not json", "is not readable JSON"),
        ('{"vocab_size": 8}', 'has no "model_type"'),
        ('{"model_type": "no-such-model"}', "transformers cannot read the config: Unrecognized model"),
        (
            '{"model_type": "t5", "d_model": 32, "num_layers": 1}',
            "transformers cannot build a causal LM from it: Unrecognized configuration class",
        ),
    ],
)
def test_a_config_that_is_no_causal_lm_is_refused_in_one_line(
    tmp_path: Path, content: str | None, message: str
) -> None:
    if content is not None:
        (tmp_path / "config.json").write_text(content)
    with pytest.raises(TaskError, match=re.escape(message)) as caught:
        load_task(f"hf:{tmp_path}")
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # A file path that is not there (issue 62: "hf:configs/llama.json: no config.json there").
        ("hf:configs/no-such.json", "hf:configs/no-such.json: no such file (hf: reads a config.json, or a folder"),
        # A hub id: hf: never reads the hub, and the line says how to get the config.
        (
            "hf:meta-llama/Llama-3.1-8B",
            "hf:meta-llama/Llama-3.1-8B: no local file or folder of that name; hf: reads a local config.json (or a "
            "folder holding one), never the hub: get it with hf download meta-llama/Llama-3.1-8B config.json "
            "--local-dir llama-3.1-8b (huggingface_hub's CLI), then hf:llama-3.1-8b",
        ),
    ],
)
def test_a_config_that_is_not_here_says_what_hf_reads(
    spec: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TaskError) as caught:
        load_task(spec)
    assert str(caught.value).startswith(message), str(caught.value)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("?optimizer=NoSuchThing", "is not a torch.optim.Optimizer class"),
        ("?lr=fast", "is not a number"),
        ("?momentum=0.9", "unknown option momentum"),
        ("?optimizer=SGD&lr=-1", "cannot be built with lr=-1.0"),
    ],
)
def test_bad_optimizer_options_are_refused_in_one_line(tmp_path: Path, query: str, message: str) -> None:
    directory = write_config(tmp_path, "llama")
    with pytest.raises(TaskError, match=message):
        load_task(f"hf:{directory}{query}")


def test_cli_verify_needs_a_length_and_proves_accumulation_at_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = write_config(tmp_path, "llama")  # no dropout: GPT-2's would make gradients random
    assert main(["verify", f"hf:{directory}"]) == 2
    assert "sequence-aware" in capsys.readouterr().err
    assert main(["verify", f"hf:{directory}", "--seq-len", str(SEQ_LEN), "--optimizer", "SGD"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("llama-") and ": ok: " in out and "loss_sum" in out
    assert main(["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "8MiB", "--lr", "0.1"]) == 2
    assert "apply to hf: tasks" in capsys.readouterr().err


def test_estimate_equals_probe_on_the_cpu(tmp_path: Path) -> None:
    # GPT-2 (learned positions, Conv1D) by the Python API at one length (task.at_length, what --seq-len
    # does per length); Llama by the CLI below; all three, at two lengths each: bench/hf_estimate.py.
    task = load_task(f"hf:{write_config(tmp_path, 'gpt2')}").at_length(32)
    measured = probe(task, ProbeConfig(device="cpu", budget_bytes=4 * MiB, target_batch=64))
    estimated = estimate(task, EstimateConfig.of(budget_bytes=4 * MiB, device_kind="cpu", target_batch=64))
    assert 2 <= measured.max_micro_batch < 64  # the budget binds: the recipe batch does not fit whole
    assert estimated.max_micro_batch == measured.max_micro_batch
    assert estimated.peak_at(estimated.max_micro_batch) == measured.peak_at(measured.max_micro_batch)
    assert estimated.fingerprint == measured.fingerprint


def test_cli_estimate_equals_cli_probe_at_a_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = f"hf:{write_config(tmp_path, 'llama')}"
    common = ["--seq-len", "32", "--max-seq-len", "32", "--budget", "4MiB", "--target-batch", "64", "--json"]
    assert main(["probe", spec, "--device", "cpu", "--no-throughput", *common]) == 0
    (measured,) = json.loads(capsys.readouterr().out)
    assert main(["estimate", spec, "--device-kind", "cpu", *common]) == 0
    (estimated,) = json.loads(capsys.readouterr().out)
    assert (measured["source"], estimated["source"]) == ("measured", "estimate")
    assert measured["task"].startswith("llama-") and measured["seq_len"] == estimated["seq_len"] == 32
    assert 2 <= measured["max_micro_batch"] == estimated["max_micro_batch"] < 64
    assert measured["fingerprint"] == estimated["fingerprint"]


def test_importing_autotune_and_its_cli_does_not_import_transformers() -> None:
    code = (
        "import sys, autotune, autotune.cli, autotune.tasks.hf, autotune_client\n"
        "print(json.dumps(sorted(m for m in ('transformers', 'lightning', 'torch') if m in sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", "import json\n" + code], capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == []
