"""An Axolotl config (YAML) read as the job Axolotl runs from it.

Each key is read as Axolotl reads it (axolotl-ai-cloud/axolotl at 067b021c, 2026-07): the schema's defaults
(src/axolotl/utils/schemas/config.py, training.py, peft.py), ``normalize_config`` and ``resolve_dtype``
(src/axolotl/utils/config/__init__.py), the model loader (src/axolotl/loaders/model.py, adapter.py) and the Trainer's
arguments (src/axolotl/core/builders/base.py):

- the model: ``base_model_config``, else ``base_model`` (``normalize_config``), a local config;
- the batch: ``micro_batch_size`` (1) x ``gradient_accumulation_steps`` (1; else ``batch_size // micro_batch_size``)
  x D, D = WORLD_SIZE // context_parallel_size // tensor_parallel_size (``normalize_config``); WORLD_SIZE is the
  launcher's: the product of the file's ``dp_shard_size``, ``dp_replicate_size``, ``tensor_parallel_size`` and
  ``context_parallel_size`` where it names ``dp_shard_size``, else ``--world-size``;
- the length: ``sequence_len`` (512); with ``sample_packing`` every row holds ``sequence_len`` tokens, the longest
  a row holds without it, so both read as ``--seq-len sequence_len``;
- precision (``resolve_dtype``, ``_configure_precision_settings``): ``bf16: true`` (or ``bfloat16``) loads the
  weights in bf16 and autocasts (the Trainer's ``bf16``); ``bf16: auto``, the default, is bf16 on every card since
  Ampere; ``bf16: full`` loads bf16 weights without autocast; ``fp16`` loads fp16 weights and runs fp16 AMP;
  ``float16`` fp16 weights without AMP. Under fsdp, the Trainer's autocast rides on FSDP2's policy (accelerate's
  way: ``--precision bf16-autocast``);
- ``adapter: lora`` is LoRA (``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``;
  ``lora_target_linear`` is every linear module but the LM head, ``find_all_linear_names``); ``adapter: qlora``
  with ``load_in_4bit`` adds Axolotl's ``BitsAndBytesConfig``: NF4 with double quantization (``--quantize nf4-dq``);
- ``gradient_checkpointing: true`` checkpoints every decoder layer (``--ac full``); ``offload`` (deprecated) is that
  with ``activation_offloading: true``, the saved layer inputs in host memory (``--offload activations``);
- ``optimizer`` (``adamw_torch_fused``) by the Trainer's names (autotune/cli/recipes/optimizers.py);
- ``fsdp_version: 2`` with ``fsdp_config`` or ``fsdp`` is FSDP2 (``--strategy fsdp``); ``offload_params`` is its
  ``--offload params``; ``tensor_parallel_size`` and ``context_parallel_size`` are ``--tp`` and ``--cp`` (transformers'
  own tensor-parallel plan, through accelerate's ``ParallelismConfig``);
- ``torch_compile`` (``auto`` is on: torch >= 2.5.1) and ``torch_compile_mode`` are ``--compile [MODE]``;
- ``attn_implementation`` (or the older booleans): ``sdpa`` is torch's pick; ``flash_attention_2`` the flash kernel
  (``--sdpa-backend flash``); ``eager`` the full attention matrix, as SDPA's math kernel holds it.
"""

from __future__ import annotations

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

__all__ = ["read_axolotl"]

WHAT = "an Axolotl config"

# Read below.
_READ = (
    "base_model", "base_model_config", "model_type", "sequence_len", "sample_packing", "pad_to_sequence_len",
    "micro_batch_size", "gradient_accumulation_steps", "batch_size", "adapter", "lora_r", "lora_alpha",
    "lora_dropout", "lora_target_modules", "lora_target_linear", "load_in_4bit", "load_in_8bit", "bnb_config_kwargs",
    "gradient_checkpointing", "gradient_checkpointing_kwargs", "activation_offloading", "optimizer", "bf16", "fp16",
    "bfloat16", "float16", "float32", "fsdp", "fsdp_config", "fsdp_version", "dp_shard_size", "dp_replicate_size",
    "tensor_parallel_size", "context_parallel_size", "torch_compile", "torch_compile_mode", "torch_compile_backend",
    "attn_implementation", "flash_attention", "sdp_attention", "xformers_attention", "eager_attention",
)  # fmt: skip
# Keys that change memory in a way autotune cannot express yet, refused where set (a value other than none, false,
# empty): key -> why.
_REFUSED_WHEN_SET = {
    "deepspeed": "DeepSpeed ZeRO shards by its own engine, which autotune does not measure (FSDP2 is --strategy fsdp)",
    "plugins": "plugins patch the model (Liger kernels, cut cross-entropy, ...) in ways autotune does not measure",
    "unfrozen_parameters": "a partly frozen base is not a setup autotune builds (LoRA is --lora-rank)",
    "lora_modules_to_save": "modules trained in full beside LoRA are not a setup autotune builds yet",
    "lora_target_parameters": "LoRA on parameters (MoE experts) is not a setup autotune builds yet",
    "peft_use_dora": "DoRA's magnitude vectors and their backward are not measured by autotune yet",
    "peft_layers_to_transform": "LoRA on a subset of the layers is not a setup autotune builds yet",
    "lora_on_cpu": "adapters held on the host are not a setup autotune builds",
    "fp8": "float8 training is not measured by autotune yet",
    "fp8_enable_fsdp_float8_all_gather": "float8 training is not measured by autotune yet",
    "qat": "quantization-aware training is not measured by autotune yet",
    "quantize_moe_experts": "quantized experts are not a setup autotune builds yet",
    "gptq": "a GPTQ base is not a setup autotune builds (QLoRA is adapter: qlora)",
    "model_quantization_config": "a base quantized by another library is not a setup autotune builds",
    "optim_args": "optimizer arguments may change its state (optim_bits, ...); give --optimizer SPEC beside the file",
    "optim_target_modules": "GaLore's projected states are not measured by autotune yet",
    "selective_checkpointing": "Axolotl's selective checkpointing keeps other tensors than autotune's op policy",
    "layer_offloading": "parameters offloaded layer by layer are not measured by autotune yet",
    "cut_cross_entropy": "a fused cross-entropy holds other memory than the model's own loss",
    "chunked_cross_entropy": "a chunked cross-entropy holds other memory than the model's own loss",
    "tiled_mlp": "a tiled MLP holds other activations than the model's own",
    "liger_fused_linear_cross_entropy": "Liger's fused loss holds other memory than the model's own loss",
    "liger_rms_norm": "Liger's kernels hold other activations than the model's own",
    "liger_glu_activation": "Liger's kernels hold other activations than the model's own",
    "liger_layer_norm": "Liger's kernels hold other activations than the model's own",
    "liger_rope": "Liger's kernels hold other activations than the model's own",
    "lora_mlp_kernel": "Axolotl's LoRA kernels hold other activations than peft's layers",
    "lora_qkv_kernel": "Axolotl's LoRA kernels hold other activations than peft's layers",
    "lora_o_kernel": "Axolotl's LoRA kernels hold other activations than peft's layers",
    "use_kernels": "hub kernels replace the model's layers with others autotune does not measure",
    "use_scattermoe": "ScatterMoE's experts hold other memory than the model's own",
    "use_sonicmoe": "SonicMoE's experts hold other memory than the model's own",
    "rl": "preference and RL trainers hold a reference model and other batches than SFT's",
    "reward_model": "a reward model's trainer holds other batches than SFT's",
    "process_reward_model": "a reward model's trainer holds other batches than SFT's",
    "relora": "ReLoRA's merges are not measured by autotune",
    "ddp_bucket_cap_mb": "DDP's bucket size changes the buckets' memory; autotune measures DDP's default (25 MB)",
    "resize_token_embeddings_to_32x": "a resized vocabulary is another model than the config's",
    "tokens": "added tokens resize the embeddings: another model than the config's",
    "expert_parallel_size": "expert parallelism is not measured by autotune yet",
    "flex_attention": "FlexAttention's kernels are not among the attention kernels autotune runs",
    "sage_attention": "SageAttention's kernels are not among the attention kernels autotune runs",
    "s2_attention": "shifted-sparse attention is not among the attention kernels autotune runs",
    "flash_attn_cross_entropy": "flash-attn's fused kernels hold other memory than the model's own",
    "flash_attn_rms_norm": "flash-attn's fused kernels hold other memory than the model's own",
    "flash_attn_fuse_mlp": "flash-attn's fused kernels hold other memory than the model's own",
    "flash_optimum": "BetterTransformer's kernels are not among the attention kernels autotune runs",
    "fused_attn_kernel": "a fused attention kernel autotune does not run",
    "unsloth_cross_entropy_loss": "Unsloth's kernels hold other memory than the model's own",
    "unsloth_lora_mlp": "Unsloth's kernels hold other memory than the model's own",
    "unsloth_lora_qkv": "Unsloth's kernels hold other memory than the model's own",
    "unsloth_lora_o": "Unsloth's kernels hold other memory than the model's own",
    "unsloth_rms_norm": "Unsloth's kernels hold other memory than the model's own",
    "unsloth_rope": "Unsloth's kernels hold other memory than the model's own",
    "diffusion": "a diffusion trainer holds other batches than SFT's",
    "processor_type": "a multimodal processor feeds the model other inputs than token ids",
    "lisa_n_layers": "LISA trains a changing subset of layers, not a setup autotune builds",
    "lisa_step_interval": "LISA trains a changing subset of layers, not a setup autotune builds",
    "max_packed_sequence_len": "the older packing by max_packed_sequence_len: give sequence_len with sample_packing",
    "experts_implementation": "another experts implementation holds other activations than the config's own",
    "llama4_linearized_experts": "linearized experts hold other weights than the config's own",
    "model_config": "values over the config make another model than the config's",
    "model_quantization_config_kwargs": "a base quantized by another library is not a setup autotune builds",
    "gptq_groupsize": "a GPTQ base is not a setup autotune builds",
    "gptq_model_v1": "a GPTQ base is not a setup autotune builds",
    "gptq_disable_exllama": "a GPTQ base is not a setup autotune builds",
    "peft": "peft's extra options (LoftQ, ...) are not a setup autotune builds yet",
    "trl": "preference and RL trainers hold a reference model and other batches than SFT's",
    "orpo_alpha": "preference and RL trainers hold a reference model and other batches than SFT's",
    "rl_beta": "preference and RL trainers hold a reference model and other batches than SFT's",
    "ebft": "this trainer holds other batches than SFT's",
    "liger_rms_norm_gated": "Liger's kernels hold other activations than the model's own",
    "use_onebitllms": "one-bit layers are not a setup autotune builds",
    "nvfp4_merge_aware": "FP4 training is not measured by autotune yet",
    "freeze_mm_modules": "a multimodal model is not a setup autotune builds from here",
    "flex_attn_compile_kwargs": "FlexAttention's kernels are not among the attention kernels autotune runs",
    "gemma4_hybrid_attn_impl": "another attention implementation than the ones autotune runs",
}
# Keys that do not change what a training step holds: data, schedule, logging, saving, evaluation, the hub, the
# tokenizer (but added tokens), seeds, timeouts. Evaluation runs without gradients between steps, below the step's
# peak for the same micro-batch.
_IGNORED = (
    # data
    "datasets", "test_datasets", "pretraining_dataset", "dataset_prepared_path", "val_set_size", "dataset_processes",
    "dataset_num_proc", "dataset_exact_deduplication", "shuffle_merged_datasets", "shuffle_before_merging_datasets",
    "dataset_shard_num", "dataset_shard_idx", "skip_prepare_dataset", "push_dataset_to_hub", "dataset_keep_in_memory",
    "streaming", "streaming_multipack_buffer_size", "train_on_inputs", "group_by_length", "curriculum_sampling",
    "sample_packing_eff_est", "sample_packing_bin_size", "sample_packing_group_size", "sample_packing_sequentially",
    "sample_packing_seq_len_multiplier", "multipack_real_batches", "pretrain_multipack_attn", "min_sample_len",
    "total_num_tokens", "remove_unused_columns", "dataloader_num_workers", "dataloader_pin_memory",
    "dataloader_prefetch_factor", "dataloader_drop_last", "chat_template", "chat_template_jinja",
    "default_system_message", "special_tokens", "eot_tokens", "tokenizer_type", "tokenizer_config",
    "tokenizer_use_fast", "tokenizer_legacy", "tokenizer_use_mistral_common", "tokenizer_save_jinja_files",
    "trust_remote_code", "revision_of_model", "base_model_ignore_patterns", "is_llama_derived_model",
    "is_mistral_derived_model", "is_falcon_derived_model", "is_qwen_derived_model", "num_labels",
    # schedule and optimizer hyperparameters
    "num_epochs", "max_steps", "learning_rate", "lr_scheduler", "lr_scheduler_kwargs", "cosine_min_lr_ratio",
    "cosine_constant_lr_ratio", "lr_quadratic_warmup", "lr_div_factor", "warmup_steps", "warmup_ratio", "eta_min",
    "weight_decay", "adam_beta1", "adam_beta2", "adam_beta3", "adam_epsilon", "adam_epsilon2", "adam_eps",
    "max_grad_norm", "neftune_noise_alpha", "noisy_embedding_alpha", "jagged_restart_steps",
    "jagged_restart_warmup_steps", "jagged_restart_anneal_steps", "loss_watchdog_threshold", "loss_watchdog_patience",
    "early_stopping_patience", "seed", "tf32", "peft_use_rslora", "lora_fan_in_fan_out", "peft_init_lora_weights",
    "lora_model_dir", "strict", "debug", "torchdistx_path", "embeddings_skip_upcast",
    # evaluation
    "eval_steps", "evals_per_epoch", "eval_strategy", "evaluation_strategy", "eval_table_size", "eval_max_new_tokens",
    "eval_sample_packing", "eval_batch_size", "eval_causal_lm_metrics", "do_causal_lm_eval", "do_bench_eval",
    "bench_dataset",
    # saving, resuming, logging, the hub, launching
    "output_dir", "saves_per_epoch", "save_steps", "save_strategy", "save_total_limit", "save_safetensors",
    "save_only_model", "save_first_step", "resume_from_checkpoint", "auto_resume_from_checkpoints", "hub_model_id",
    "hub_strategy", "hub_revision", "hf_use_auth_token", "logging_steps", "local_rank", "ddp_timeout",
    "ddp_find_unused_parameters", "ddp_broadcast_buffers", "ddp", "gpu_memory_limit", "device_map",
    "low_cpu_mem_usage", "include_tokens_per_second", "include_tkps", "profiler_steps", "use_ray", "ray_num_workers",
    "accelerator_config", "experimental_skip_move_to_device", "use_wandb", "wandb_project", "wandb_entity",
    "wandb_watch", "wandb_name", "wandb_run_id", "wandb_log_model", "use_mlflow", "mlflow_tracking_uri",
    "mlflow_experiment_name", "mlflow_run_name", "hf_mlflow_log_artifacts", "use_comet", "comet_api_key",
    "comet_workspace", "comet_project_name", "comet_experiment_key", "comet_mode", "comet_online",
    "comet_experiment_config", "use_tensorboard", "use_trackio", "trackio_project_name", "trackio_run_name",
    "trackio_space_id", "use_swanlab", "swanlab_project", "swanlab_experiment_name", "swanlab_description",
    "swanlab_mode", "swanlab_workspace", "swanlab_log_model", "swanlab_log_completions",
    "swanlab_completion_log_interval", "swanlab_completion_max_buffer", "use_otel_metrics", "otel_metrics_host",
    "otel_metrics_port", "dataset_prepared_path_hub", "project_name", "reinit_weights",
    *_REFUSED_WHEN_SET,
)  # fmt: skip
_FSDP_CONFIG_READ = (
    "version",
    "fsdp_version",
    "offload_params",
    "activation_checkpointing",
    "reshard_after_forward",
    "auto_wrap_policy",
    "sharding_strategy",
    "mixed_precision_policy",
)
_FSDP_CONFIG_IGNORED = (
    "sync_module_states", "cpu_ram_efficient_loading", "cpu_offload_pin_memory", "use_orig_params", "state_dict_type",
    "final_state_dict_type", "transformer_layer_cls_to_wrap", "min_num_params", "limit_all_gathers",
    "backward_prefetch", "forward_prefetch",
)  # fmt: skip


def read_axolotl(path: Path, data: dict[str, Any], context: ReadContext) -> RecipeJob:
    """The job an Axolotl config describes.

    Raises:
        RecipeError: a key autotune cannot read (see the module's docstring), naming it and the file.
    """
    check_keys(path, data, read=_READ, ignored=_IGNORED, what=WHAT)
    refuse_when_set(path, data, _REFUSED_WHEN_SET)
    settings = Settings(given=context.given)
    notes: list[str] = []
    config_key = "base_model_config" if is_set(data.get("base_model_config")) else "base_model"
    model, model_key = local_model(path, config_key, data.get(config_key), model=context.model)
    _model_class(path, data, settings)
    seq_len = positive_int_value(path, "sequence_len", data.get("sequence_len", 512))
    settings.set("--seq-len", seq_len, "sequence_len")
    settings.set("--max-seq-len", seq_len, "sequence_len")  # one length: the job never trains a longer one
    fsdp = _strategy(path, data, settings)
    _precision(path, data, settings, notes, fsdp=fsdp)
    _adapter(path, data, settings, notes)
    _checkpointing(path, data, settings, notes)
    if "--optimizer" not in context.given:
        spec, note = optimizer_spec(path, "optimizer", data.get("optimizer") or "adamw_torch_fused", axolotl=True)
        settings.set("--optimizer", spec, "optimizer")
        notes.extend([note] if note else [])
    _compile(path, data, settings)
    _attention(path, data, settings, notes)
    batch = _batch(path, data, settings, notes, context)
    return RecipeJob(path, "axolotl", model, model_key, settings.as_tuple(), batch, tuple(notes))


def _model_class(path: Path, data: dict[str, Any], settings: Settings) -> None:
    """``model_type``: the class Axolotl loads (``AutoModelForCausalLM`` by default; loaders/model.py)."""
    model_type = data.get("model_type")
    if not is_set(model_type) or model_type == "AutoModelForCausalLM":
        return
    if not isinstance(model_type, str) or model_type.startswith("Auto"):
        raise RecipeError(f"{path}: model_type {model_type!r}: name the class (LlamaForCausalLM, ...) or leave it out")
    settings.set("--hf-class", model_type, "model_type")


def _strategy(path: Path, data: dict[str, Any], settings: Settings) -> bool:
    """--strategy, --tp, --cp and --offload params from the FSDP and mesh keys; whether the job is fsdp."""
    config = {key.removeprefix("fsdp_"): value for key, value in (data.get("fsdp_config") or {}).items()}
    check_keys(path, config, read=_FSDP_CONFIG_READ, ignored=_FSDP_CONFIG_IGNORED, where="fsdp_config.", what=WHAT)
    options = data.get("fsdp") or []
    options = options.split() if isinstance(options, str) else list(options)
    shard = data.get("dp_shard_size")
    fsdp = bool(options or config or is_set(data.get("fsdp_version")) or (is_set(shard) and shard != 1))
    for name, flag in (("tensor_parallel_size", "--tp"), ("context_parallel_size", "--cp")):
        if is_set(data.get(name)):
            settings.set(flag, positive_int_value(path, name, data[name]), name)
    if is_set(data.get("dp_replicate_size")) and data["dp_replicate_size"] != 1 and fsdp:
        raise RecipeError(
            f"{path}: dp_replicate_size {data['dp_replicate_size']} with FSDP is HSDP (replicas of sharded groups), "
            "which autotune does not measure yet"
        )
    if not fsdp:
        return False
    version = data.get("fsdp_version") or config.get("version") or 1  # validation.py _resolve_fsdp_version
    if str(version) != "2":
        raise RecipeError(
            f"{path}: fsdp_version {version} (Axolotl's default is 1) is FSDP1's flat parameters, which autotune does "
            "not measure: set fsdp_version: 2 (FSDP2, fully_shard)"
        )
    for option in options:
        if option == "offload":
            settings.set("--offload", "params", "fsdp")
        elif option not in ("full_shard", "auto_wrap"):
            raise RecipeError(f"{path}: fsdp option {option!r}: FSDP2 here shards fully (full_shard, auto_wrap)")
    if config.get("sharding_strategy") not in (None, "FULL_SHARD"):
        raise RecipeError(f"{path}: fsdp_config.sharding_strategy {config['sharding_strategy']}: autotune shards fully")
    if config.get("reshard_after_forward") is False:
        raise RecipeError(f"{path}: fsdp_config.reshard_after_forward false: autotune measures FSDP2's resharding")
    if config.get("auto_wrap_policy") not in (None, "TRANSFORMER_BASED_WRAP"):
        raise RecipeError(
            f"{path}: fsdp_config.auto_wrap_policy {config['auto_wrap_policy']}: autotune shards the decoder layers "
            "and the root (TRANSFORMER_BASED_WRAP)"
        )
    if is_set(config.get("mixed_precision_policy")):
        raise RecipeError(f"{path}: fsdp_config.mixed_precision_policy: autotune takes the policy from bf16 / fp16")
    if config.get("offload_params"):
        settings.set("--offload", "params", "fsdp_config.offload_params")
    if config.get("activation_checkpointing"):
        settings.set("--ac", "full", "fsdp_config.activation_checkpointing")
    settings.set("--strategy", "fsdp", "fsdp_version")
    return True


def _precision(path: Path, data: dict[str, Any], settings: Settings, notes: list[str], *, fsdp: bool) -> None:
    """--weights-dtype and --precision as ``resolve_dtype`` and the Trainer's bf16 / fp16 arguments make them."""
    bf16, fp16 = data.get("bf16", "auto"), data.get("fp16")
    if bf16 == "auto":
        bf16 = not fp16
        if bf16:
            notes.append("bf16: auto read as bf16 (every card since Ampere has it; --precision fp16 for an older one)")
    keys = tuple(key for key in ("bf16", "fp16", "bfloat16", "float16") if key in data)
    if bf16 == "full":
        settings.set("--weights-dtype", "bf16", "bf16")
        settings.set("--precision", "fp32", "bf16")  # bf16_full_eval only: no autocast in training
    elif bf16 or data.get("bfloat16"):
        settings.set("--weights-dtype", "bf16", *keys)
        settings.set("--precision", "bf16-autocast" if fsdp else "bf16", *keys)
    elif fp16 or data.get("float16") or data.get("load_in_8bit"):
        settings.set("--weights-dtype", "fp16", *keys)
        settings.set("--precision", "fp16" if fp16 else "fp32", *keys)
    elif bf16 not in (False, None) and not isinstance(bf16, bool):
        raise RecipeError(f"{path}: bf16 {bf16!r}: true, false, auto or full")


def _adapter(path: Path, data: dict[str, Any], settings: Settings, notes: list[str]) -> None:
    """LoRA and QLoRA (loaders/adapter.py ``_build_peft_lora_config``; loaders/model.py's BitsAndBytesConfig)."""
    adapter = data.get("adapter")
    if data.get("load_in_8bit"):
        raise RecipeError(f"{path}: load_in_8bit: an 8-bit base is not a setup autotune builds (QLoRA's 4-bit is)")
    if not is_set(adapter):
        if data.get("load_in_4bit"):
            raise RecipeError(f"{path}: load_in_4bit without adapter: qlora: Axolotl quantizes a 4-bit base for QLoRA")
        return
    if adapter not in ("lora", "qlora"):
        raise RecipeError(f"{path}: adapter {adapter!r}: autotune builds lora and qlora")
    if adapter == "qlora":
        if not data.get("load_in_4bit"):
            raise RecipeError(f"{path}: adapter qlora without load_in_4bit: true")
        quantize = _quantization(path, data.get("bnb_config_kwargs") or {})
        settings.set("--quantize", quantize, "adapter", "load_in_4bit")
        notes.append(
            "adapter: qlora read as peft's k-bit recipe (norms, embeddings and LM head in fp32, 4-bit weights in "
            "uint8); Axolotl casts the norms and embeddings back to the weights' dtype and packs into bf16 storage of "
            "the same bytes: its job holds up to (embeddings + LM head) x 2 bytes per parameter less"
        )
    elif data.get("load_in_4bit"):
        raise RecipeError(f"{path}: load_in_4bit with adapter lora: Axolotl quantizes a 4-bit base for qlora only")
    settings.set("--lora-rank", positive_int_value(path, "lora_r", data.get("lora_r")), "lora_r")
    if is_set(data.get("lora_alpha")):
        settings.set("--lora-alpha", data["lora_alpha"], "lora_alpha")
    if is_set(data.get("lora_dropout")) and data["lora_dropout"] != 0:
        settings.set("--lora-dropout", data["lora_dropout"], "lora_dropout")
    modules = data.get("lora_target_modules")
    if data.get("lora_target_linear"):
        # find_all_linear_names: every linear module but the LM head; the modules listed beside it are among them.
        settings.set("--lora-targets", "all-linear", "lora_target_linear")
    elif is_set(modules):
        names = [modules] if isinstance(modules, str) else list(modules or ())
        settings.set("--lora-targets", ",".join(str(name) for name in names), "lora_target_modules")
    else:
        raise RecipeError(f"{path}: adapter {adapter} names no targets: lora_target_modules or lora_target_linear")


def _quantization(path: Path, kwargs: dict[str, Any]) -> str:
    """Axolotl's BitsAndBytesConfig (NF4, double quantization) with ``bnb_config_kwargs`` on top."""
    for key in kwargs:
        if key not in ("bnb_4bit_use_double_quant", "bnb_4bit_quant_type", "bnb_4bit_quant_storage"):
            raise RecipeError(f"{path}: bnb_config_kwargs.{key}: autotune builds NF4 with or without double quant")
    if kwargs.get("bnb_4bit_quant_type", "nf4") != "nf4":
        raise RecipeError(f"{path}: bnb_config_kwargs.bnb_4bit_quant_type {kwargs['bnb_4bit_quant_type']!r}: NF4 only")
    return "nf4-dq" if kwargs.get("bnb_4bit_use_double_quant", True) else "nf4"


def _checkpointing(path: Path, data: dict[str, Any], settings: Settings, notes: list[str]) -> None:
    """--ac and --offload activations (builders/base.py ``_configure_gradient_checkpointing``; validation.py
    ``check_gradient_checkpointing_w_offload``)."""
    checkpointing = data.get("gradient_checkpointing")
    offloading = data.get("activation_offloading")
    if checkpointing == "offload":
        checkpointing, offloading = True, True
    if checkpointing == "offload_disk" or offloading == "disk":
        raise RecipeError(f"{path}: activations offloaded to disk are not measured by autotune")
    if checkpointing not in (True, False, None):
        raise RecipeError(f"{path}: gradient_checkpointing {checkpointing!r}: true, false or offload")
    kwargs = data.get("gradient_checkpointing_kwargs") or {}
    for key in kwargs:
        if key != "use_reentrant":
            raise RecipeError(f"{path}: gradient_checkpointing_kwargs.{key}: autotune checkpoints whole layers")
    if checkpointing:
        settings.set("--ac", "full", "gradient_checkpointing")
        if kwargs.get("use_reentrant"):
            notes.append("use_reentrant: true read as the non-reentrant checkpoint (both keep each layer's input only)")
    if offloading:
        if not checkpointing:
            raise RecipeError(f"{path}: activation_offloading requires gradient_checkpointing (Axolotl refuses it too)")
        settings.set("--offload", "activations", "activation_offloading")


def _compile(path: Path, data: dict[str, Any], settings: Settings) -> None:
    if not data.get("torch_compile"):
        return
    backend = data.get("torch_compile_backend")
    if is_set(backend) and backend != "inductor":
        raise RecipeError(f"{path}: torch_compile_backend {backend!r}: autotune measures inductor's compiled step")
    settings.set("--compile", data.get("torch_compile_mode") or "default", "torch_compile")


# attn_implementation -> --sdpa-backend (None: torch's own pick for SDPA).
_ATTENTION = {"sdpa": None, "flash_attention_2": "flash", "flash_attention_3": "flash", "eager": "math"}


def _attention(path: Path, data: dict[str, Any], settings: Settings, notes: list[str]) -> None:
    """``attn_implementation``, or the older booleans (schemas/config.py ``check_attention_fields``)."""
    if "--sdpa-backend" in settings.given:
        return
    implementation = data.get("attn_implementation")
    if not is_set(implementation):
        implementation = next(
            (name for key, name in (("flash_attention", "flash_attention_2"), ("eager_attention", "eager"),
                                    ("xformers_attention", "xformers"), ("sdp_attention", "sdpa")) if data.get(key)),
            None,
        )  # fmt: skip
    if implementation == "xformers":
        settings.set("--sdpa-backend", "efficient", "xformers_attention")
        notes.append("xformers_attention read as SDPA's memory-efficient kernel (xformers' own, as SDPA wraps it)")
        return
    if implementation is None:
        return
    if implementation not in _ATTENTION:
        raise RecipeError(f"{path}: attn_implementation {implementation!r}: autotune runs sdpa, flash or eager")
    backend = _ATTENTION[implementation]
    if backend is not None:
        settings.set("--sdpa-backend", backend, "attn_implementation")
        notes.append(f"attn_implementation {implementation} read as SDPA's {backend} kernel (the same saved tensors)")


def _batch(path: Path, data: dict[str, Any], settings: Settings, notes: list[str], context: ReadContext) -> BatchKeys:
    """m, A and D (``normalize_config``), and the target they make."""
    micro = positive_int_value(path, "micro_batch_size", data.get("micro_batch_size", 1))
    if is_set(data.get("gradient_accumulation_steps")):
        accumulation = positive_int_value(path, "gradient_accumulation_steps", data["gradient_accumulation_steps"])
        keys: tuple[str, ...] = ("micro_batch_size", "gradient_accumulation_steps")
    elif is_set(data.get("batch_size")):
        batch_size = positive_int_value(path, "batch_size", data["batch_size"])
        if batch_size % micro:
            raise RecipeError(f"{path}: batch_size {batch_size} is not a multiple of micro_batch_size {micro}")
        accumulation, keys = batch_size // micro, ("micro_batch_size", "batch_size")
    else:
        accumulation, keys = 1, ("micro_batch_size", "gradient_accumulation_steps")
    data_parallel = data_parallel_of(
        path,
        settings,
        notes,
        data,
        given=context.world_size,
        named_by="dp_shard_size x dp_replicate_size x tensor_parallel_size x context_parallel_size",
        launcher="WORLD_SIZE",
    )
    batch = BatchKeys(micro, accumulation, data_parallel, keys)
    settings.set("--target-batch", batch.global_batch, *keys)
    settings.set("--plan", "divisor", *keys)  # the Trainer runs equal micro-batches
    return batch
