"""QLoRA on hf: specs (issue 33, item 3): ``--quantize nf4`` with LoRA, checked against the CPU allocator's own
count of the model built the ordinary way: a checkpoint loaded by transformers' ``from_pretrained`` with
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)``,
peft's ``prepare_model_for_kbit_training`` and ``get_peft_model``, an ordinary training loop
(tests/autotune/_allocator_truth.py)."""

from __future__ import annotations

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
from autotune.cli.report import datasheet
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.hf import with_options
from autotune.tasks.load import load_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import CONFIGS, SEQ_LEN, write_config

peft = pytest.importorskip("peft", reason="the hf extra (peft) is not installed")
bnb = pytest.importorskip("bitsandbytes", reason="the hf extra (bitsandbytes) is not installed")

MiB = 1 << 20
# The tiny Llama's budget where 2 <= m_max < 64 at L = SEQ_LEN.
BUDGET = MiB
# peft's LoRA layer multiplies by a Python float, which autograd keeps as an 8-byte CPU tensor made below the
# probe's meter (tests/autotune/test_finetune.py says it whole): per layer q_proj, v_proj, at every m.
KEPT_NUMBERS_BYTES = CONFIGS["llama"]["num_hidden_layers"] * 2 * 8


def _checkpoint(directory: Path) -> Path:
    """The config's model saved as a checkpoint (random bf16 weights), as a user's download would be."""
    config = transformers.AutoConfig.from_pretrained(directory)
    where = directory / "checkpoint"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(where)
    return where


def _ordinary(checkpoint: Path, *, double_quant: bool = False) -> Callable[[], nn.Module]:
    """QLoRA as the PEFT docs write it, no project code."""

    def build() -> nn.Module:
        quantization = transformers.BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_use_double_quant=double_quant,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = transformers.AutoModelForCausalLM.from_pretrained(
                checkpoint, quantization_config=quantization, dtype=torch.bfloat16, device_map="cpu"
            )
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
            return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, task_type="CAUSAL_LM"))  # type: ignore[no-any-return]

    return build


def _tensors(model: nn.Module) -> list[tuple[str, tuple[int, ...], str, bool, str]]:
    return [
        (name, tuple(p.shape), str(p.dtype), p.requires_grad, type(p).__name__) for name, p in model.named_parameters()
    ]


def _spec(directory: Path, quantize: str = "nf4", **options: Any) -> str:
    return with_options(f"hf:{directory}", lora_rank=4, weights_dtype="bf16", quantize=quantize, **options)


@pytest.mark.parametrize("quantize", ["nf4", "nf4-dq"])
def test_the_base_is_held_as_from_pretrained_holds_it(tmp_path: Path, quantize: str) -> None:
    directory = write_config(tmp_path, "llama")
    task = load_task(_spec(directory, quantize)).at_length(SEQ_LEN)
    assert task.name == f"llama-26K-lora4-{quantize}-bf16" and task.tags["quantize"] == quantize
    ordinary = _ordinary(_checkpoint(directory), double_quant=quantize == "nf4-dq")()
    built = task.model()
    # Every parameter: name, shape, dtype (packed uint8 for the 4-bit linears, fp32 for the embedding and norms
    # that peft's preparation cast up), trainable or not, and its class (bitsandbytes' Params4bit).
    assert _tensors(built) == _tensors(ordinary)
    kinds = {type(m).__name__ for m in built.modules()}
    assert {"Linear4bit", "LoraLayer"} & kinds and "lm_head" not in {
        name.rsplit(".", 1)[-1] for name, m in built.named_modules() if isinstance(m, bnb.nn.Linear4bit)
    }
    q_proj = built.base_model.model.model.layers[0].self_attn.q_proj.base_layer  # type: ignore[union-attr]
    assert isinstance(q_proj, bnb.nn.Linear4bit) and q_proj.quant_state.quant_type == "nf4"
    assert q_proj.quant_state.nested == (quantize == "nf4-dq")
    # On meta, bitsandbytes' own meta kernels give the packed weight its shape; nothing is allocated.
    with torch.device("meta"):
        on_meta = task.model()
    assert _tensors(on_meta) == _tensors(ordinary)


@pytest.mark.parametrize("quantize", ["nf4", "nf4-dq"])
def test_qlora_is_exact_against_the_allocator_at_m_max_and_past_it(tmp_path: Path, quantize: str) -> None:
    directory = write_config(tmp_path, "llama")
    task = load_task(_spec(directory, quantize)).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, target_batch=64, presearch=False)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    limit = int(BUDGET * (1 - config.headroom))
    ordinary = _ordinary(_checkpoint(directory), double_quant=quantize == "nf4-dq")
    at_max = allocator_peak_bytes(task, m_max, model=ordinary)
    past_max = allocator_peak_bytes(task, m_max + 1, model=ordinary)
    assert at_max <= limit < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    assert at_max - peaks[m_max] == past_max - peaks[m_max + 1] == KEPT_NUMBERS_BYTES
    # The estimate's fake trials run through bitsandbytes' fake kernels: the same figure here.
    estimated = estimate(task, EstimateConfig.of(budget_bytes=BUDGET, device_kind="cpu", target_batch=64))
    assert estimated.max_micro_batch == m_max
    assert estimated.peak_at(m_max) == measured.peak_at(m_max)
    assert estimated.fingerprint == measured.fingerprint
    assert any("bitsandbytes" in warning for warning in estimated.warnings)
    sheet = datasheet(estimated).splitlines()
    said = f"  quantize         {quantize}: linear layers in 4-bit (bitsandbytes), embeddings and norms fp32 "
    assert said + "(peft's k-bit preparation)" in sheet
    assert "  weights          bf16 (the dtype the 4-bit base is quantized from)" in sheet


def test_quantize_travels_in_the_spec_and_enters_the_fingerprint(tmp_path: Path) -> None:
    directory = write_config(tmp_path, "llama")
    spec = _spec(directory)
    assert spec.endswith("?lora_rank=4&weights_dtype=bf16&quantize=nf4")
    lora = load_task(with_options(f"hf:{directory}", lora_rank=4, weights_dtype="bf16")).at_length(SEQ_LEN)
    qlora = load_task(spec).at_length(SEQ_LEN)
    assert "quantize" not in lora.tags and qlora.tags["quantize"] == "nf4"
    assert task_fingerprint(qlora) != task_fingerprint(lora)
    assert task_fingerprint(qlora) == task_fingerprint(load_task(spec).at_length(SEQ_LEN))


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], tmp_path: Path) -> str:
    output = tmp_path / "profile.json"
    try:
        code = main([*argv, "--output", str(output)])
    except SystemExit as exc:  # the parser's own refusal (a choice that is not one)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert not output.exists()  # nothing stored
    assert len(err.splitlines()) == 1 and err.startswith("autotune: error: ")
    return err


@pytest.mark.parametrize(
    ("setup", "flags", "message"),
    [
        ("llama", ["--quantize", "nf4"], "--quantize nf4 without --lora-rank: a 4-bit base is frozen"),
        ("file", ["--quantize", "nf4", "--lora-rank", "4"], "--lora-rank and --quantize apply to hf: tasks;"),
        ("llama", ["--quantize", "fp4", "--lora-rank", "4"], "argument --quantize: invalid choice: 'fp4'"),
        ("spec", [], "--quantize 'fp4': one of nf4, nf4-dq"),
        ("spec-nolora", [], "--quantize nf4 without --lora-rank"),
        (
            "llama",
            ["--quantize", "nf4", "--lora-rank", "4", "--strategy", "fsdp", "--world-size", "2"],
            "--quantize nf4 with --strategy fsdp",
        ),
    ],
)
def test_bad_quantize_input_is_one_line_and_stores_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, flags: list[str], message: str
) -> None:
    llama = f"hf:{write_config(tmp_path, 'llama')}"
    spec = {
        "llama": llama,
        "file": "examples/mlp.py:task",
        "spec": f"{llama}?lora_rank=4&quantize=fp4",
        "spec-nolora": f"{llama}?quantize=nf4",
    }[setup]
    argv = ["estimate", spec, "--device-kind", "cpu", "--budget", "8MiB", *flags]
    if setup != "file":
        argv += ["--seq-len", str(SEQ_LEN)]
    assert message in _refused(argv, capsys, tmp_path)


def test_quantize_without_bitsandbytes_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import bitsandbytes raises ImportError
    spec = f"hf:{write_config(tmp_path, 'llama')}"
    argv = ["estimate", spec, "--device-kind", "cpu", "--budget", "8MiB", "--seq-len", "16"]
    argv += ["--lora-rank", "4", "--quantize", "nf4"]
    assert "--quantize nf4 needs bitsandbytes: pip install 'autotune[hf]'" in _refused(argv, capsys, tmp_path)


def test_gemm_4bit_dequantized_weight_is_a_kernel_temporary_on_a_card() -> None:
    from autotune.measure.meters.temporaries import KernelFacts, op_temporaries

    with torch.device("meta"):
        inputs = torch.empty(2048, 4096, dtype=torch.bfloat16)
        weight = torch.empty(14336, 4096, dtype=torch.bfloat16)
    packed, state = bnb.functional.quantize_4bit(weight, quant_type="nf4")  # bitsandbytes' meta kernel
    gemm_4bit = torch.ops.bitsandbytes.gemm_4bit.default
    facts = KernelFacts(capability=(8, 9), sm_count=128)  # an RTX 4090
    dequantized = [("dequantized_weight", 14336 * 4096 * 2), ("dequantized_weight", -1)]
    # Past 1536 tokens bitsandbytes' CUDA backend dequantizes the weight into the input's dtype, then F.linear.
    assert op_temporaries(gemm_4bit, (inputs, packed, list(state.shape), state.absmax, 64, "nf4"), facts) == dequantized
    if "bitsandbytes.backends.cuda.ops" not in sys.modules:
        # Below it, without bitsandbytes' CUDA backend to ask (a CPU build), the temporary is counted: a bound.
        args = (inputs[:512], packed, list(state.shape), state.absmax, 64, "nf4")
        assert op_temporaries(gemm_4bit, args, facts) == dequantized
    # Every other op keeps its own rule or none.
    assert op_temporaries(torch.ops.aten.mm.default, (inputs, inputs.t()), facts) == []


def test_the_library_refuses_a_4bit_base_under_fsdp(tmp_path: Path) -> None:
    from autotune.core.errors import AutotuneError

    task = load_task(_spec(write_config(tmp_path, "llama"))).at_length(SEQ_LEN)
    config = EstimateConfig.of(budget_bytes=BUDGET, device_kind="cpu", strategy="fsdp", world_size=2)
    with pytest.raises(AutotuneError, match=r"^--quantize nf4 with --strategy fsdp: sharding a 4-bit base fails"):
        estimate(task, config)


def test_the_limit_is_the_libraries_own() -> None:
    """The refusal's reason, run the ordinary way: bitsandbytes' Linear4bit with bf16 quant storage (the FSDP-QLoRA
    recipe's), sharded by FSDP2 over 2 ranks of torch's fake process group, loses its Params4bit and quant_state
    and cannot run its forward. Where a release fixes it, this fails: measure the composition then."""
    import bitsandbytes as bnb
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    linear = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", quant_storage=torch.bfloat16)
    linear.weight = bnb.nn.Params4bit(
        torch.randn(64, 64), requires_grad=False, quant_type="nf4", quant_storage=torch.bfloat16
    )
    model = nn.Sequential(linear.to("cpu"), nn.Linear(64, 64))
    assert type(model[0].weight).__name__ == "Params4bit" and model[0].weight.quant_state is not None
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert type(model[0].weight).__name__ == "DTensor"
        with pytest.raises(ValueError, match="quant_state is required"):
            model(torch.randn(4, 64))
    finally:
        dist.destroy_process_group()
