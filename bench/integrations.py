"""The trainers' own batch-size finders beside autotune's integrations, on the same module and budget.

    .venv/bin/python bench/integrations.py                      # both pairs, a few minutes on 2 cores
    .venv/bin/python bench/integrations.py --output bench/results/integrations.json

Two pairs, each on one job whose recipe batch does not fit the budget:

- Lightning: ``BatchSizeFinder()`` (its defaults: power mode from 2, 3 steps a trial) against
  ``AutotuneBatchSize(budget=B)``, each as a callback of ``Trainer.fit`` on the same LightningModule (an
  MLP over 64-token samples, the recipe ``batch_size`` 64, SGD);
- Hugging Face: ``TrainingArguments(auto_find_batch_size=True)`` against ``tune_trainer(trainer,
  budget=B)`` before ``trainer.train()``, on the same tiny Llama (from a config, 64-token sequences, the
  recipe ``per_device_train_batch_size`` 64, AdamW).

Each row: the effective batch the job then trains with (micro-batch x accumulation x world size)
against the recipe's, the trials each spent (autotune's real and fake apart), their OOMs, the
seconds from the call (``fit``, or ``tune_trainer`` + ``train``) to the first real training step,
and whether the real steps ran within the budget.

The budget is the CPU meter's (autotune/measure/meters/cpu.py: live tensor-storage bytes), as the peers see it
(bench/_peers_meter.py): a PeerMeter that raises at B x (1 - headroom) with the text of PyTorch's
CPU allocator, which both Lightning and Accelerate recognise as an OOM. It binds inside the Lightning
finder's trials (as bench/_peers_lightning.py does), over the whole of HF ``train()`` (where
``auto_find_batch_size`` catches the OOM and halves), and over every job's real steps; autotune's probe
measures with its own CPU meter at budget B, headroom 0.10: the same line. Figures only, not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from _peers_meter import PeerMeter  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import autotune.orchestrate.probe  # noqa: E402
from autotune.core.schemas import Profile  # noqa: E402
from autotune.core.units import parse_bytes  # noqa: E402

HEADROOM = 0.10
RECIPE_BATCH = 64
REAL_STEPS = 3
LIGHTNING_BUDGET = "8MiB"
HF_BUDGET = "24MiB"


@dataclass
class Row:
    pair: str
    tuner: str
    recipe_batch: int
    micro_batch: int | None = None
    accumulation_steps: int | None = None
    world_size: int = 1
    real_trials: int = 0
    fake_trials: int = 0
    ooms: int = 0
    seconds_to_first_step: float | None = None
    real_steps_within_budget: bool | None = None
    error: str | None = None
    trial_sizes: list[int] = field(default_factory=list)

    @property
    def effective_batch(self) -> int | None:
        if self.micro_batch is None or self.accumulation_steps is None:
            return None
        return self.micro_batch * self.accumulation_steps * self.world_size


@contextlib.contextmanager
def probes_recorded() -> Iterator[list[Profile]]:
    """The profiles autotune's local probe returns inside the block (to count its trials)."""
    seen: list[Profile] = []
    real = autotune.orchestrate.probe.probe

    def recording(*args: Any, **kwargs: Any) -> Profile:
        profile = real(*args, **kwargs)
        seen.append(profile)
        return profile

    autotune.orchestrate.probe.probe = recording  # type: ignore[assignment]
    try:
        yield seen
    finally:
        autotune.orchestrate.probe.probe = real  # type: ignore[assignment]


def count_probe(row: Row, profiles: list[Profile]) -> None:
    for profile in profiles:
        row.real_trials += sum(1 for t in profile.trials if not t.fake)
        row.fake_trials += sum(1 for t in profile.trials if t.fake)
        row.ooms += sum(1 for t in profile.trials if t.oom and not t.fake)
        row.trial_sizes += [t.micro_batch for t in profile.trials]


def one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"


# -- Lightning ---------------------------------------------------------------------------------------


class Samples(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """4096 samples of 64 tokens x 32 features, each made when asked (a sample's own storage: the
    meter counts batches, never a whole dataset held in one tensor that every batch is a view of)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(index))
        return x, x[0, :4].argmax()


def lightning_pair(budget: str) -> list[Row]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BatchSizeFinder
    from lightning.pytorch.tuner import batch_size_scaling as scaling
    from lightning.pytorch.utilities.memory import is_oom_error

    from autotune_client.integrations.lightning import AutotuneBatchSize

    budget_bytes = parse_bytes(budget)

    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = RECIPE_BATCH
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x).mean(dim=1), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Samples(), batch_size=self.batch_size)

    class RealSteps(pl.Callback):
        """Times the first real step and enforces the budget over the real steps."""

        def __init__(self, meter: PeerMeter, started: float, enter_measure: bool) -> None:
            self.meter, self.started, self.enter_measure = meter, started, enter_measure
            self.first_step: float | None = None
            self.stack = contextlib.ExitStack()

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            if self.enter_measure:
                self.stack.enter_context(self.meter.measure())
                self.meter.adopt(pl_module)
            self.stack.enter_context(self.meter.enforcing())

        def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
            if self.first_step is None:
                self.first_step = time.perf_counter() - self.started

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.stack.close()

    def fit(tuner: Any, row: Row, meter: PeerMeter, *, finder: bool) -> tuple[Any, Any]:
        module = Classifier()
        with tempfile.TemporaryDirectory(prefix="bench-integrations-") as root:
            started = time.perf_counter()
            timer = RealSteps(meter, started, enter_measure=not finder)
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=1,
                max_steps=REAL_STEPS,
                callbacks=[tuner, timer],
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                num_sanity_val_steps=0,
                default_root_dir=root,
            )
            outer = contextlib.ExitStack()
            if finder:  # the finder's trials and the real steps share one span of the meter
                outer.enter_context(meter.measure())
                meter.adopt(module)
            try:
                with outer:
                    trainer.fit(module)
                row.real_steps_within_budget = True
            except Exception as exc:
                row.error = one_line(exc)
                row.real_steps_within_budget = not isinstance(exc, torch.OutOfMemoryError)
            finally:
                timer.stack.close()
        row.seconds_to_first_step = None if timer.first_step is None else round(timer.first_step, 2)
        return module, trainer

    rows = []
    # Lightning's BatchSizeFinder, every trial under the budget.
    row = Row("lightning", "Lightning BatchSizeFinder (power)", RECIPE_BATCH)
    meter = PeerMeter(int(budget_bytes * (1 - HEADROOM)))
    original = scaling._try_loop_run

    def counted(trainer: Any, params: dict[str, Any]) -> None:
        row.trial_sizes.append(int(trainer.lightning_module.batch_size))
        row.real_trials += 1
        try:
            with meter.enforcing():
                original(trainer, params)
        except RuntimeError as exc:
            row.ooms += int(is_oom_error(exc))
            raise

    scaling._try_loop_run = counted
    try:
        module, trainer = fit(BatchSizeFinder(), row, meter, finder=True)
    finally:
        scaling._try_loop_run = original
    row.micro_batch, row.accumulation_steps = int(module.batch_size), int(trainer.accumulate_grad_batches)
    rows.append(row)

    row = Row("lightning", "autotune AutotuneBatchSize", RECIPE_BATCH)
    callback = AutotuneBatchSize(budget=budget)
    with probes_recorded() as profiles:
        fit(callback, row, PeerMeter(int(budget_bytes * (1 - HEADROOM))), finder=False)
    count_probe(row, profiles)
    row.micro_batch, row.accumulation_steps = callback.micro_batch, callback.accumulation_steps
    rows.append(row)
    return rows


# -- Hugging Face ------------------------------------------------------------------------------------


def hf_pair(budget: str) -> list[Row]:
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import PrinterCallback
    from transformers.utils import logging as hf_logging

    from autotune_client.integrations.transformers import tune_trainer

    hf_logging.set_verbosity_error()
    budget_bytes = parse_bytes(budget)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    tokens = torch.randint(0, 512, (1024, 64), generator=torch.Generator().manual_seed(0))
    # One storage per sequence (a view of one big tensor would count the whole of it in every batch).
    train_set = [{"input_ids": t.clone(), "labels": t.clone()} for t in tokens]

    class Attempts(TrainerCallback):  # type: ignore[misc]
        """One on_train_begin per attempt of the inner training loop; the first step of the last one."""

        def __init__(self, started: float) -> None:
            self.started = started
            self.sizes: list[int] = []
            self.first_step: float | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.sizes.append(int(state.train_batch_size or args.per_device_train_batch_size))
            self.first_step = None

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.first_step is None:
                self.first_step = time.perf_counter() - self.started

    def trainer_for(root: str, *, auto_find: bool) -> Any:
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=root,
            per_device_train_batch_size=RECIPE_BATCH,
            gradient_accumulation_steps=1,
            auto_find_batch_size=auto_find,
            max_steps=REAL_STEPS,
            learning_rate=1e-3,
            report_to="none",
            save_strategy="no",
            use_cpu=True,
            disable_tqdm=True,
            logging_strategy="no",
        )
        trainer = Trainer(model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=train_set)
        trainer.remove_callback(PrinterCallback)  # its metrics line would land amid the table
        return trainer

    def train(trainer: Any, row: Row, meter: PeerMeter, attempts: Attempts) -> None:
        trainer.add_callback(attempts)
        try:
            with meter.measure():
                meter.adopt(trainer.model)
                with meter.enforcing():
                    trainer.train()
            row.real_steps_within_budget = True
        except Exception as exc:
            row.error = one_line(exc)
            row.real_steps_within_budget = not isinstance(exc, torch.OutOfMemoryError)
        row.seconds_to_first_step = None if attempts.first_step is None else round(attempts.first_step, 2)

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-integrations-") as root:
        row = Row("hf", "HF auto_find_batch_size", RECIPE_BATCH)
        trainer = trainer_for(root, auto_find=True)
        attempts = Attempts(time.perf_counter())
        train(trainer, row, PeerMeter(int(budget_bytes * (1 - HEADROOM))), attempts)
        row.trial_sizes = attempts.sizes
        row.real_trials = len(attempts.sizes)  # every attempt is a real training run
        row.ooms = max(0, len(attempts.sizes) - 1) if row.error is None else len(attempts.sizes)
        row.micro_batch = int(trainer._train_batch_size)
        row.accumulation_steps = int(trainer.args.gradient_accumulation_steps)
        rows.append(row)

        row = Row("hf", "autotune tune_trainer", RECIPE_BATCH)
        trainer = trainer_for(root, auto_find=False)
        attempts = Attempts(time.perf_counter())
        try:
            with probes_recorded() as profiles, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tune_trainer(trainer, budget=budget)
            count_probe(row, profiles)
            train(trainer, row, PeerMeter(int(budget_bytes * (1 - HEADROOM))), attempts)
        except Exception as exc:
            row.error = one_line(exc)
        row.micro_batch = int(trainer.args.per_device_train_batch_size)
        row.accumulation_steps = int(trainer.args.gradient_accumulation_steps)
        rows.append(row)
    return rows


def table(rows: list[Row]) -> str:
    lines = [
        "| pair | tuner | recipe | trains with (m x A x D = effective) | trials real / fake | OOMs "
        "| s to first real step | real steps within budget |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan = (
            f"{r.micro_batch} x {r.accumulation_steps} x {r.world_size} = {r.effective_batch}"
            + ("" if r.effective_batch == r.recipe_batch else " (recipe changed)")
            if r.effective_batch is not None
            else "-"
        )
        trials = f"{r.real_trials} / {r.fake_trials}"
        within = {True: "yes", False: "no (OOM)", None: "-"}[r.real_steps_within_budget]
        lines.append(
            f"| {r.pair} | {r.tuner} | {r.recipe_batch} | {plan} | {trials} | {r.ooms} | "
            f"{r.seconds_to_first_step if r.seconds_to_first_step is not None else '-'} | {within} |"
        )
    errors = [f"{r.tuner}: {r.error}" for r in rows if r.error]
    return "\n".join(lines + ([""] + errors if errors else []))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", default="lightning,hf", help="lightning, hf or both (default)")
    parser.add_argument("--lightning-budget", default=LIGHTNING_BUDGET)
    parser.add_argument("--hf-budget", default=HF_BUDGET)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the same for everyone)")
    parser.add_argument("--output", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # the trainers' advice (workers, loggers, deprecations): not figures
    import logging

    logging.disable(logging.WARNING)  # the trainers' and autotune's log lines: the table says it all
    rows: list[Row] = []
    pairs = {p.strip() for p in args.pairs.split(",")}
    if "lightning" in pairs:
        rows += lightning_pair(args.lightning_budget)
    if "hf" in pairs:
        rows += hf_pair(args.hf_budget)
    print(f"budgets: Lightning {args.lightning_budget}, HF {args.hf_budget}; headroom {HEADROOM}; CPU meter")
    print(table(rows))
    if args.output:
        data = [{**asdict(r), "effective_batch": r.effective_batch} for r in rows]
        args.output.write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
