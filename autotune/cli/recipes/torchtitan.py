"""A torchtitan job config (TOML) read as the job torchtitan runs from it.

The keys and their defaults are torchtitan v0.2.2's (torchtitan/config/job_config.py); how they run is its trainer's
(torchtitan/train.py: the global batch and the accumulation; torchtitan/distributed/utils.py ``maybe_enable_amp``;
torchtitan/distributed/activation_checkpoint.py; torchtitan/distributed/pipeline_parallel.py):

- the model: ``[model] hf_assets_path``, the checkpoint's folder, whose ``config.json`` describes the model
  ``name`` and ``flavor`` select (a folder autotune reads; ``name`` must be that config's family);
- the batch: ``[training] local_batch_size`` (8) sequences per data-parallel rank and step, ``global_batch_size``
  (-1: local x D), accumulation global / (local x D), D = ``data_parallel_replicate_degree`` x
  ``data_parallel_shard_degree`` (-1: the ranks left of NGPU, the launcher's: ``--world-size``); under a pipeline
  the micro-batch is ``pipeline_parallel_microbatch_size`` (1), local / it micro-batches a step;
- the newer form (torchtitan after v0.2.2, torchtitan/config/configs.py ``TrainingConfig``) counts tokens:
  ``num_tokens_per_microbatch_per_dp_rank`` / ``max_context_length`` sequences a micro-batch,
  ``num_tokens_per_train_step`` (-1: one step's) over the same D and ``num_pp_microbatches``;
- ``seq_len`` (2048) is the length;
- precision: FSDP2's ``MixedPrecisionPolicy`` (``mixed_precision_param``, bfloat16) where dp_shard or cp > 1, autocast
  under DDP or one device, none under tp or pp alone; ``dtype = "bfloat16"`` holds the weights in bf16;
- ``[activation_checkpoint] mode`` ("selective"): ``selective_ac_option`` "op" is ``--ac op``, an integer K checkpoints
  every K-th layer (``every-K``; 0 and 1 every layer); "full", "none"; "memory_budget" is the compiler's budget
  (``budget:R``, with ``[compile]``);
- ``[optimizer] name`` AdamW or Adam, ``implementation`` fused (the default), foreach or for-loop;
- ``[parallelism]``: fsdp where dp_shard or cp > 1, ``tensor_parallel_degree`` with torchtitan's own plan (``--tp-plan
  torchtitan``: sequence parallel, loss parallel), ``pipeline_parallel_degree`` and ``_schedule``,
  ``context_parallel_degree``;
- ``[training] enable_cpu_offload`` is FSDP2's CPU offload (``--offload params``); ``[compile] enable`` compiles
  (``--compile``, inductor).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotune.cli.recipes.job import (
    BatchKeys,
    RecipeError,
    RecipeJob,
    Settings,
    check_keys,
    local_model,
    positive_int_value,
)
from autotune.cli.recipes.reading import ReadContext, note_mesh, refuse_when_set

__all__ = ["read_torchtitan"]

WHAT = "a torchtitan job config"

# Sections read (each checked key by key below) and sections that do not change what a step holds.
_SECTIONS_READ = (
    "model",
    "training",
    "parallelism",
    "activation_checkpoint",
    "optimizer",
    "compile",
    "quantize",
    "float8",
    "experimental",
    "fault_tolerance",
)
_SECTIONS_IGNORED = (
    "job",
    "profiling",
    "metrics",
    "lr_scheduler",
    "checkpoint",
    "comm",
    "memory_estimation",
    "validation",
    "debug",
)
_MODEL_READ = ("name", "flavor", "hf_assets_path", "tokenizer_path", "converters", "print_after_conversion")
_TRAINING_READ = (
    "local_batch_size", "global_batch_size", "seq_len", "num_tokens_per_microbatch_per_dp_rank",
    "num_tokens_per_train_step", "max_context_length", "dtype", "mixed_precision_param", "mixed_precision_reduce",
    "enable_cpu_offload",
)  # fmt: skip
_TRAINING_IGNORED = (
    "dataset",
    "dataset_path",
    "max_norm",
    "steps",
    "gc_freq",
    "gc_debug",
    "dataloader",
    "disable_cuda_graphs",
)
_PARALLELISM_READ = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
    "tensor_parallel_degree", "disable_loss_parallel", "pipeline_parallel_degree", "pipeline_parallel_schedule",
    "pipeline_parallel_microbatch_size", "num_pp_microbatches", "context_parallel_degree", "expert_parallel_degree",
    "expert_tensor_parallel_degree", "module_fqns_per_model_part", "pipeline_parallel_layers_per_stage",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_first_stage_less_layers",
    "pipeline_parallel_last_stage_less_layers",
)  # fmt: skip
_PARALLELISM_IGNORED = (
    "enable_async_tensor_parallel",
    "pipeline_parallel_expert_parallel_overlap",
    "context_parallel_load_balancer",
    "context_parallel_rotate_method",
    "expert_parallel_comm_backend",
)
_AC_READ = ("mode", "selective_ac_option", "memory_budget")
_AC_IGNORED = (
    "per_op_sac_force_recompute_mm_shapes_by_fqns",
    "early_stop",
    "visualize_memory_budget_pareto",
    "preserve_rng_state",
    "determinism_check",
    "debug",
)
_OPTIMIZER_READ = ("name", "implementation", "early_step_in_backward")
_OPTIMIZER_IGNORED = ("lr", "beta1", "beta2", "eps", "weight_decay")
_COMPILE_READ = ("enable", "components", "backend")
# torchtitan's model names -> the model_type of the Hugging Face config its checkpoint ships.
_FAMILIES = {
    "llama3": "llama",
    "llama4": "llama4",
    "qwen3": "qwen3",
    "deepseek_v3": "deepseek_v3",
    "gpt_oss": "gpt_oss",
}
# torch.distributed.pipelining's schedule names (torchtitan passes them to get_schedule_class) -> --pp-schedule.
_SCHEDULES = {"1f1b": "1f1b", "gpipe": "gpipe", "interleaved1f1b": "interleaved-1f1b"}


def read_torchtitan(path: Path, data: dict[str, Any], context: ReadContext) -> RecipeJob:
    """The job a torchtitan TOML describes.

    Raises:
        RecipeError: a key autotune cannot read (see the module's docstring), naming it and the file.
    """
    check_keys(path, data, read=_SECTIONS_READ, ignored=_SECTIONS_IGNORED, what=WHAT)
    sections = {name: data.get(name) or {} for name in _SECTIONS_READ}
    for name, read, ignored in (
        ("model", _MODEL_READ, ()),
        ("training", _TRAINING_READ, _TRAINING_IGNORED),
        ("parallelism", _PARALLELISM_READ, _PARALLELISM_IGNORED),
        ("activation_checkpoint", _AC_READ, _AC_IGNORED),
        ("optimizer", _OPTIMIZER_READ, _OPTIMIZER_IGNORED),
        ("compile", _COMPILE_READ, ()),
    ):
        check_keys(path, sections[name], read=read, ignored=ignored, where=f"[{name}] ", what=WHAT)
    _refuse(path, sections)
    settings = Settings(given=context.given)
    notes: list[str] = []
    model, model_key = _model(path, sections["model"], context)
    training, parallelism = sections["training"], sections["parallelism"]
    tokens = "num_tokens_per_microbatch_per_dp_rank" in training or "max_context_length" in training
    seq_len = positive_int_value(path, "seq_len", training.get("max_context_length" if tokens else "seq_len", 2048))
    settings.set("--seq-len", seq_len, "max_context_length" if tokens else "seq_len")
    settings.set("--max-seq-len", seq_len, "max_context_length" if tokens else "seq_len")
    degrees = _mesh(path, parallelism, settings)
    _precision(path, training, settings, degrees)
    _checkpointing(path, sections["activation_checkpoint"], sections["compile"], settings, notes)
    _optimizer(path, sections["optimizer"], settings)
    if sections["compile"].get("enable"):
        if sections["compile"].get("backend", "inductor") != "inductor":
            raise RecipeError(f"{path}: [compile] backend {sections['compile']['backend']!r}: autotune runs inductor")
        settings.set("--compile", "default", "compile.enable")
    batch = _batch(path, training, parallelism, settings, notes, context, degrees, seq_len if tokens else None)
    return RecipeJob(path, "torchtitan", model, model_key, settings.as_tuple(), batch, tuple(notes))


# Sections' keys that change memory in a way autotune cannot express yet, refused where set: key -> why.
_REFUSED_WHEN_SET = {
    "model": {"converters": "float8 and MX converters are not measured by autotune yet"},
    "experimental": {
        "custom_import": "a custom model is not a config autotune reads",
        "custom_args_module": "a custom config is not one autotune reads",
    },
    "fault_tolerance": {"enable": "TorchFT's replica groups are not measured by autotune"},
    "optimizer": {
        "early_step_in_backward": "an optimizer stepped in the backward frees gradients early, not measured yet"
    },
    "parallelism": {
        key: "a pipeline cut by hand: autotune cuts the layers evenly"
        for key in (
            "module_fqns_per_model_part",
            "pipeline_parallel_layers_per_stage",
            "pipeline_parallel_schedule_csv",
        )
    },
}


def _refuse(path: Path, sections: dict[str, Any]) -> None:
    """What torchtitan runs that autotune does not measure yet."""
    for section, refused in _REFUSED_WHEN_SET.items():
        refuse_when_set(path, sections[section], refused, where=f"[{section}] ")
    parallelism = sections["parallelism"]
    for key in ("expert_parallel_degree", "expert_tensor_parallel_degree"):
        if parallelism.get(key, 1) != 1:
            raise RecipeError(f"{path}: [parallelism] {key} {parallelism[key]}: expert parallelism is not measured yet")
    if parallelism.get("fsdp_reshard_after_forward", "default") == "never":
        raise RecipeError(f"{path}: [parallelism] fsdp_reshard_after_forward never: autotune measures resharding")
    if parallelism.get("disable_loss_parallel") and parallelism.get("tensor_parallel_degree", 1) > 1:
        raise RecipeError(f"{path}: [parallelism] disable_loss_parallel: torchtitan's tp plan here keeps loss parallel")


def _model(path: Path, model: dict[str, Any], context: ReadContext) -> tuple[str, str]:
    """The config at ``hf_assets_path``, checked against ``name``'s family."""
    chosen, said = local_model(
        path, "[model] hf_assets_path", model.get("hf_assets_path", "./tests/assets/tokenizer"), model=context.model
    )
    name = model.get("name", "llama3")
    if name not in _FAMILIES:
        raise RecipeError(f"{path}: [model] name {name!r}: autotune reads {', '.join(_FAMILIES)} from their configs")
    where = Path(chosen)
    config = json.loads((where / "config.json" if where.is_dir() else where).read_text())
    if config.get("model_type") != _FAMILIES[name]:
        raise RecipeError(
            f"{path}: [model] name {name!r} is a {_FAMILIES[name]} model, and {chosen} is a "
            f"{config.get('model_type')!r} config"
        )
    return chosen, said


def _mesh(path: Path, parallelism: dict[str, Any], settings: Settings) -> dict[str, int]:
    """The degrees, and --strategy, --tp (with torchtitan's plan), --pp, --pp-schedule, --cp."""
    degrees = {"replicate": 1, "tp": 1, "pp": 1, "cp": 1}
    for key, name in (
        ("data_parallel_replicate_degree", "replicate"),
        ("tensor_parallel_degree", "tp"),
        ("pipeline_parallel_degree", "pp"),
        ("context_parallel_degree", "cp"),
    ):
        if key in parallelism:
            degrees[name] = positive_int_value(path, f"[parallelism] {key}", parallelism[key])
    shard = parallelism.get("data_parallel_shard_degree", -1)
    if shard != -1:
        degrees["shard"] = positive_int_value(path, "[parallelism] data_parallel_shard_degree", shard)
    for name, flag in (("tp", "--tp"), ("pp", "--pp"), ("cp", "--cp")):
        if degrees[name] > 1:
            settings.set(flag, degrees[name], f"parallelism.{name}")
    if degrees["tp"] > 1:
        settings.set("--tp-plan", "torchtitan", "parallelism.tensor_parallel_degree")
    if degrees["pp"] > 1:
        schedule = str(parallelism.get("pipeline_parallel_schedule", "1F1B"))
        if schedule.lower() not in _SCHEDULES:
            raise RecipeError(
                f"{path}: [parallelism] pipeline_parallel_schedule {schedule!r}: autotune runs 1F1B, "
                "GPipe and Interleaved1F1B"
            )
        settings.set("--pp-schedule", _SCHEDULES[schedule.lower()], "parallelism.pipeline_parallel_schedule")
    return degrees


def _fsdp(degrees: dict[str, int], world: int | None) -> bool:
    """torchtitan's ``fsdp_enabled``: dp_shard > 1 (-1: the ranks left) or cp > 1 (FSDP shards over dp_shard x cp)."""
    shard = degrees.get("shard")
    if shard is None and world is not None:
        shard = world // (degrees["replicate"] * degrees["tp"] * degrees["pp"] * degrees["cp"])
    return (shard or 1) > 1 or degrees["cp"] > 1


def _precision(path: Path, training: dict[str, Any], settings: Settings, degrees: dict[str, int]) -> None:
    """``maybe_enable_amp``: FSDP2's policy where fsdp, autocast under DDP or one device, nothing under tp or pp
    alone; the weights in ``dtype``. Decided once the world size is known (:func:`_batch`)."""
    dtype = training.get("dtype", "float32")
    if dtype not in ("float32", "bfloat16"):
        raise RecipeError(f"{path}: [training] dtype {dtype!r}: float32 or bfloat16")
    if dtype == "bfloat16":
        settings.set("--weights-dtype", "bf16", "training.dtype")
    param = training.get("mixed_precision_param", "bfloat16")
    if param not in ("float32", "bfloat16"):
        raise RecipeError(f"{path}: [training] mixed_precision_param {param!r}: float32 or bfloat16")
    if training.get("mixed_precision_reduce", "float32") != "float32":
        raise RecipeError(f"{path}: [training] mixed_precision_reduce: float32 only")
    if training.get("enable_cpu_offload"):
        settings.set("--offload", "params", "training.enable_cpu_offload")


def _checkpointing(
    path: Path, ac: dict[str, Any], compile_: dict[str, Any], settings: Settings, notes: list[str]
) -> None:
    """``[activation_checkpoint]``, torchtitan's defaults where the file is silent (selective, every 2nd layer)."""
    mode = ac.get("mode", "selective")
    option = str(ac.get("selective_ac_option", "2"))
    keys = tuple(f"activation_checkpoint.{key}" for key in ("mode", "selective_ac_option") if key in ac)
    if mode == "none":
        return
    if mode == "full":
        settings.set("--ac", "full", *keys)
    elif mode == "memory_budget":
        if not compile_.get("enable"):
            raise RecipeError(f"{path}: [activation_checkpoint] mode memory_budget needs [compile] enable = true")
        settings.set("--ac", f"budget:{ac.get('memory_budget', 0.5)}", *keys)
    elif mode == "selective" and option == "op":
        settings.set("--ac", "op", *keys)
    elif mode == "selective" and option.isdigit():
        every = int(option)
        settings.set("--ac", "full" if every <= 1 else f"every-{every}", *keys)
        if every > 1:
            notes.append(
                f"selective_ac_option {every}: torchtitan checkpoints layers {every - 1}, {2 * every - 1}, ... and "
                f"autotune's every-{every} layers 0, {every}, ...: the same count where {every} divides the layers, "
                "one more here where it does not"
            )
    else:
        raise RecipeError(f"{path}: [activation_checkpoint] mode {mode!r} / selective_ac_option {option!r}")


def _optimizer(path: Path, optimizer: dict[str, Any], settings: Settings) -> None:
    """``[optimizer]``: torch.optim's AdamW or Adam, fused by default (torchtitan's ``implementation``)."""
    if "--optimizer" in settings.given:
        return
    name = optimizer.get("name", "AdamW")
    if name not in ("AdamW", "Adam"):
        raise RecipeError(f"{path}: [optimizer] name {name!r}: autotune reads AdamW and Adam here")
    implementation = optimizer.get("implementation", "fused")
    option = {"fused": "fused=true", "foreach": "foreach=true", "for-loop": "foreach=false"}.get(implementation)
    if option is None:
        raise RecipeError(f"{path}: [optimizer] implementation {implementation!r}: fused, foreach or for-loop")
    settings.set("--optimizer", f"{name}:{option}", "optimizer.name", "optimizer.implementation")


def _batch(
    path: Path,
    training: dict[str, Any],
    parallelism: dict[str, Any],
    settings: Settings,
    notes: list[str],
    context: ReadContext,
    degrees: dict[str, int],
    tokens_per_sequence: int | None,
) -> BatchKeys:
    """m, A, D (train.py's verification of the batch sizes) and the precision, which needs D."""
    model_parallel = degrees["tp"] * degrees["pp"] * degrees["cp"]
    least = degrees["replicate"] * model_parallel
    named = None if "shard" not in degrees else degrees["shard"] * least
    world = note_mesh(
        path,
        settings,
        notes,
        named=named,
        given=context.world_size,
        least=least,
        named_by="parallelism",
        launcher="NGPU: data_parallel_shard_degree -1",
    )
    fsdp = _fsdp(degrees, world)
    data_parallel = world // model_parallel
    if fsdp:
        settings.set("--strategy", "fsdp", "parallelism.data_parallel_shard_degree")
    if degrees["replicate"] > 1 and fsdp:
        raise RecipeError(
            f"{path}: [parallelism] data_parallel_replicate_degree {degrees['replicate']} with sharding "
            "is HSDP, which autotune does not measure yet"
        )
    mixed = training.get("mixed_precision_param", "bfloat16") == "bfloat16"
    if mixed and (fsdp or (degrees["tp"] == 1 and degrees["pp"] == 1)):
        settings.set("--precision", "bf16", "training.mixed_precision_param")
    if tokens_per_sequence is None:
        local = positive_int_value(path, "local_batch_size", training.get("local_batch_size", 8))
        global_batch = training.get("global_batch_size", -1)
        keys: tuple[str, ...] = ("local_batch_size", "global_batch_size")
    else:
        local = _sequences(
            path,
            "num_tokens_per_microbatch_per_dp_rank",
            training.get("num_tokens_per_microbatch_per_dp_rank", 16384),
            tokens_per_sequence,
        )
        tokens = training.get("num_tokens_per_train_step", -1)
        global_batch = (
            -1 if tokens == -1 else _sequences(path, "num_tokens_per_train_step", tokens, tokens_per_sequence)
        )
        keys = ("num_tokens_per_microbatch_per_dp_rank", "num_tokens_per_train_step")
    micro, per_step = _pipeline(path, parallelism, settings, degrees, local, tokens_per_sequence is not None)
    per_rank_step = micro * per_step
    if global_batch == -1:
        global_batch = per_rank_step * data_parallel
    global_batch = positive_int_value(path, keys[1], global_batch)
    if global_batch % (per_rank_step * data_parallel):
        raise RecipeError(
            f"{path}: {keys[1]} {global_batch} sequences is not a multiple of {per_rank_step} x "
            f"{data_parallel} data-parallel ranks (torchtitan refuses it too)"
        )
    accumulation = per_step * (global_batch // (per_rank_step * data_parallel))
    batch = BatchKeys(micro, accumulation, data_parallel, keys, tokens_per_sequence)
    settings.set("--target-batch", global_batch, *keys)
    settings.set("--plan", "divisor", *keys)  # every micro-batch of a step has one size
    return batch


def _sequences(path: Path, key: str, tokens: object, seq_len: int) -> int:
    count = positive_int_value(path, f"[training] {key}", tokens)
    if count % seq_len:
        raise RecipeError(f"{path}: [training] {key} {count} is not a whole number of {seq_len}-token sequences")
    return count // seq_len


def _pipeline(
    path: Path, parallelism: dict[str, Any], settings: Settings, degrees: dict[str, int], local: int, tokens: bool
) -> tuple[int, int]:
    """The micro-batch and the micro-batches of a rank's step: the local batch whole without a pipeline; under one,
    ``pipeline_parallel_microbatch_size`` sequences (``num_pp_microbatches`` of the local batch in the newer form)."""
    if degrees["pp"] == 1:
        return local, 1
    if tokens:
        count = positive_int_value(path, "[parallelism] num_pp_microbatches", parallelism.get("num_pp_microbatches", 1))
        micro, per_step = local, count
    else:
        micro = positive_int_value(
            path,
            "[parallelism] pipeline_parallel_microbatch_size",
            parallelism.get("pipeline_parallel_microbatch_size", 1),
        )
        if local % micro:
            raise RecipeError(
                f"{path}: [training] local_batch_size {local} is not a multiple of the pipeline's "
                f"micro-batch {micro} (torchtitan refuses it too)"
            )
        per_step = local // micro
    settings.set("--pp-microbatches", per_step, "parallelism.pipeline_parallel_microbatch_size")
    return micro, per_step
