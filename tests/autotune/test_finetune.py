"""Fine-tuning tasks on hf: specs (issue 24): every head family, LoRA (peft) and the weights' dtype, checked
against the CPU allocator's own count of the model built the ordinary way (tests/autotune/_allocator_truth.py)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from torch import nn

from autotune.cli import main
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.trial import build_model, build_on_meta
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.hf import with_options
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask, weights_dtype_refusal
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import CONFIGS, HEADS, SEQ_LEN, VOCAB, write_config, write_head_config

peft = pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]

# head -> (class built, family, batch shapes at m = 3, L = SEQ_LEN, labels' count for loss_sum)
SHAPES: dict[str, tuple[str, dict[str, tuple[int, ...]], int]] = {
    "bert-seq-cls": ("sequence-classification", {"input_ids": (3, 16), "attention_mask": (3, 16), "labels": (3,)}, 3),
    "bert-token-cls": (
        "token-classification",
        {"input_ids": (3, 16), "attention_mask": (3, 16), "labels": (3, 16)},
        48,
    ),
    "bert-mlm": ("masked-lm", {"input_ids": (3, 16), "labels": (3, 16)}, 48),
    "t5": ("seq2seq", {"input_ids": (3, 16), "labels": (3, 16)}, 48),
    "vit": ("image-classification", {"pixel_values": (3, 3, 32, 32), "labels": (3,)}, 3),
    "llama-seq-cls": (
        "sequence-classification",
        {"input_ids": (3, 16), "attention_mask": (3, 16), "labels": (3,)},
        3,
    ),
}


@pytest.mark.parametrize("head", sorted(HEADS))
def test_each_head_is_the_class_its_config_names_batched_as_its_family(tmp_path: Path, head: str) -> None:
    task = load_task(f"hf:{write_head_config(tmp_path, head)}")
    class_name = HEADS[head]["architectures"][0]
    family, shapes, count = SHAPES[head]
    model = task.model()
    assert type(model) is getattr(transformers, class_name)
    assert task.tags["hf_class"] == class_name and task.tags["hf_family"] == family
    assert task.name.startswith(HEADS[head]["model_type"] + "-")
    assert task.sequence_aware is (family != "image-classification")
    batch = task.batch(3, seq_len=SEQ_LEN) if task.sequence_aware else task.batch(3)
    assert {key: tuple(value.shape) for key, value in batch.items()} == shapes
    if "input_ids" in batch:
        assert batch["input_ids"].max() < VOCAB
    if "attention_mask" in batch:
        assert bool((batch["attention_mask"] == 1).all())
    if family.endswith("classification"):
        assert batch["labels"].dtype == torch.int64 and int(batch["labels"].max()) < HEADS[head].get("num_labels", 2)
    if family == "masked-lm":
        assert torch.equal(batch["labels"], batch["input_ids"])
    model.eval()
    assert task.loss_sum is not None
    total, supervised = task.loss_sum(model, batch)
    assert supervised == count
    assert torch.allclose(total / supervised, model(**batch).loss)


def test_hf_class_overrides_the_architectures_and_the_causal_lm_stays_as_it_was(tmp_path: Path) -> None:
    directory = write_head_config(tmp_path, "llama-seq-cls")
    task = load_task(with_options(f"hf:{directory}", hf_class="LlamaForTokenClassification"))
    assert type(task.model()).__name__ == "LlamaForTokenClassification"
    assert task.tags["hf_family"] == "token-classification" and task.name.startswith("llama-token-cls-")
    plain = load_task(f"hf:{write_config(tmp_path, 'llama')}")
    # No architectures: a causal LM, its tags (and so its stored profiles' fingerprints) unchanged.
    assert plain.tags == {"hf_model_type": "llama", "attn_implementation": "sdpa"}
    named = load_task(f"hf:{write_config(tmp_path / 'named', 'llama', architectures=['LlamaForCausalLM'])}")
    assert type(named.model()) is type(plain.model()) and named.name == plain.name == "llama-26K"


def _trainable(model: nn.Module) -> list[str]:
    return [name for name, p in model.named_parameters() if p.requires_grad]


def test_lora_freezes_the_base_on_meta_and_after_materializing(tmp_path: Path) -> None:
    directory = write_config(tmp_path, "qwen2", tie_word_embeddings=True)
    task = load_task(with_options(f"hf:{directory}", lora_rank=4)).at_length(SEQ_LEN)
    assert task.name == "qwen2-27K-lora4"
    assert (task.tags["lora_rank"], task.tags["lora_alpha"], task.tags["lora_targets"]) == (4, 8.0, "q_proj,v_proj")
    config = transformers.AutoConfig.from_pretrained(directory)
    ordinary = _peft_model(
        transformers.AutoModelForCausalLM.from_config(config), peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM")
    )
    meta = build_on_meta(task)
    assert meta is not None
    model = build_model(task, CpuMeter(64 * MiB), meta)
    assert _trainable(model) == _trainable(ordinary) and all("lora_" in name for name in _trainable(model))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # type: ignore[operator,union-attr]
    optimizer = task.make_optimizer(model.parameters())
    task.compute_loss(model, task.batch(2)).backward()
    optimizer.step()
    with_grad = {id(p) for p in model.parameters() if p.grad is not None}
    assert with_grad == {id(p) for p in model.parameters() if p.requires_grad}
    assert set(map(id, optimizer.state)) == with_grad  # no optimizer state for the frozen base


def test_weights_dtype_holds_the_model_its_gradients_and_optimizer_state(tmp_path: Path) -> None:
    directory = write_config(tmp_path, "llama")
    task = load_task(with_options(f"hf:{directory}", weights_dtype="bf16")).at_length(SEQ_LEN)
    assert task.weights_dtype == "bf16" and task.tags["weights_dtype"] == "bf16" and task.name == "llama-26K-bf16"
    ordinary = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.from_pretrained(directory), dtype=torch.bfloat16
    )
    model = build_model(task, CpuMeter(64 * MiB), build_on_meta(task))
    dtypes: Callable[[nn.Module], dict[str, torch.dtype]] = lambda m: {  # noqa: E731
        n: t.dtype for n, t in [*m.named_parameters(), *m.named_buffers()]
    }
    assert dtypes(model) == dtypes(ordinary)  # bf16 weights, rotary inv_freq kept in fp32 as transformers keeps it
    optimizer = task.make_optimizer(model.parameters())
    task.compute_loss(model, task.batch(2)).backward()
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.bfloat16}
    optimizer.step()
    states = {v.dtype for state in optimizer.state.values() for k, v in state.items() if k != "step"}
    assert states == {torch.bfloat16}
    # A ProbeTask of one's own: the factory runs in that dtype, replace() does not wrap it twice.
    own = ProbeTask(name="mlp", model=lambda: nn.Linear(4, 2), batch=lambda m: torch.zeros(m, 4, dtype=torch.bfloat16))
    held = dataclasses.replace(own, weights_dtype="fp16")
    assert held.model().weight.dtype == torch.float16 and held.tags == {"weights_dtype": "fp16"}
    back = dataclasses.replace(held, weights_dtype="fp32")
    assert back.model().weight.dtype == torch.float32 and back.tags == {}


def _peft_model(model: nn.Module, config: Any) -> nn.Module:
    """peft's get_peft_model as a script calls it (peft asks transformers' deprecated is_gradient_checkpointing)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        return peft.get_peft_model(model, config)  # type: ignore[no-any-return]


def _ordinary(kind: str, directory: Path) -> Callable[[], nn.Module]:
    config = transformers.AutoConfig.from_pretrained(directory)
    if kind == "lora":
        return lambda: _peft_model(
            transformers.AutoModelForCausalLM.from_config(config),
            peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"),
        )
    if kind == "bf16":
        return lambda: transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return lambda: transformers.AutoModelForSequenceClassification.from_config(config)


# The Python numbers autograd keeps outside the meter's view (below): 8 bytes per LoRA-adapted module.
KEPT_NUMBERS_BYTES = {"lora": CONFIGS["llama"]["num_hidden_layers"] * 2 * 8, "bf16": 0, "classifier": 0}
# kind -> (spec options, config writer, budget): budgets where 2 <= m_max < 64 at L = 16.
CASES: dict[str, tuple[dict[str, Any], Callable[[Path], Path], int]] = {
    "lora": ({"lora_rank": 4}, lambda d: write_config(d, "llama"), MiB),
    "bf16": ({"weights_dtype": "bf16"}, lambda d: write_config(d, "qwen2", tie_word_embeddings=True), MiB),
    "classifier": ({}, lambda d: write_head_config(d, "bert-seq-cls"), MiB + MiB // 4),
}


@pytest.mark.parametrize(
    ("kind", "strategy", "world_size"),
    [("lora", "ddp", 1), ("bf16", "ddp", 1), ("classifier", "ddp", 1), ("lora", "fsdp", 2)],
)
def test_fine_tuning_tasks_are_exact_against_the_allocator_at_m_max_and_past_it(
    tmp_path: Path, kind: str, strategy: str, world_size: int
) -> None:
    options, write, budget = CASES[kind]
    directory = write(tmp_path)
    task = load_task(with_options(f"hf:{directory}", **options)).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=budget, target_batch=64, strategy=strategy, world_size=world_size)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    limit = int(budget * (1 - config.headroom))
    ordinary = _ordinary(kind, directory)
    at_max = allocator_peak_bytes(task, m_max, world_size=world_size, model=ordinary)
    past_max = allocator_peak_bytes(task, m_max + 1, world_size=world_size, model=ordinary)
    assert at_max <= limit < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    # Byte for byte, but for what the meter cannot see (as in tests/autotune/test_tied.py): peft's LoRA
    # layer computes `lora_B(lora_A(x)) * scaling` with scaling a Python float, which C++ wraps into an
    # 8-byte CPU tensor below the dispatch mode and MulBackward0 keeps for backward: one per adapted
    # module (per layer q_proj, v_proj: 16 bytes), at every m. On CUDA it is host memory.
    assert at_max - peaks[m_max] == past_max - peaks[m_max + 1] == KEPT_NUMBERS_BYTES[kind]
    estimated = estimate(
        task,
        EstimateConfig.of(
            budget_bytes=budget, device_kind="cpu", target_batch=64, strategy=strategy, world_size=world_size
        ),
    )
    assert estimated.max_micro_batch == m_max
    assert estimated.peak_at(m_max) == measured.peak_at(m_max)
    assert estimated.fingerprint == measured.fingerprint


def test_the_options_travel_in_the_spec_and_enter_the_fingerprint(tmp_path: Path) -> None:
    llama = f"hf:{write_config(tmp_path, 'llama')}"
    specs = [
        llama,
        with_options(llama, lora_rank=4),
        with_options(llama, lora_rank=8),
        with_options(llama, lora_rank=4, lora_dropout=0.1),
        with_options(llama, lora_rank=4, lora_alpha=32, lora_targets="q_proj,k_proj,v_proj,o_proj"),
        with_options(llama, weights_dtype="bf16"),
        with_options(llama, weights_dtype="bf16", lora_rank=4),
        with_options(f"hf:{write_head_config(tmp_path, 'llama-seq-cls')}", hf_class="LlamaForTokenClassification"),
    ]
    assert specs[4].endswith("?lora_rank=4&lora_alpha=32.0&lora_targets=q_proj%2Ck_proj%2Cv_proj%2Co_proj")
    here = {spec: (load_task(spec).name, task_fingerprint(load_task(spec).at_length(SEQ_LEN))) for spec in specs}
    assert len({fingerprint for _, fingerprint in here.values()}) == len(specs)
    code = (
        "import json, sys\n"
        "from autotune.tasks.load import load_task\n"
        "from autotune.tasks.fingerprint import task_fingerprint\n"
        f"specs = {specs!r}\n"
        f"done = {{s: [load_task(s).name, task_fingerprint(load_task(s).at_length({SEQ_LEN}))] for s in specs}}\n"
        "print(json.dumps(done))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert {spec: tuple(value) for spec, value in json.loads(done.stdout).items()} == here


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> str:
    output = tmp_path / "profile.json"
    assert main([*argv, "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert not output.exists()  # nothing stored
    assert len(err.splitlines()) == 1 and err.startswith("autotune: error: ")
    return err


@pytest.mark.parametrize(
    ("setup", "flags", "message"),
    [
        ("file", ["--lora-rank", "4"], "--lora-rank apply to hf: tasks; 'examples/mlp.py:task' is a ProbeTask"),
        ("file", ["--weights-dtype", "bf16"], "--weights-dtype apply to hf: tasks"),
        ("llama", ["--lora-rank", "4", "--lora-targets", "nope"], "--lora-targets nope: Target modules {'nope'} not"),
        ("llama", ["--lora-alpha", "8"], "--lora-alpha needs --lora-rank R"),
        ("vit", ["--lora-rank", "4"], "peft has no default targets for model type 'vit': name them with"),
        ("llama", ["--weights-dtype", "fp16", "--precision", "fp16"], "GradScaler cannot unscale fp16 gradients"),
        ("unknown", [], "architectures NoSuchModelForCausalLM: transformers knows no model class"),
        ("llama", ["--hf-class", "LlamaModel"], "--hf-class LlamaModel: autotune cannot batch LlamaModel: it batches"),
        ("nopad", [], "finds each sequence's last token by the config's pad_token_id, which is unset"),
    ],
)
def test_bad_fine_tuning_input_is_one_line_exit_2_nothing_stored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, flags: list[str], message: str
) -> None:
    spec = {
        "file": lambda: "examples/mlp.py:task",
        "llama": lambda: f"hf:{write_config(tmp_path, 'llama')}",
        "vit": lambda: f"hf:{write_head_config(tmp_path, 'vit')}",
        "unknown": lambda: f"hf:{write_config(tmp_path, 'llama', architectures=['NoSuchModelForCausalLM'])}",
        "nopad": lambda: f"hf:{write_head_config(tmp_path, 'llama-seq-cls', pad_token_id=None)}",
    }[setup]()
    argv = ["estimate", spec, "--device-kind", "cpu", "--budget", "8MiB", "--seq-len", str(SEQ_LEN), *flags]
    if setup in ("file", "vit"):
        argv.remove("--seq-len"), argv.remove(str(SEQ_LEN))
    assert message in _refused(argv, capsys, tmp_path)


def test_lora_without_peft_installed_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "peft", None)  # import peft raises ImportError
    spec = f"hf:{write_config(tmp_path, 'llama')}"
    argv = ["estimate", spec, "--device-kind", "cpu", "--budget", "8MiB", "--seq-len", "16", "--lora-rank", "4"]
    assert "--lora-rank needs peft: pip install 'autotune[hf]'" in _refused(argv, capsys, tmp_path)


def test_a_card_without_bf16_refuses_bf16_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # CPUs hold all three dtypes (torch has bf16 and fp16 kernels for them): no refusal there.
    assert all(weights_dtype_refusal(d, torch.device("cpu")) is None for d in ("fp32", "bf16", "fp16"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100-SXM2-16GB")
    refusal = weights_dtype_refusal("bf16", torch.device("cuda", 0))
    assert refusal == (
        "--weights-dtype bf16: Tesla V100-SXM2-16GB (compute capability 7.0) has no bf16 arithmetic; "
        "use --weights-dtype fp16 or fp32"
    )
    assert weights_dtype_refusal("fp16", torch.device("cuda", 0)) is None


def test_the_cli_writes_the_options_into_the_profile_and_the_datasheet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"hf:{write_config(tmp_path, 'llama')}"
    flags = ["--lora-rank", "4", "--weights-dtype", "bf16", "--seq-len", "16", "--max-seq-len", "16"]
    flags += ["--budget", "4MiB", "--json"]
    assert main(["estimate", spec, "--device-kind", "cpu", *flags]) == 0
    captured = capsys.readouterr()
    (profile,) = json.loads(captured.out)
    assert profile["task"] == "llama-26K-lora4-bf16"
    assert profile["tags"]["weights_dtype"] == "bf16" and profile["tags"]["lora_rank"] == 4
    assert "  weights          bf16 (gradients and optimizer state in it too)" in captured.err
    assert "  lora             rank 4, alpha 8, dropout 0.0, targets q_proj,v_proj (base frozen)" in captured.err
