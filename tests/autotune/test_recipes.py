"""Recipe files read as the job their tool runs, refused in one line where autotune cannot express a key, and written
back with only their batch keys changed (autotune/cli/recipes/; docs/recipe-files.md).

These tests run no trial: the readers, the writer and the CLI's refusals. That a recipe and its flags measure the
same (fingerprint, m_max) is tests/e2e/test_recipe_files_doc.py's (the page's three examples) and
tests/autotune/test_recipe_truths.py's (the combinations the examples leave out).
"""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.cli.parser import build_parser
from autotune.cli.probe import setup_of
from autotune.cli.recipes.apply import apply_recipe
from autotune.cli.recipes.job import RecipeError
from autotune.cli.recipes.read import parse_recipe, read_recipe
from autotune.cli.recipes.reading import ReadContext
from autotune.cli.recipes.write import recipe_changes, rewrite_recipe

REPO = Path(__file__).resolve().parents[2]
MODEL = str(REPO / "examples" / "configs" / "tiny-llama")
EXAMPLES = REPO / "examples" / "recipes"
# Each example and the flags it equals (docs/recipe-files.md shows the same lines).
EXPECTED = {
    "axolotl-qlora.yml": "hf:examples/configs/tiny-llama --seq-len 64 --max-seq-len 64 --weights-dtype bf16 "
    "--precision bf16 --quantize nf4-dq --lora-rank 8 --lora-alpha 16 --lora-dropout 0.05 --lora-targets all-linear "
    "--ac full --optimizer adamw8bit --target-batch 16 --plan divisor",
    "trl-sft-lora-fsdp-tp.json": "hf:examples/configs/tiny-llama --seq-len 64 --max-seq-len 64 --tp 2 --strategy fsdp "
    "--weights-dtype bf16 --precision bf16-autocast --lora-rank 8 --lora-alpha 16 --lora-targets q_proj,v_proj --ac "
    "full --optimizer AdamW:fused=true --world-size 4 --target-batch 16 --plan divisor",
    "torchtitan-fsdp-tp.toml": "hf:examples/configs/tiny-llama --seq-len 64 --max-seq-len 64 --tp 2 --tp-plan "
    "torchtitan --ac op --optimizer AdamW:fused=true --world-size 4 --strategy fsdp --precision bf16 --target-batch "
    "16 --plan divisor",
}


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)  # the examples name their model relative to the repository, as their tools read paths


def _args(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    apply_recipe(args, argv)
    return args


def _setup(args: argparse.Namespace) -> dict[str, object]:
    """Everything the command makes of its flags: the ProbeConfig's fields, the task's spec, the policies, lengths."""
    from autotune.cli.common import task_spec

    return {
        **setup_of(args),
        "spec": task_spec(args.task, args),
        "ac": args.ac,
        "seq_len": args.seq_len,
        "max_seq_len": args.max_seq_len,
    }


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_example_is_the_job_of_its_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = read_recipe(EXAMPLES / name, ReadContext())
    assert job.command("probe") == f"autotune probe {EXPECTED[name]}"
    measured = ["--device", "cpu", "--budget", "1MiB"]
    from_recipe = _args(["probe", "--recipe", f"examples/recipes/{name}", *measured])
    from_flags = _args(["probe", *shlex.split(EXPECTED[name]), *measured])
    assert _setup(from_recipe) == _setup(from_flags)
    assert f"recipe examples/recipes/{name} ({job.kind}) is the job of: autotune probe {EXPECTED[name]}" in (
        capsys.readouterr().err
    )


def test_the_batch_is_the_files_global_batch() -> None:
    axolotl = read_recipe(EXAMPLES / "axolotl-qlora.yml", ReadContext())
    assert (axolotl.batch.micro_batch, axolotl.batch.accumulation_steps, axolotl.batch.data_parallel) == (2, 8, 1)
    # On 4 ranks the launcher gives (--world-size 4), the same file makes 4 times the batch, as Axolotl counts it.
    on_four = read_recipe(EXAMPLES / "axolotl-qlora.yml", ReadContext(world_size=4, given=frozenset({"--world-size"})))
    assert on_four.batch.global_batch == 2 * 8 * 4
    trainer = read_recipe(EXAMPLES / "trl-sft-lora-fsdp-tp.json", ReadContext())
    assert (trainer.batch.micro_batch, trainer.batch.accumulation_steps, trainer.batch.data_parallel) == (2, 4, 2)
    titan = read_recipe(EXAMPLES / "torchtitan-fsdp-tp.toml", ReadContext())
    assert (titan.batch.micro_batch, titan.batch.accumulation_steps, titan.batch.data_parallel) == (2, 4, 2)


def test_the_tools_defaults_apply_where_the_file_is_silent(tmp_path: Path) -> None:
    titan = _write(
        tmp_path,
        "titan.toml",
        f"""
        [model]
        hf_assets_path = "{MODEL}"
        [training]
        local_batch_size = 2
        seq_len = 64
        [parallelism]
        data_parallel_shard_degree = 2
        """,
    )
    words = read_recipe(titan, ReadContext()).words()[1:]
    # job_config.py v0.2.2: selective AC every 2nd layer, fused AdamW, bf16 params under FSDP, global = local x dp.
    assert words == [
        *("--seq-len", "64", "--max-seq-len", "64", "--ac", "every-2", "--optimizer", "AdamW:fused=true"),
        *("--world-size", "2", "--strategy", "fsdp", "--precision", "bf16", "--target-batch", "4", "--plan", "divisor"),
    ]
    axolotl = _write(tmp_path, "a.yml", f"base_model: {MODEL}\n")
    job = read_recipe(axolotl, ReadContext())
    # schemas: sequence_len 512, micro_batch_size 1, bf16 auto, optimizer adamw_torch_fused.
    assert job.words()[1:] == [
        *("--seq-len", "512", "--max-seq-len", "512", "--weights-dtype", "bf16", "--precision", "bf16"),
        *("--optimizer", "AdamW:fused=true", "--target-batch", "1", "--plan", "divisor"),
    ]
    assert any(note.startswith("bf16: auto read as bf16") for note in job.notes)
    # An SFTConfig checkpoints by default (TRL's default); a bare TrainingArguments names no length.
    sft = _write(tmp_path, "sft.json", json.dumps({"model_name_or_path": MODEL, "max_length": 32, "loss_type": "nll"}))
    assert "--ac" in read_recipe(sft, ReadContext()).words()
    bare = _write(tmp_path, "args.json", json.dumps({"model_name_or_path": MODEL}))
    with pytest.raises(RecipeError, match="give --seq-len L"):
        read_recipe(bare, ReadContext())
    assert "--seq-len" not in read_recipe(bare, ReadContext(given=frozenset({"--seq-len"}))).words()


def test_torchtitans_newer_form_counts_tokens(tmp_path: Path) -> None:
    titan = _write(
        tmp_path,
        "titan.toml",
        f"""
        [model]
        hf_assets_path = "{MODEL}"
        [training]
        num_tokens_per_microbatch_per_dp_rank = 256  # 4 sequences of 64
        num_tokens_per_train_step = 2048
        max_context_length = 64
        [parallelism]
        data_parallel_shard_degree = 2
        [activation_checkpoint]
        mode = "full"
        """,
    )
    job = read_recipe(titan, ReadContext())
    assert (job.batch.micro_batch, job.batch.accumulation_steps, job.batch.data_parallel) == (4, 4, 2)
    assert job.batch.global_batch == 2048 // 64 and job.batch.tokens_per_sequence == 64
    uneven = titan.read_text().replace("= 256", "= 250")
    with pytest.raises(RecipeError, match="num_tokens_per_microbatch_per_dp_rank 250 is not a whole number"):
        read_recipe(_write(tmp_path, "uneven.toml", uneven), ReadContext())


# (file name, text, what the one line says). Each a key that changes memory in a way autotune cannot express yet,
# or one it cannot place.
REFUSED = [
    ("a.yml", "base_model: {model}\ndeepspeed: deepspeed_configs/zero3.json\n", "deepspeed is set: DeepSpeed ZeRO"),
    ("a.yml", "base_model: {model}\nfsdp_version: 1\nfsdp_config: {{offload_params: true}}\n", "fsdp_version 1"),
    ("a.yml", "base_model: {model}\nadapter: lora\nload_in_8bit: true\nlora_r: 8\n", "load_in_8bit"),
    ("a.yml", "base_model: {model}\noptimizer: lion_8bit\n", "optimizer 'lion_8bit' is an optimizer autotune does"),
    ("a.yml", "base_model: {model}\nsome_new_key: 3\n", "some_new_key is not a key of an Axolotl config"),
    ("a.yml", "base_model: meta-llama/Llama-3.1-8B\n", "base_model 'meta-llama/Llama-3.1-8B' in"),
    ("a.yml", "base_model: {model}\nplugins: [axolotl.integrations.liger.LigerPlugin]\n", "plugins is set"),
    ("t.json", '{{"model_name_or_path": "{model}", "max_length": 64}}', "loss_type 'chunked_nll'"),
    ("t.json", '{{"model_name_or_path": "{model}", "max_length": 64, "loss_type": "nll", "fsdp": "full_shard",'
     ' "fsdp_config": {{"version": 1}}}}', "fsdp_config.version 1"),
    ("t.json", '{{"model_name_or_path": "{model}", "max_length": 64, "loss_type": "nll", "use_liger_kernel": true}}',
     "use_liger_kernel is set"),
    ("t.json", '{{"model_name_or_path": "{model}", "max_length": 64, "loss_type": "nll", "parallelism_config": '
     '{{"dp_replicate_size": 2, "dp_shard_size": 2}}}}', "HSDP"),
    ("t.toml", '[model]\nhf_assets_path = "{model}"\nconverters = ["float8"]\n', "[model] converters is set: float8"),
    ("t.toml", '[model]\nname = "flux"\nhf_assets_path = "{model}"\n', "[model] name 'flux'"),
    ("t.toml", '[model]\nhf_assets_path = "{model}"\n[parallelism]\nexpert_parallel_degree = 2\n', "expert"),
    ("t.toml", '[model]\nhf_assets_path = "{model}"\n[mystery]\nx = 1\n', "mystery is not a key of a torchtitan"),
    ("t.txt", "anything", "not a recipe autotune reads"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "text", "said"), REFUSED)
def test_a_key_autotune_cannot_express_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str, said: str
) -> None:
    path = _write(tmp_path, name, text.format(model=MODEL))
    code = main(["estimate", "--recipe", str(path), "--device-kind", "cpu", "--budget", "1MiB"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("autotune: error: ") and said in err, err
    assert str(path) in err or "--recipe" in err
    assert "trial m=" not in err


def test_task_or_recipe_is_needed(capsys: pytest.CaptureFixture[str]) -> None:
    recipe = str(EXAMPLES / "axolotl-qlora.yml")
    for argv, said in (
        (["probe", "--device", "cpu", "--budget", "1MiB"], "probe needs TASK"),
        (["estimate", "hf:examples/configs/tiny-llama", "--recipe", recipe, "--budget", "1MiB"], "not both"),
        (["probe", "examples/mlp.py:task", "--write-recipe", "x.yml", "--budget", "1MiB"], "goes with --recipe"),
        (["probe", "--recipe", recipe, "--ac", "none,full", "--write-recipe", "x.yml"], "one --ac policy"),
    ):
        assert main(argv) == 2
        assert said in capsys.readouterr().err


def test_flags_beside_the_file_override_it_and_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    args = _args(["probe", "--recipe", "examples/recipes/torchtitan-fsdp-tp.toml", "--ac", "none", "--world-size", "8"])
    err = capsys.readouterr().err
    assert args.ac == ["none"] and args.world_size == 8 and args.tp == 2
    assert "--ac given beside the file overrides its activation_checkpoint.mode and " in err
    assert "--world-size given beside the file overrides its parallelism (--world-size 4)" in err
    # The file's global batch is explicit: 16 on any number of ranks.
    assert args.target_batch == 16
    # --model replaces the file's model; --optimizer replaces its optimizer (not read, so not refused).
    other = str(REPO / "examples" / "configs" / "tiny-llama-one-layer.json")
    args = _args(["probe", "--recipe", "examples/recipes/axolotl-qlora.yml", "--model", other, "--optimizer", "SGD"])
    assert args.task == f"hf:{other}" and args.optimizer == "SGD"
    # One --seq-len is the file's length too; --target-tokens its target.
    args = _args(["probe", "--recipe", "examples/recipes/axolotl-qlora.yml", "--seq-len", "128", "--target-tokens",
                  "4096"])  # fmt: skip
    assert (args.seq_len, args.max_seq_len, args.target_batch, args.target_tokens) == ([128], None, None, 4096)
    err = capsys.readouterr().err
    assert "--seq-len given beside the file overrides its sequence_len (--max-seq-len 64)" in err
    assert "--target-tokens given beside the file overrides its micro_batch_size and gradient_accumulation_steps" in err


def _rewritten(path: Path, micro_batch: int, accumulation_steps: int) -> tuple[str, str]:
    kind, text, data = parse_recipe(path)
    job = read_recipe(path, ReadContext())
    changes = recipe_changes(kind, data, job.batch, micro_batch=micro_batch, accumulation_steps=accumulation_steps)
    return text, rewrite_recipe(path, kind, text, data, changes)


def _changed_lines(before: str, after: str) -> list[tuple[str, str]]:
    old, new = before.splitlines(), after.splitlines()
    assert len(old) == len(new)
    return [(a, b) for a, b in zip(old, new, strict=True) if a != b]


def test_a_written_recipe_changes_its_batch_keys_only(tmp_path: Path) -> None:
    text, written = _rewritten(EXAMPLES / "axolotl-qlora.yml", 4, 4)
    assert _changed_lines(text, written) == [
        (
            "gradient_accumulation_steps: 8  # an update: micro_batch_size x this x the ranks",
            "gradient_accumulation_steps: 4  # an update: micro_batch_size x this x the ranks",
        ),
        ("micro_batch_size: 2", "micro_batch_size: 4"),
    ]
    text, written = _rewritten(EXAMPLES / "trl-sft-lora-fsdp-tp.json", 1, 8)
    assert _changed_lines(text, written) == [
        ('  "per_device_train_batch_size": 2,', '  "per_device_train_batch_size": 1,'),
        ('  "gradient_accumulation_steps": 4,', '  "gradient_accumulation_steps": 8,'),
    ]
    text, written = _rewritten(EXAMPLES / "torchtitan-fsdp-tp.toml", 4, 2)
    assert _changed_lines(text, written) == [("local_batch_size = 2", "local_batch_size = 4")]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_written_recipe_read_back_is_the_same_job_with_the_new_batch(tmp_path: Path, name: str) -> None:
    before = read_recipe(EXAMPLES / name, ReadContext())
    accumulation = before.batch.global_batch // before.batch.data_parallel  # one sequence a micro-batch
    _, written = _rewritten(EXAMPLES / name, 1, accumulation)
    out = tmp_path / name
    out.write_text(written)
    after = read_recipe(out, ReadContext())
    assert after.settings == before.settings and after.model == before.model
    assert (after.batch.micro_batch, after.batch.accumulation_steps) == (1, accumulation)
    assert after.batch.global_batch == before.batch.global_batch == 16


def test_a_key_at_its_default_is_written_beside_the_others(tmp_path: Path) -> None:
    axolotl = _write(tmp_path, "a.yml", f"base_model: {MODEL}  # the model\nmicro_batch_size: 8\nbf16: true\n")
    _, written = _rewritten(axolotl, 2, 4)
    assert (
        written
        == f"base_model: {MODEL}  # the model\nmicro_batch_size: 2\ngradient_accumulation_steps: 4\nbf16: true\n"
    )
    # torchtitan's global_batch_size -1 is one step's batch: with accumulation it is written out, the global kept.
    titan = _write(
        tmp_path,
        "t.toml",
        f"""
        [model]
        hf_assets_path = "{MODEL}"

        [training]
        local_batch_size = 8  # per rank
        seq_len = 64

        [parallelism]
        data_parallel_shard_degree = 2
        """,
    )
    text, written = _rewritten(titan, 2, 4)
    assert written == text.replace(
        "local_batch_size = 8  # per rank\n", "global_batch_size = 16\nlocal_batch_size = 2  # per rank\n"
    )
    assert read_recipe(titan, ReadContext()).batch.global_batch == 16
    # The newer form's tokens: 2 sequences of 64 a micro-batch, the step's tokens kept.
    tokens = _write(
        tmp_path,
        "tokens.toml",
        f"""
        [model]
        hf_assets_path = "{MODEL}"
        [training]
        num_tokens_per_microbatch_per_dp_rank = 512
        max_context_length = 64
        """,
    )
    text, written = _rewritten(tokens, 2, 4)
    assert written == text.replace(
        "num_tokens_per_microbatch_per_dp_rank = 512\n",
        "num_tokens_per_train_step = 512\nnum_tokens_per_microbatch_per_dp_rank = 128\n",
    )


def test_a_pipelines_micro_batch_is_its_own_key(tmp_path: Path) -> None:
    titan = _write(
        tmp_path,
        "pp.toml",
        f"""
        [model]
        hf_assets_path = "{MODEL}"
        [training]
        local_batch_size = 8
        global_batch_size = 16
        seq_len = 64
        [parallelism]
        data_parallel_shard_degree = 2
        pipeline_parallel_degree = 2
        pipeline_parallel_microbatch_size = 2
        pipeline_parallel_schedule = "GPipe"
        """,
    )
    job = read_recipe(titan, ReadContext())
    words = job.words()
    assert words[words.index("--pp") + 1] == "2" and words[words.index("--pp-schedule") + 1] == "gpipe"
    assert words[words.index("--pp-microbatches") + 1] == "4"
    assert (job.batch.micro_batch, job.batch.accumulation_steps, job.batch.data_parallel) == (2, 4, 2)
    # A plan of 4 sequences in 2 micro-batches a step: local 8 = 4 x 2, the global kept.
    text, written = _rewritten(titan, 4, 2)
    assert _changed_lines(text, written) == [
        ("pipeline_parallel_microbatch_size = 2", "pipeline_parallel_microbatch_size = 4")
    ]


def test_all_linear_targets_every_linear_module_but_the_head() -> None:
    from autotune.tasks.hf import load_hf_spec

    task = load_hf_spec(f"hf:{MODEL}?lora_rank=4&lora_targets=all-linear")
    named = load_hf_spec(f"hf:{MODEL}?lora_rank=4&lora_targets=down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj")
    assert task.tags["lora_targets"] == "down_proj,gate_proj,k_proj,o_proj,q_proj,up_proj,v_proj"
    assert task.tags == named.tags
