"""``AutotuneBatchSize``: a Lightning Callback that replaces ``BatchSizeFinder`` and keeps the recipe's batch.

    from lightning.pytorch import Trainer
    from autotune_client.integrations.lightning import AutotuneBatchSize

    trainer = Trainer(accumulate_grad_batches=1, callbacks=[AutotuneBatchSize(budget="20GiB")])
    trainer.fit(module)   # module.batch_size = 256 is the recipe; it may train as 64 x 4

Lightning's ``BatchSizeFinder`` sets a batch size and nothing else: the effective batch changes with
the device, and it is not supported under DDP. This callback, at fit start:

1. reads the recipe batch: ``target_batch``, else the batch size (``batch_arg_name``, looked up as
   Lightning's finder does: the module, its ``hparams``, the datamodule and its ``hparams``) x
   ``trainer.accumulate_grad_batches`` x ``trainer.world_size``;
2. asks :func:`autotune_client.suggest` (the store, else a local probe of this module:
   ``training_step`` is the loss, the trainer's optimizer, one batch of the train dataloader as the
   example, the trainer's precision); under DDP rank 0 decides and every rank gets its answer;
3. sets the batch size and ``trainer.accumulate_grad_batches`` to the best plan of equal
   micro-batches, has the dataloaders rebuilt, and logs what it chose and where the answer came from.

Nothing is changed when anything fails: every check and the answer come before the first setting.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.parsing import lightning_getattr, lightning_hasattr, lightning_setattr

from autotune.core.schemas import Suggestion, TagValue
from autotune_client._client import TunerClient
from autotune_client._suggest import suggest
from autotune_client.integrations._common import IntegrationError, TrainerLayout, check_recipe, describe, equal_plan

__all__ = ["AutotuneBatchSize", "IntegrationError"]

log = logging.getLogger(__name__)


def precision_of(trainer_precision: str) -> str:
    """autotune's precision for a Trainer's: mixed precision is autocast; "bf16-true" and the like
    are fp32 to autotune, because the module's weights already carry the dtype."""
    text = str(trainer_precision)
    if text.startswith("bf16") and "mixed" in text:
        return "bf16"
    if text.startswith("16") and "mixed" in text:
        return "fp16"
    return "fp32"


def _optimizer_factory(optimizer: torch.optim.Optimizer) -> Any:
    """A factory that builds the trainer's optimizer, with its options, on other parameters."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    options = {key: value for key, value in optimizer.defaults.items() if key in accepted}
    cls = type(optimizer)

    def make(params: Any) -> torch.optim.Optimizer:
        return cls(params, **options)

    return make


def _training_step_loss(model: Any, batch: Any) -> torch.Tensor:
    """The module's own training_step as the probe's loss (its self.log calls have no trainer
    there and are skipped)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "self.log() ... trainer reference is not registered"
        out = model.training_step(batch, 0)
    if isinstance(out, Mapping):
        out = out.get("loss")
    if not isinstance(out, torch.Tensor):
        raise IntegrationError(
            f"{type(model).__name__}.training_step returned {type(out).__name__}, not a loss tensor "
            "(manual optimization cannot be probed from training_step: pass target_batch to a suggest() call)"
        )
    return out


def strategy_layout(trainer: Trainer, strategy: str | None) -> TrainerLayout:
    """The trainer's ranks as the store keys them: every rank, the ModelParallelStrategy's tensor-parallel size
    (not replicas), and fsdp under FSDPStrategy (or as the callback was told)."""
    used = trainer.strategy
    tp = getattr(used, "_tensor_parallel_size", 1)
    tp = tp if isinstance(tp, int) and tp > 1 else 1
    if strategy is None:
        strategy = "fsdp" if type(used).__name__ == "FSDPStrategy" else "ddp"
    return TrainerLayout(world_size=int(trainer.world_size), strategy=strategy, tp=tp)


class AutotuneBatchSize(Callback):
    """Sets the micro-batch and ``accumulate_grad_batches`` at fit start so that the recipe's batch is kept.

    Args:
        target_batch: the effective batch to keep; None reads the recipe (batch size x
            ``accumulate_grad_batches`` x world size).
        budget: bytes (or "20GiB") a device may use; required on the CPU, the card's memory on CUDA.
        batch_arg_name: the batch-size attribute, as Lightning's ``BatchSizeFinder`` names it.
        client: a TunerClient; None uses ``$AUTOTUNE_URL`` when set, else probes locally.
        probe_if_missing: on a store miss probe here (and upload); False raises instead.
        tags: facts that change memory and are not in the module (seq_len, ...).
        strategy: "ddp" (each replica holds the whole model) or "fsdp"; None (the default) reads the trainer's
            (FSDPStrategy is fsdp). Under ModelParallelStrategy the tensor-parallel ranks are not replicas.

    After fit starts, :attr:`suggestion` holds the answer and :attr:`micro_batch`,
    :attr:`accumulation_steps` what the trainer runs.
    """

    def __init__(
        self,
        target_batch: int | None = None,
        budget: int | str | None = None,
        batch_arg_name: str = "batch_size",
        *,
        client: TunerClient | None = None,
        probe_if_missing: bool = True,
        tags: Mapping[str, TagValue] | None = None,
        strategy: str | None = None,
    ) -> None:
        super().__init__()
        self.target_batch = target_batch
        self.budget = budget
        self.batch_arg_name = batch_arg_name
        self.client = client
        self.probe_if_missing = probe_if_missing
        self.tags = dict(tags or {})
        self.strategy = strategy
        self.suggestion: Suggestion | None = None
        self.micro_batch: int | None = None
        self.accumulation_steps: int | None = None
        self._checked_first_batch = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not lightning_hasattr(pl_module, self.batch_arg_name):
            raise IntegrationError(
                f"no batch size to tune: {self.batch_arg_name!r} (batch_arg_name) is neither an attribute nor "
                "an hparams entry of the LightningModule or of the trainer's datamodule"
            )
        layout = strategy_layout(trainer, self.strategy)
        replicas = layout.replicas
        batch_size = lightning_getattr(pl_module, self.batch_arg_name)
        if self.target_batch is None:
            if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
                raise IntegrationError(f"{self.batch_arg_name} is {batch_size!r}, not a positive integer")
            recipe = batch_size * int(trainer.accumulate_grad_batches) * replicas
        else:
            recipe = self.target_batch
        recipe = check_recipe(recipe, replicas)
        optimizers = trainer.optimizers
        if getattr(pl_module, "_compiler_ctx", None):  # fit(torch.compile(module)): Lightning compiles forward
            warnings.warn(
                "autotune: the LightningModule is torch.compile'd; the probe runs training_step, which it cannot "
                "compile as Lightning does: measured eager (pass compile= through suggest()'s tags to measure it "
                "compiled)",
                UserWarning,
                stacklevel=2,
            )
        suggestion = suggest(
            pl_module,
            recipe,
            example=self._example_batch(trainer),
            world_size=layout.world_size,
            mesh=layout.mesh,
            loss=_training_step_loss,
            optimizer=_optimizer_factory(optimizers[0]) if optimizers else None,
            precision=precision_of(trainer.precision),
            tags=self.tags,
            budget=self.budget,
            probe_if_missing=self.probe_if_missing,
            client=self.client,
            strategy=layout.strategy,
            plan="divisor",  # Lightning runs equal micro-batches
        )
        micro, steps = equal_plan(suggestion)
        # Everything is known: apply it all at once.
        lightning_setattr(pl_module, self.batch_arg_name, micro)
        trainer.accumulate_grad_batches = steps
        self._reset_dataloaders(trainer)
        self.suggestion, self.micro_batch, self.accumulation_steps = suggestion, micro, steps
        message = describe(suggestion, micro, steps, recipe)
        rank_zero_info(message)
        log.debug(message)
        for note in suggestion.warnings:
            rank_zero_info(f"autotune: {note}")

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._checked_first_batch or self.micro_batch is None:
            return
        self._checked_first_batch = True
        size = extract_batch_size(batch)
        if size > self.micro_batch:
            raise IntegrationError(
                f"the train dataloader gave a batch of {size} after {self.batch_arg_name} was set to "
                f"{self.micro_batch}: build the DataLoader with batch_size=self.{self.batch_arg_name}"
            )

    def _example_batch(self, trainer: Trainer) -> Any:
        source = trainer.fit_loop._data_source
        if not source.is_defined():
            raise IntegrationError("no train dataloader: the module or its datamodule defines no train_dataloader")
        loader = source.dataloader()
        if isinstance(loader, Mapping):  # several train loaders: the first one
            loader = next(iter(loader.values()))
        elif isinstance(loader, Sequence) and not isinstance(loader, torch.utils.data.Dataset):
            loader = loader[0]
        try:
            return next(iter(loader))
        except StopIteration:
            raise IntegrationError("the train dataloader is empty: no batch to take as the example") from None

    @staticmethod
    def _reset_dataloaders(trainer: Trainer) -> None:
        # The fit loop builds its loaders after on_fit_start; a loader built earlier (a second fit)
        # is dropped so that the new batch size is read.
        trainer.fit_loop._combined_loader = None
        trainer.fit_loop.epoch_loop.val_loop._combined_loader = None
