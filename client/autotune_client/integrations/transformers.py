"""``tune_trainer(trainer)``: a Hugging Face ``Trainer``'s batch arguments, measured, with the recipe's batch kept.

    from transformers import Trainer, TrainingArguments
    from autotune_client.integrations.transformers import tune_trainer

    args = TrainingArguments(per_device_train_batch_size=64, gradient_accumulation_steps=1, bf16=True, ...)
    trainer = Trainer(model=model, args=args, train_dataset=train, data_collator=collate)
    tune_trainer(trainer, budget="40GiB")   # may set 16 x 4: the same 64 per update
    trainer.train()

``auto_find_batch_size`` halves ``per_device_train_batch_size`` on an OOM and leaves
``gradient_accumulation_steps`` alone, so the effective batch, and with it the recipe's learning-rate
schedule, changes with the card. ``tune_trainer`` asks :func:`autotune_client.suggest` instead (the
store, else a local probe of this trainer's own step: its ``compute_loss``, the optimizer its
arguments name, their precision and gradient checkpointing, one batch of the train dataset through its
data collator) and sets the two arguments so that their product times the world size is the recipe's
batch. Under a process group (torchrun) rank 0 decides for every rank. Nothing is changed when
anything fails: every check and the answer come before the first setting.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from typing import Any

from autotune.core.schemas import Suggestion, TagValue
from autotune_client._client import TunerClient
from autotune_client._suggest import suggest
from autotune_client.integrations._common import IntegrationError, TrainerLayout, check_recipe, describe, equal_plan

__all__ = ["AutoFindBatchSizeWarning", "IntegrationError", "tune_trainer"]

log = logging.getLogger(__name__)


class AutoFindBatchSizeWarning(UserWarning):
    """``auto_find_batch_size`` was on and has been turned off (it would change the effective batch)."""


def _precision(args: Any) -> str:
    if getattr(args, "bf16", False):
        return "bf16"
    if getattr(args, "fp16", False):
        return "fp16"
    return "fp32"


def trainer_layout(args: Any) -> TrainerLayout:
    """The Trainer's ranks as the store keys them: every rank (DataParallel's GPUs in one process count as
    replicas), accelerate's ``parallelism_config`` tensor- and context-parallel sizes (not replicas), and fsdp where
    ``fsdp`` is on or the config shards over dp."""
    world = int(args.world_size) * max(1, int(getattr(args, "n_gpu", 1)))
    config = getattr(args, "parallelism_config", None)
    tp = max(1, int(getattr(config, "tp_size", 1) or 1)) if config is not None else 1
    cp = max(1, int(getattr(config, "cp_size", 1) or 1)) if config is not None else 1
    shards = int(getattr(config, "dp_shard_size", 1) or 1) if config is not None else 1
    fsdp = bool(getattr(args, "fsdp", None)) or shards > 1
    return TrainerLayout(world_size=world, strategy="fsdp" if fsdp else "ddp", tp=tp, cp=cp)


def _memory_policy(args: Any) -> str:
    """The Trainer's ``activation_checkpointing`` as the store's policy name: every-N with ``every_n_layers``, else
    full; "none" when it is off (``gradient_checkpointing`` stays a fingerprint tag: the model checkpoints itself)."""
    fsdp_config = getattr(args, "fsdp_config", None)
    if isinstance(fsdp_config, dict) and fsdp_config.get("activation_checkpointing"):
        return "full"  # FSDP's own checkpointing of every wrapped block
    if not getattr(args, "activation_checkpointing", False):
        return "none"
    every = (getattr(args, "activation_checkpointing_kwargs", None) or {}).get("every_n_layers")
    return f"every-{int(every)}" if every and int(every) >= 2 else "full"


def _example_batch(trainer: Any) -> Any:
    dataset = trainer.train_dataset
    if dataset is None:
        raise IntegrationError("the trainer has no train_dataset: nothing to take the example batch from")
    try:
        item = dataset[0]
    except Exception as exc:
        raise IntegrationError(f"train_dataset[0] failed: {type(exc).__name__}: {_first_line(exc)}") from None
    try:
        return trainer.data_collator([item])
    except Exception as exc:
        raise IntegrationError(
            f"the data collator cannot batch a train_dataset item ({type(item).__name__}"
            f"{' with keys ' + ', '.join(map(str, item)) if isinstance(item, Mapping) else ''}): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]


def _optimizer_factory(trainer: Any) -> Any:
    """The optimizer ``args.optim`` names, with the options the Trainer would give it."""
    try:
        cls, options = trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    except Exception as exc:  # an optimizer whose package is missing here, ...
        raise IntegrationError(f"optim={trainer.args.optim!r}: {type(exc).__name__}: {_first_line(exc)}") from None

    def make(params: Any) -> Any:
        return cls(params, **options)

    return make


def _loss_function(trainer: Any) -> Any:
    args = trainer.args
    checkpointing = bool(getattr(args, "gradient_checkpointing", False))

    def loss(model: Any, batch: Any) -> Any:
        if checkpointing and not getattr(model, "is_gradient_checkpointing", True):
            # The Trainer turns it on at train(); the probe's copy of the model gets it the same way.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs)
        return trainer.compute_loss(model, batch)

    return loss


def _compilation(args: Any) -> dict[str, TagValue]:
    """``torch_compile=True``: the Trainer compiles the model when it trains, so the probe measures it compiled
    (the tag ``compile``, its mode); a backend other than inductor cannot be repeated: a warning, eager."""
    if not getattr(args, "torch_compile", False):
        return {}
    backend = getattr(args, "torch_compile_backend", None) or "inductor"
    if backend != "inductor":
        warnings.warn(
            f"autotune: torch_compile_backend={backend!r}: autotune compiles with inductor only; measured eager",
            UserWarning,
            stacklevel=3,
        )
        return {}
    return {"compile": getattr(args, "torch_compile_mode", None) or "default"}


def tune_trainer(
    trainer: Any,
    target_batch: int | None = None,
    budget: int | str | None = None,
    *,
    client: TunerClient | None = None,
    probe_if_missing: bool = True,
    tags: Mapping[str, TagValue] | None = None,
) -> Suggestion:
    """Set ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` to a plan that fits.

    Call it after building the Trainer and before ``trainer.train()``.

    Args:
        trainer: a ``transformers.Trainer``.
        target_batch: the effective batch to keep; None reads the recipe:
            ``per_device_train_batch_size x gradient_accumulation_steps x world size``.
        budget: bytes (or "40GiB") a device may use; required on the CPU, the card's memory on CUDA.
        client: a TunerClient; None uses ``$AUTOTUNE_URL`` when set, else probes locally.
        probe_if_missing: on a store miss probe here (and upload); False raises instead.
        tags: facts that change memory and are not in the model (seq_len, ...).

    Returns:
        The Suggestion; the trainer's arguments now hold its equal plan.

    Raises:
        IntegrationError: a recipe batch that the world size does not divide, no train dataset, a
            dataset item the collator cannot batch, an optimizer that cannot be built (one line each).
        autotune_client errors from :func:`autotune_client.suggest`.
    """
    args = trainer.args
    layout = trainer_layout(args)
    replicas = layout.replicas
    recipe = target_batch
    if recipe is None:
        recipe = int(args.per_device_train_batch_size) * int(args.gradient_accumulation_steps) * replicas
    recipe = check_recipe(recipe, replicas)
    facts: dict[str, TagValue] = dict(tags or {})
    if getattr(args, "gradient_checkpointing", False):
        facts["gradient_checkpointing"] = True  # the same modules, less memory: part of the fingerprint
    facts.update(_compilation(args))
    suggestion = suggest(
        trainer.model,
        recipe,
        example=_example_batch(trainer),
        world_size=layout.world_size,
        strategy=layout.strategy,
        mesh=layout.mesh,
        activation_checkpointing=_memory_policy(args),
        loss=_loss_function(trainer),
        optimizer=_optimizer_factory(trainer),
        precision=_precision(args),
        tags=facts,
        budget=budget,
        probe_if_missing=probe_if_missing,
        client=client,
        plan="divisor",  # the Trainer runs equal micro-batches
    )
    micro, steps = equal_plan(suggestion)
    # Everything is known: apply it all at once.
    if getattr(args, "auto_find_batch_size", False):
        args.auto_find_batch_size = False
        warnings.warn(
            "tune_trainer turned auto_find_batch_size off: it halves per_device_train_batch_size on an "
            "out-of-memory and leaves gradient_accumulation_steps alone, which would change the effective "
            f"batch of {recipe} that tune_trainer keeps",
            AutoFindBatchSizeWarning,
            stacklevel=2,
        )
    args.per_device_train_batch_size = micro
    args.gradient_accumulation_steps = steps
    trainer._train_batch_size = args.train_batch_size  # read once by Trainer.__init__
    message = describe(suggestion, micro, steps, recipe)
    if args.process_index == 0:
        log.warning(message)  # transformers' own loggers stop at warning by default: this must show
        for note in suggestion.warnings:
            log.warning(f"autotune: {note}")
    return suggestion
