"""The job a recipe describes and the same job given as flags are the same setup: same fingerprint, same m_max, same
plan, measured by real trials on the CPU (fake process groups for the mesh). docs/recipe-files.md's three examples are
held so by tests/e2e/test_recipe_files_doc.py; here, the combinations they leave out: LoRA under FSDP x tp from an
Axolotl config, QLoRA with 8-bit Adam from a TRL config. The flags are written by hand from the tools' own rules
(autotune/cli/recipes/*.py cite them), not derived by the reader under test.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from autotune.cli import main

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "examples" / "configs" / "tiny-llama")
MEASURED = ["--device", "cpu", "--no-presearch", "--no-breakdown", "--no-throughput", "--json"]


def _profile(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    profiles = json.loads(out)
    (profile,) = profiles
    return dict(profile)


def _same_setup(recipe: list[str], flags: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    by_recipe = _profile(["probe", *recipe, *MEASURED], capsys)
    by_flags = _profile(["probe", *flags, *MEASURED], capsys)
    assert by_recipe["fingerprint"] == by_flags["fingerprint"]
    assert by_recipe["max_micro_batch"] == by_flags["max_micro_batch"]
    assert by_recipe["plan"] == by_flags["plan"]
    plan = by_recipe["plan"]
    assert isinstance(plan, dict) and plan["exact"]
    assert isinstance(by_recipe["max_micro_batch"], int) and by_recipe["max_micro_batch"] >= 2  # a search, not a floor
    return by_recipe


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # fsdp x tp's root returns the gathered logits, a view
def test_axolotl_lora_under_fsdp_and_tp(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "lora-fsdp-tp.yml"
    recipe.write_text(
        textwrap.dedent(f"""
        base_model: {MODEL}
        datasets:
          - path: tatsu-lab/alpaca
            type: alpaca
        sequence_len: 64
        adapter: lora
        lora_r: 8
        lora_alpha: 16
        lora_target_modules: [q_proj, v_proj]
        micro_batch_size: 2
        gradient_accumulation_steps: 2
        bf16: true
        gradient_checkpointing: true
        optimizer: adamw_torch
        fsdp_version: 2
        fsdp_config:
          offload_params: false
          transformer_layer_cls_to_wrap: LlamaDecoderLayer
          state_dict_type: FULL_STATE_DICT
        dp_shard_size: 2
        tensor_parallel_size: 2
        learning_rate: 0.0002
        """)
    )
    # Axolotl: bf16 loads bf16 weights and autocasts (accelerate's way under FSDP2); W = dp_shard x tp = 4, D = 2;
    # the global batch 2 x 2 x 2.
    flags = [
        f"hf:{MODEL}", "--seq-len", "64", "--max-seq-len", "64", "--lora-rank", "8", "--lora-alpha", "16",
        "--lora-targets", "q_proj,v_proj", "--weights-dtype", "bf16", "--precision", "bf16-autocast", "--ac", "full",
        "--optimizer", "AdamW", "--strategy", "fsdp", "--world-size", "4", "--tp", "2", "--target-batch", "8",
        "--plan", "divisor", "--budget", "1MiB",
    ]  # fmt: skip
    profile = _same_setup(["--recipe", str(recipe), "--budget", "1MiB"], flags, capsys)
    assert profile["strategy"] == "fsdp" and profile["world_size"] == 4 and profile["precision"] == "bf16-autocast"


def test_trl_qlora_with_eight_bit_adam(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "sft-qlora.json"
    recipe.write_text(
        json.dumps(
            {
                "model_name_or_path": MODEL,
                "dtype": "bfloat16",
                "use_peft": True,
                "lora_r": 8,
                "lora_alpha": 16,
                "lora_dropout": 0.0,
                "load_in_4bit": True,
                "bnb_4bit_quant_type": "nf4",
                "use_bnb_nested_quant": False,
                "output_dir": "out",
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 4,
                "optim": "adamw_bnb_8bit",
                "bf16": True,
                "gradient_checkpointing": True,
                "max_length": 64,
                "packing": True,
                "loss_type": "nll",
                "learning_rate": 2e-4,
            },
            indent=2,
        )
    )
    # TRL: LoRA by ModelConfig (its default targets: peft's own), NF4 without nested quantization, the Trainer's
    # adamw_bnb_8bit (bitsandbytes' 8-bit AdamW), activation checkpointing, bf16 AMP; one rank: 4 x 4.
    flags = [
        f"hf:{MODEL}", "--seq-len", "64", "--max-seq-len", "64", "--lora-rank", "8", "--lora-alpha", "16",
        "--quantize", "nf4", "--weights-dtype", "bf16", "--precision", "bf16", "--ac", "full",
        "--optimizer", "adamw8bit", "--target-batch", "16", "--plan", "divisor", "--budget", "2MiB",
    ]  # fmt: skip
    profile = _same_setup(["--recipe", str(recipe), "--budget", "2MiB"], flags, capsys)
    assert profile["tags"]["quantize"] == "nf4"  # type: ignore[index]
