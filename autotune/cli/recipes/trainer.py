"""A Hugging Face ``TrainingArguments`` JSON (as ``to_json_string()`` writes it), or a TRL ``SFTConfig``, read as the
job the Trainer runs from it.

Each key is read as transformers 5.24 reads it (src/transformers/training_args.py: the fields, ``__post_init__``,
``_apply_legacy_fsdp_to_config`` and the FSDP plugin's arguments; trainer_optimizer.py for ``optim``), TRL 1.9's
``SFTConfig`` (trl/trainer/sft_config.py) and, where a TRL script's one config file carries them, TRL's
``ModelConfig`` (trl/trainer/model_config.py, ``get_quantization_config``, ``get_peft_config``):

- the model: ``model_name_or_path`` (ModelConfig), else ``--model``, a local config; its dtype is
  ``model_init_kwargs.dtype`` or ModelConfig's ``dtype`` (``auto``: the config's own ``dtype``), else float32, what
  the SFTTrainer loads by default (sft_trainer.py) and what a model built without one holds;
- the batch: ``per_device_train_batch_size`` (8) x ``gradient_accumulation_steps`` (1) x D, D = W / (tp x cp); W is
  the product of ``parallelism_config``'s degrees where it names ``dp_shard_size``, else the launcher's
  (``--world-size``);
- the length: TRL's ``max_length`` (1024; ``max_seq_length`` in older TRL); packed or padding-free, a micro-batch is
  at most that many tokens a row, the figure either way. A plain TrainingArguments file names none: ``--seq-len``;
- ``bf16`` / ``fp16`` autocast (AMP) over the weights as loaded; under fsdp accelerate's autocast rides on FSDP2's
  policy (``--precision bf16-autocast``);
- ``activation_checkpointing`` (``gradient_checkpointing``, its older name) is ``--ac full``; its kwargs'
  ``every_n_layers`` N is ``every-N`` (layers 0, N, 2N, ...: modeling_utils ``_activation_checkpointing_enable``),
  ``offload`` is ``--offload activations``; TRL's ``activation_offloading`` likewise;
- ``optim`` (``adamw_torch_fused``) by the Trainer's names (autotune/cli/recipes/optimizers.py);
- ``fsdp`` (true, or the older ``"full_shard auto_wrap"``) with ``fsdp_config`` version 2 (transformers 5's default)
  is FSDP2: ``cpu_offload`` (or the option ``offload``) is ``--offload params``, ``activation_checkpointing`` is
  ``--ac full``; ``parallelism_config``'s ``dp_shard_size`` > 1 shards too, its ``tp_size`` and ``cp_size`` are
  ``--tp`` and ``--cp``;
- ``torch_compile`` and ``torch_compile_mode`` are ``--compile [MODE]``;
- LoRA and QLoRA from ModelConfig: ``use_peft`` with ``lora_r`` (16), ``lora_alpha`` (32), ``lora_dropout`` (0.05),
  ``lora_target_modules``; ``load_in_4bit`` with ``bnb_4bit_quant_type`` nf4 and ``use_bnb_nested_quant``
  (``--quantize nf4`` / ``nf4-dq``).
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
from autotune.cli.recipes.optimizers import optimizer_spec
from autotune.cli.recipes.reading import ReadContext, data_parallel_of, is_set, refuse_when_set

__all__ = ["read_trainer"]

WHAT = "TrainingArguments, SFTConfig or TRL's ModelConfig"

_READ = (
    "per_device_train_batch_size", "per_gpu_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16",
    "activation_checkpointing", "activation_checkpointing_kwargs", "gradient_checkpointing",
    "gradient_checkpointing_kwargs", "optim", "adafactor", "fsdp", "fsdp_config", "fsdp_min_num_params",
    "parallelism_config", "tp_size", "torch_compile", "torch_compile_backend", "torch_compile_mode", "torchdynamo",
    "label_smoothing_factor", "auto_find_batch_size",
    # SFTConfig
    "max_length", "max_seq_length", "packing", "padding_free", "loss_type", "activation_offloading",
    "model_init_kwargs",
    # ModelConfig
    "model_name_or_path", "dtype", "torch_dtype", "attn_implementation", "use_peft", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_task_type", "load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type",
    "use_bnb_nested_quant", "bnb_4bit_quant_storage",
)  # fmt: skip
_REFUSED_WHEN_SET = {
    "deepspeed": "DeepSpeed ZeRO shards by its own engine, which autotune does not measure (FSDP2 is --strategy fsdp)",
    "optim_args": "optimizer arguments may change its state; give --optimizer SPEC beside the file",
    "optim_target_modules": "GaLore's projected states are not measured by autotune yet",
    "use_liger_kernel": "Liger's kernels and fused loss hold other memory than the model's own",
    "liger_kernel_config": "Liger's kernels and fused loss hold other memory than the model's own",
    "use_liger": "Liger's kernels and fused loss hold other memory than the model's own",
    "ddp_bucket_cap_mb": "DDP's bucket size changes the buckets' memory; autotune measures DDP's default (25 MB)",
    "lora_modules_to_save": "modules trained in full beside LoRA are not a setup autotune builds yet",
    "lora_target_parameters": "LoRA on parameters (MoE experts) is not a setup autotune builds yet",
    "use_dora": "DoRA's magnitude vectors and their backward are not measured by autotune yet",
    "sharded_ddp": "fairscale's sharded DDP is not measured by autotune",
    "mp_parameters": "SageMaker model parallelism is not measured by autotune",
    "xla_fsdp_settings": "XLA's FSDP is not measured by autotune",
}
# Keys that do not change what a training step holds (transformers 5.24's fields and transformers 4's older ones,
# SFTConfig's data and loss-masking options, ModelConfig's revision and flags that change nothing but time).
_IGNORED = (
    "output_dir", "overwrite_output_dir", "do_train", "do_eval", "do_predict", "eval_strategy", "evaluation_strategy",
    "prediction_loss_only", "per_device_eval_batch_size", "per_gpu_eval_batch_size", "eval_accumulation_steps",
    "eval_delay", "torch_empty_cache_steps", "learning_rate", "weight_decay", "adam_beta1", "adam_beta2",
    "adam_epsilon", "max_grad_norm", "num_train_epochs", "max_steps", "lr_scheduler_type", "lr_scheduler_kwargs",
    "warmup_ratio", "warmup_steps", "log_level", "log_level_replica", "log_on_each_node", "logging_dir",
    "logging_strategy", "logging_first_step", "logging_steps", "logging_nan_inf_filter", "save_strategy", "save_steps",
    "save_total_limit", "save_safetensors", "save_on_each_node", "save_only_model", "enable_jit_checkpoint",
    "restore_callback_states_from_checkpoint", "use_mps_device", "seed", "data_seed", "jit_mode_eval", "use_ipex",
    "bf16_full_eval", "fp16_full_eval", "fp16_opt_level", "half_precision_backend", "fp16_backend", "tf32",
    "local_rank", "ddp_backend", "tpu_num_cores", "tpu_metrics_debug", "debug", "dataloader_drop_last", "eval_steps",
    "dataloader_num_workers", "dataloader_prefetch_factor", "dataloader_persistent_workers",
    "dataloader_multiprocessing_context", "dataloader_in_order", "dataloader_pin_memory", "past_index", "run_name",
    "project", "disable_tqdm", "remove_unused_columns", "label_names", "load_best_model_at_end",
    "metric_for_best_model", "greater_is_better", "ignore_data_skip", "accelerator_config", "group_by_length",
    "length_column_name", "train_sampling_strategy", "report_to", "ddp_find_unused_parameters",
    "ddp_broadcast_buffers", "ddp_static_graph", "ddp_timeout", "skip_memory_metrics", "use_legacy_prediction_loop",
    "push_to_hub", "resume_from_checkpoint", "hub_model_id", "hub_strategy", "hub_token", "hub_private_repo",
    "hub_always_push", "hub_revision", "include_inputs_for_metrics", "include_for_metrics",
    "eval_do_concat_batches", "push_to_hub_model_id", "push_to_hub_organization", "push_to_hub_token",
    "full_determinism", "ray_scope", "dispatch_batches", "split_batches", "include_tokens_per_second",
    "include_num_input_tokens_seen", "neftune_noise_alpha", "batch_eval_metrics", "eval_on_start",
    "eval_use_gather_object", "average_tokens_across_devices", "use_cache", "trackio_space_id", "trackio_bucket_id",
    "trackio_static_space_id", "fsdp_transformer_layer_cls_to_wrap", "use_cpu", "no_cuda",
    # SFTConfig
    "dataset_text_field", "dataset_kwargs", "dataset_num_proc", "dataset_batch_size", "eos_token", "pad_token",
    "truncation_mode", "shuffle_dataset", "packing_strategy", "pad_to_multiple_of", "eval_packing",
    "completion_only_loss", "assistant_only_loss", "router_aux_loss_coef", "trust_remote_code", "chat_template_path",
    "num_of_sequences", "chars_per_token", "dataset_name", "dataset_config", "dataset_train_split",
    "dataset_test_split", "dataset_streaming", "gradient_checkpointing_use_reentrant",
    # ModelConfig
    "model_revision", "use_rslora",
    *_REFUSED_WHEN_SET,
)  # fmt: skip
_FSDP_CONFIG_READ = (
    "version",
    "fsdp_version",
    "cpu_offload",
    "offload_params",
    "activation_checkpointing",
    "reshard_after_forward",
    "auto_wrap_policy",
    "min_num_params",
    "xla",
    "xla_fsdp_v2",
    "xla_fsdp_grad_ckpt",
)
_FSDP_CONFIG_IGNORED = (
    "transformer_layer_cls_to_wrap",
    "cpu_ram_efficient_loading",
    "state_dict_type",
    "sync_module_states",
    "use_orig_params",
    "limit_all_gathers",
    "backward_prefetch",
    "forward_prefetch",
    "xla_fsdp_settings",
)
_PARALLELISM_READ = ("dp_replicate_size", "dp_shard_size", "tp_size", "cp_size", "sp_size")
# _sizes: accelerate's copy of the four sizes (ParallelismConfig.__post_init__), written by to_json.
_PARALLELISM_IGNORED = ("cp_backend", "sp_backend", "tp_handler", "cp_handler", "sp_handler", "_sizes")
_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def read_trainer(path: Path, data: dict[str, Any], context: ReadContext) -> RecipeJob:
    """The job a TrainingArguments (or SFTConfig) JSON describes.

    Raises:
        RecipeError: a key autotune cannot read (see the module's docstring), naming it and the file.
    """
    check_keys(path, data, read=_READ, ignored=_IGNORED, what=WHAT)
    refuse_when_set(path, data, _REFUSED_WHEN_SET)
    for key, why in (("torchdynamo", "a dynamo backend"), ("per_gpu_train_batch_size", "the batch's older name")):
        if is_set(data.get(key)):
            raise RecipeError(f"{path}: {key} is set ({why}): autotune reads torch_compile and per_device_*")
    settings = Settings(given=context.given)
    notes: list[str] = []
    model, model_key = local_model(path, "model_name_or_path", data.get("model_name_or_path"), model=context.model)
    sft = any(key in data for key in ("max_length", "max_seq_length", "packing", "dataset_text_field", "loss_type"))
    _length(path, data, settings, notes, sft=sft)
    fsdp = _strategy(path, data, settings, notes)
    _precision(path, data, settings, fsdp=fsdp, model=model)
    _adapter(path, data, settings, notes)
    _checkpointing(path, data, settings, sft=sft)
    if "--optimizer" not in context.given:
        name = "adafactor" if data.get("adafactor") else data.get("optim", "adamw_torch_fused")
        spec, note = optimizer_spec(path, "optim", name)
        settings.set("--optimizer", spec, "optim")
        notes.extend([note] if note else [])
    _compile(path, data, settings)
    _loss(path, data, sft=sft)
    if data.get("auto_find_batch_size"):
        notes.append(
            "auto_find_batch_size: true would lower the micro-batch after an OOM and keep the accumulation, changing "
            "the global batch; the planned micro-batch fits, so the written file can turn it off"
        )
    batch = _batch(path, data, settings, notes, context)
    return RecipeJob(path, "trainer", model, model_key, settings.as_tuple(), batch, tuple(notes))


def _length(path: Path, data: dict[str, Any], settings: Settings, notes: list[str], *, sft: bool) -> None:
    """TRL's ``max_length`` (its older ``max_seq_length``): the longest row, and every row's length packed."""
    key = "max_length" if "max_length" in data else "max_seq_length"
    if "--seq-len" in settings.given:
        return
    if not sft:
        raise RecipeError(f"{path}: TrainingArguments name no sequence length: give --seq-len L (the longest row)")
    value = data.get(key, 1024)
    if value is None:
        raise RecipeError(f"{path}: {key} null truncates nothing: the length is the data's; give --seq-len L")
    length = positive_int_value(path, key, value)
    settings.set("--seq-len", length, key)
    settings.set("--max-seq-len", length, key)
    if data.get("packing") or data.get("padding_free"):
        notes.append(f"packing / padding_free: every micro-batch read as rows of {length} tokens, the most it holds")


def _strategy(path: Path, data: dict[str, Any], settings: Settings, notes: list[str]) -> bool:
    """--strategy, --tp, --cp and --offload params (training_args.py: ``_apply_legacy_fsdp_to_config``, the FSDP
    plugin's arguments; accelerate's ``ParallelismConfig``)."""
    mesh = data.get("parallelism_config") or {}
    check_keys(path, mesh, read=_PARALLELISM_READ, ignored=_PARALLELISM_IGNORED, where="parallelism_config.", what=WHAT)
    if is_set(mesh.get("sp_size")) and mesh["sp_size"] != 1:
        raise RecipeError(f"{path}: parallelism_config.sp_size: DeepSpeed's sequence parallelism is not measured")
    tp = mesh.get("tp_size") or data.get("tp_size")
    for value, key, flag in ((tp, "tp_size", "--tp"), (mesh.get("cp_size"), "cp_size", "--cp")):
        if is_set(value) and value != 1:
            settings.set(flag, positive_int_value(path, key, value), key)
    options = data.get("fsdp") or []
    if isinstance(options, str):
        options = options.split()
    config = {key.removeprefix("fsdp_"): value for key, value in (data.get("fsdp_config") or {}).items()}
    check_keys(path, config, read=_FSDP_CONFIG_READ, ignored=_FSDP_CONFIG_IGNORED, where="fsdp_config.", what=WHAT)
    shard = mesh.get("dp_shard_size")
    fsdp = bool(options) or (is_set(shard) and shard != 1)
    replicate = mesh.get("dp_replicate_size")
    if fsdp and is_set(replicate) and replicate != 1:
        raise RecipeError(
            f"{path}: parallelism_config.dp_replicate_size {replicate} with dp_shard_size is HSDP, "
            "which autotune does not measure yet"
        )
    if not fsdp:
        return False
    if "version" not in config and "fsdp_version" not in config:
        notes.append("fsdp_config has no version: read as FSDP2, transformers 5's default (transformers 4 ran FSDP1)")
    version = config.get("version", config.get("fsdp_version", 2))
    if str(version) != "2":
        raise RecipeError(
            f"{path}: fsdp_config.version {version} is FSDP1's flat parameters, which autotune does not "
            "measure: set version 2 (FSDP2, fully_shard)"
        )
    for option in options if isinstance(options, list) else []:
        if option == "offload":
            settings.set("--offload", "params", "fsdp")
        elif option not in ("full_shard", "auto_wrap"):
            raise RecipeError(f"{path}: fsdp option {option!r}: FSDP2 here shards fully (full_shard, auto_wrap)")
    if config.get("reshard_after_forward") is False:
        raise RecipeError(f"{path}: fsdp_config.reshard_after_forward false: autotune measures FSDP2's resharding")
    if config.get("auto_wrap_policy") not in (None, "TRANSFORMER_BASED_WRAP") or (config.get("min_num_params") or 0):
        raise RecipeError(f"{path}: fsdp_config wraps by size: autotune shards the decoder layers and the root")
    if is_set(data.get("fsdp_min_num_params")):
        raise RecipeError(f"{path}: fsdp_min_num_params wraps by size: autotune shards the decoder layers and the root")
    if config.get("xla") or config.get("xla_fsdp_v2"):
        raise RecipeError(f"{path}: fsdp_config.xla: XLA's FSDP is not measured by autotune")
    if config.get("cpu_offload") or config.get("offload_params"):
        settings.set("--offload", "params", "fsdp_config.cpu_offload")
    if config.get("activation_checkpointing"):
        settings.set("--ac", "full", "fsdp_config.activation_checkpointing")
    settings.set("--strategy", "fsdp", "fsdp")
    return True


def _model_dtype(path: Path, data: dict[str, Any], model: str) -> tuple[str, str | None]:
    """The weights' dtype and the key that said it: ``model_init_kwargs`` or ModelConfig's ``dtype``."""
    init = data.get("model_init_kwargs") or {}
    if isinstance(init, str):
        init = json.loads(init)  # TrainingArguments parses a dict field given as a JSON string
    for key in init:
        if key not in ("dtype", "torch_dtype", "attn_implementation", "revision", "trust_remote_code", "device_map"):
            raise RecipeError(f"{path}: model_init_kwargs.{key}: autotune builds the model from its config and dtype")
    for where, source in (("model_init_kwargs.", init), ("", data)):
        for key in ("dtype", "torch_dtype"):
            value = source.get(key)
            if is_set(value):
                if value == "auto":
                    return _config_dtype(model), f"{where}{key}"
                if value not in _DTYPES:
                    raise RecipeError(f"{path}: {where}{key} {value!r}: one of {', '.join(_DTYPES)} or auto")
                return _DTYPES[value], f"{where}{key}"
    return "fp32", None


def _config_dtype(model: str) -> str:
    """The dtype a config.json says its checkpoint holds (``dtype: auto`` loads it so); float32 where it says none."""
    where = Path(model)
    config = json.loads((where / "config.json" if where.is_dir() else where).read_text())
    return _DTYPES.get(str(config.get("dtype") or config.get("torch_dtype") or "float32"), "fp32")


def _precision(path: Path, data: dict[str, Any], settings: Settings, *, fsdp: bool, model: str) -> None:
    weights, key = _model_dtype(path, data, model)
    if weights != "fp32":
        settings.set("--weights-dtype", weights, *([key] if key else []))
    if data.get("bf16"):
        settings.set("--precision", "bf16-autocast" if fsdp else "bf16", "bf16")
    elif data.get("fp16"):
        settings.set("--precision", "fp16", "fp16")


def _adapter(path: Path, data: dict[str, Any], settings: Settings, notes: list[str]) -> None:
    """ModelConfig's LoRA and 4-bit base (``get_peft_config``, ``get_quantization_config``)."""
    if data.get("load_in_8bit"):
        raise RecipeError(f"{path}: load_in_8bit: an 8-bit base is not a setup autotune builds (QLoRA's 4-bit is)")
    if data.get("attn_implementation") not in (None, "sdpa"):
        raise RecipeError(f"{path}: attn_implementation {data['attn_implementation']!r}: autotune runs sdpa here")
    if not data.get("use_peft"):
        if data.get("load_in_4bit"):
            raise RecipeError(f"{path}: load_in_4bit without use_peft: a 4-bit base trains only LoRA adapters")
        return
    if data.get("lora_task_type", "CAUSAL_LM") != "CAUSAL_LM":
        raise RecipeError(f"{path}: lora_task_type {data['lora_task_type']!r}: autotune reads causal LMs from here")
    settings.set("--lora-rank", positive_int_value(path, "lora_r", data.get("lora_r", 16)), "lora_r")
    settings.set("--lora-alpha", data.get("lora_alpha", 32), "lora_alpha")
    dropout = data.get("lora_dropout", 0.05)
    if dropout:
        settings.set("--lora-dropout", dropout, "lora_dropout")
    targets = data.get("lora_target_modules")
    if is_set(targets):
        names = [targets] if isinstance(targets, str) else list(targets or ())
        settings.set("--lora-targets", ",".join(str(name) for name in names), "lora_target_modules")
    if data.get("load_in_4bit"):
        if data.get("bnb_4bit_quant_type", "nf4") != "nf4":
            raise RecipeError(f"{path}: bnb_4bit_quant_type {data['bnb_4bit_quant_type']!r}: autotune builds nf4")
        nested = bool(data.get("use_bnb_nested_quant"))
        settings.set("--quantize", "nf4-dq" if nested else "nf4", "load_in_4bit", "use_bnb_nested_quant")
        notes.append(
            "load_in_4bit read as peft's k-bit recipe (norms, embeddings, LM head and adapters in fp32); TRL's "
            "SFTTrainer skips that preparation and casts the adapters to bf16: its job holds less than this answer"
        )


def _checkpointing(path: Path, data: dict[str, Any], settings: Settings, *, sft: bool) -> None:
    """``activation_checkpointing`` (``gradient_checkpointing``: SFTConfig defaults it to true) and its kwargs."""
    on = data.get("activation_checkpointing")
    if on is None:
        on = data.get("gradient_checkpointing", True if sft else False)
    kwargs = data.get("activation_checkpointing_kwargs") or data.get("gradient_checkpointing_kwargs") or {}
    for key in kwargs:
        if key not in ("use_reentrant", "every_n_layers", "offload"):
            raise RecipeError(f"{path}: activation_checkpointing_kwargs.{key}: autotune checkpoints whole layers")
    key = "activation_checkpointing" if "activation_checkpointing" in data else "gradient_checkpointing"
    if on:
        every = positive_int_value(path, "every_n_layers", kwargs.get("every_n_layers", 1))
        settings.set("--ac", "full" if every == 1 else f"every-{every}", key)
        if kwargs.get("offload"):
            settings.set("--offload", "activations", f"{key}_kwargs.offload")
    if data.get("activation_offloading"):
        settings.set("--offload", "activations", "activation_offloading")


def _compile(path: Path, data: dict[str, Any], settings: Settings) -> None:
    if not (data.get("torch_compile") or is_set(data.get("torch_compile_mode"))):
        return
    backend = data.get("torch_compile_backend")
    if is_set(backend) and backend != "inductor":
        raise RecipeError(f"{path}: torch_compile_backend {backend!r}: autotune measures inductor's compiled step")
    settings.set("--compile", data.get("torch_compile_mode") or "default", "torch_compile")


def _loss(path: Path, data: dict[str, Any], *, sft: bool) -> None:
    """The loss: the model's own, what ``nll`` and the plain Trainer run. TRL's ``chunked_nll`` (its default since
    1.7, sft_config.py) and ``dft``, and label smoothing (the Trainer's ``LabelSmoother`` over the logits), hold
    other memory."""
    loss = data.get("loss_type")
    if sft and loss is None:
        loss = "chunked_nll"
    if loss not in (None, "nll"):
        raise RecipeError(
            f"{path}: loss_type {loss!r} (TRL's default is chunked_nll) holds other memory than the model's own loss, "
            "which autotune measures: set loss_type nll"
        )
    if data.get("label_smoothing_factor"):
        raise RecipeError(f"{path}: label_smoothing_factor is set: the Trainer's label smoother holds its own logits")


def _batch(path: Path, data: dict[str, Any], settings: Settings, notes: list[str], context: ReadContext) -> BatchKeys:
    micro = positive_int_value(path, "per_device_train_batch_size", data.get("per_device_train_batch_size", 8))
    accumulation = positive_int_value(path, "gradient_accumulation_steps", data.get("gradient_accumulation_steps", 1))
    keys = ("per_device_train_batch_size", "gradient_accumulation_steps")
    data_parallel = data_parallel_of(
        path,
        settings,
        notes,
        data.get("parallelism_config") or {},
        given=context.world_size,
        named_by="parallelism_config",
        launcher="the launcher's ranks",
    )
    batch = BatchKeys(micro, accumulation, data_parallel, keys)
    settings.set("--target-batch", batch.global_batch, *keys)
    settings.set("--plan", "divisor", *keys)  # the Trainer runs equal micro-batches
    return batch
