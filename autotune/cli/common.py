"""What every command of the CLI shares: argument types, the one-line parser, exit codes.

The exit codes are one table for every command (``autotune.core.errors.ExitCode``, docs/probing.md); the
``EXIT_*`` names here are its members under the names the commands have used.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Any

from autotune.core.errors import ExitCode
from autotune.core.plan import PLAN_POLICIES
from autotune.core.schemas import MAX_MICRO_BATCH, MAX_SEQ_LEN, MAX_WORLD_SIZE, STRATEGIES
from autotune.core.units import parse_bytes

__all__ = [
    "EXIT_FAILED",
    "EXIT_NO_FIT",
    "EXIT_USAGE",
    "TASK_HELP",
    "CliError",
    "ExitCode",
    "Parser",
    "add_finetune_options",
    "add_mesh_options",
    "add_tp_plan_option",
    "add_seq_len_options",
    "add_strategy_and_plan_options",
    "check_seq_len_options",
    "add_task_options",
    "exit_code_of",
    "finite_positive",
    "headroom",
    "loss_name",
    "mesh_of",
    "micro_batch_cap",
    "non_negative_int",
    "output_file",
    "port",
    "positive_int",
    "positive_int_list",
    "seq_len",
    "seq_lens",
    "size",
    "task_spec",
    "world_size",
]

EXIT_USAGE = ExitCode.USAGE
EXIT_FAILED = ExitCode.FAILED
# Even the smallest micro-batch does not fit (autotune.core.errors.CannotFitError): the one line says what
# the job needs and what would fit.
EXIT_NO_FIT = ExitCode.NO_FIT


class CliError(Exception):
    """A user mistake caught by the CLI itself (bad flag values)."""


def exit_code_of(exc: BaseException) -> ExitCode:
    """The exit status a command ends with for exc (``autotune.core.errors.ExitCode``): the client's rule for
    its errors (unreachable 3, nothing stored 5, ...), USAGE for a CliError, the probe's rule otherwise."""
    from autotune.core.errors import exit_code_for

    try:
        from autotune_client.errors import AutotuneClientError
    except ImportError:  # the client's package is not installed (the service image's torch-free install is)
        AutotuneClientError = None  # type: ignore[assignment,misc]  # noqa: N806
    if AutotuneClientError is not None and isinstance(exc, AutotuneClientError):
        from autotune.cli.client_commands import exit_code_for as client_exit_code

        return client_exit_code(exc)
    if isinstance(exc, CliError):
        return ExitCode.USAGE
    return exit_code_for(exc)


def loss_name(text: str) -> str:
    """A loss's name (``--loss``), canonical: plain, chunked:N or fused-linear (autotune/core/loss_names.py)."""
    from autotune.core.loss_names import canonical_loss

    try:
        return canonical_loss(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _integer(text: str, lowest: int, what: str, highest: int | None = None, why: str = "") -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < lowest:
        raise argparse.ArgumentTypeError(f"{text!r} must be {what}")
    if highest is not None and value > highest:
        raise argparse.ArgumentTypeError(f"{text} is above {highest}{why}")
    return value


def positive_int(text: str) -> int:
    return _integer(text, 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _integer(text, 0, "zero or more")


def micro_batch_cap(text: str) -> int:
    """--max-micro-batch: a positive integer no larger than a profile can record (MAX_MICRO_BATCH)."""
    return _integer(text, 1, "a positive integer", MAX_MICRO_BATCH, ", the largest micro-batch a profile records")


def world_size(text: str) -> int:
    """--world-size: a positive integer no larger than a profile can record (MAX_WORLD_SIZE)."""
    return _integer(text, 1, "a positive integer", MAX_WORLD_SIZE, ", the largest world size a profile records")


def seq_len(text: str) -> int:
    """--seq-len (one length), --max-seq-len: a positive integer no longer than a profile records (MAX_SEQ_LEN)."""
    return _integer(text, 1, "a positive integer", MAX_SEQ_LEN, ", the longest sequence a profile records")


def port(text: str) -> int:
    """--port: a TCP port (0 asks the system for a free one)."""
    return _integer(text, 0, "a TCP port, 0 to 65535", 65535, ", the largest TCP port")


def finite_positive(text: str) -> float:
    """A number above 0 that is finite (--lr, --tolerance, --lora-alpha): nan and inf are refused by name."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0")
    return value


def size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def output_file(text: str) -> Path:
    """--output of probe and estimate: a file's name. One ending in a separator names a folder, refused here: the
    folder need not exist yet, and Path() would drop the separator (a file called "profiles" would be written)."""
    if text.endswith(("/", os.sep)):
        folder = text.rstrip("/" + os.sep) or text
        raise argparse.ArgumentTypeError(
            f"{text!r} names a folder: give a file name, e.g. {str(Path(folder) / 'profile.json')!r}"
        )
    return Path(text)


def headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:  # nan fails it too
        raise argparse.ArgumentTypeError(f"{text!r}: the headroom is a fraction in [0, 1), e.g. 0.1")
    return value


def add_strategy_and_plan_options(p: argparse.ArgumentParser) -> None:
    """--strategy and --plan, as every command that measures or plans takes them."""
    p.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="ddp",
        help="ddp (default: each replica holds the whole model) or fsdp (FSDP2: rank 0 of --world-size)",
    )
    p.add_argument(
        "--plan",
        choices=PLAN_POLICIES,
        default="balanced",
        help="balanced (default: the fewest steps, micro-batches within one of each other, "
        "e.g. 6x26 + 4x25 = 256) or divisor (equal micro-batches, e.g. 16x16)",
    )


def add_mesh_options(p: argparse.ArgumentParser) -> None:
    """--tp, --pp, --pp-schedule, --pp-microbatches, --pp-virtual-stages, --cp: the job's mesh (autotune/core/mesh.py).
    --world-size counts every rank; the data-parallel replicas are W / (tp x pp x cp)."""
    from autotune.core.mesh import PP_SCHEDULES

    g = p.add_argument_group("mesh", "model parallelism: the figures are one rank's; D = world size / (tp x pp x cp)")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel ranks (default 1)")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages (default 1)")
    g.add_argument("--pp-schedule", choices=PP_SCHEDULES, default="1f1b", help="the pipeline's schedule (default 1f1b)")
    g.add_argument("--pp-microbatches", type=positive_int, help="K: micro-batches per step (default: the plan's)")
    g.add_argument("--pp-virtual-stages", type=positive_int, help="V: model chunks per rank (interleaved-1f1b)")
    g.add_argument("--cp", type=positive_int, default=1, help="context-parallel ranks (default 1)")
    g.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="expert-parallel ranks (default 1): a mixture of experts' routed experts sharded over N ranks, tokens "
        "dispatched by all-to-all, under --strategy fsdp (docs/experts.md)",
    )
    g.add_argument(
        "--moe-capacity-factor",
        type=float,
        metavar="C",
        help="with --ep: the job drops tokens, each expert taking at most C x its fair share of a rank's tokens "
        "(GShard, Switch); default: dropless, as torchtitan and Megatron route",
    )


def add_tp_plan_option(p: argparse.ArgumentParser) -> None:
    """--tp-plan: the tensor-parallel plan by name, for the commands that build the task (a query's fingerprint
    carries the plan already)."""
    p.add_argument(
        "--tp-plan",
        choices=("hf", "torchtitan"),
        help="with --tp: the plan by name: hf (transformers' own, the default for hf: tasks) or torchtitan "
        "(sequence parallel between the blocks, vocabulary-parallel embedding, loss parallel; hf: Llama, Mistral, "
        "Qwen2/3, Mixtral and GPT-2 configs)",
    )


def mesh_of(args: argparse.Namespace) -> Any:
    """The Mesh the mesh options give (the trivial one where a command has none)."""
    from autotune.core.mesh import Mesh

    return Mesh(
        tp=getattr(args, "tp", 1),
        pp=getattr(args, "pp", 1),
        cp=getattr(args, "cp", 1),
        ep=getattr(args, "ep", 1),
        ep_capacity=getattr(args, "moe_capacity_factor", None),
        pp_schedule=getattr(args, "pp_schedule", "1f1b"),
        pp_microbatches=getattr(args, "pp_microbatches", None),
        pp_virtual_stages=getattr(args, "pp_virtual_stages", None),
    )


def _positive_ints(text: str, what: str, highest: int, why: str) -> list[int]:
    """``"1,2,26"`` -> ``[1, 2, 26]``: positive integers up to highest, each named (as ``what``) where one is not."""
    values = []
    for part in text.split(","):
        try:
            values.append(_integer(part.strip(), 1, "a positive integer", highest, why))
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{what} {exc}") from None
    return values


def positive_int_list(text: str) -> tuple[int, ...]:
    """``"1,2,26"`` -> ``(1, 2, 26)``: micro-batch sizes, each named where one is not a positive integer (whether
    each can be tried, below --max-micro-batch and on --multiple-of, is autotune.cli.inputs's to say)."""
    return tuple(
        _positive_ints(text, "micro-batch size", MAX_MICRO_BATCH, ", the largest micro-batch a profile records")
    )


def seq_lens(text: str) -> list[int]:
    """``"512,1024"`` -> ``[512, 1024]``: positive integers, each named where one is not."""
    return _positive_ints(text, "sequence length", MAX_SEQ_LEN, ", the longest sequence a profile records")


def add_seq_len_options(p: argparse.ArgumentParser) -> None:
    """--seq-len, --max-seq-len and --target-tokens: a sequence-aware task's lengths (probe,
    estimate, fleet)."""
    p.add_argument(
        "--seq-len",
        type=seq_lens,
        metavar="L1,L2,...",
        help="sequence-aware tasks (batch(m, seq_len=L)): the lengths to answer in one run, one profile each",
    )
    p.add_argument(
        "--max-seq-len",
        type=seq_len,
        metavar="L",
        help="the cap of the search for the longest length that fits at m = multiple-of "
        "(default 4x the longest --seq-len)",
    )
    p.add_argument(
        "--target-tokens",
        type=positive_int,
        metavar="N",
        help="tokens per update (m x L x A x D) instead of --target-batch; needs --seq-len",
    )


def check_seq_len_options(args: argparse.Namespace) -> None:
    """The one-line refusals of the length options that need no task."""
    if getattr(args, "target_tokens", None) is not None:
        if getattr(args, "target_batch", None) is not None:
            raise CliError("give --target-batch (sequences) or --target-tokens (tokens), not both")
        if not getattr(args, "seq_len", None):
            raise CliError("--target-tokens needs --seq-len: tokens are planned in sequences of a length")
    if getattr(args, "max_seq_len", None) is not None and not getattr(args, "seq_len", None):
        raise CliError("--max-seq-len needs --seq-len")


def add_task_options(p: argparse.ArgumentParser) -> None:
    """--optimizer and --lr: what an hf: task trains with (a task file's ProbeTask brings its own);
    and the fine-tuning options (:func:`add_finetune_options`)."""
    p.add_argument(
        "--optimizer",
        metavar="NAME[:key=value,...]",
        help="hf: tasks: a torch.optim class (AdamW, SGD, ...), package.module.Class or a recipe (adafactor, "
        "adamw8bit, adamw4bit), with options: AdamW:fused=true (default AdamW; autotune/tasks/optimizers.py)",
    )
    p.add_argument("--lr", type=finite_positive, metavar="LR", help="hf: tasks: the optimizer's learning rate")
    p.add_argument(
        "--zero-grad",
        choices=("none", "keep"),
        help="hf: tasks: what zero_grad does after each step: none (set_to_none=True, the default) or keep "
        "(set_to_none=False: the gradients stay allocated between steps)",
    )
    add_finetune_options(p)


def _lora_dropout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"dropout must be in [0, 1), got {text}")
    return value


# The options of hf: tasks that say which model is fine-tuned and how (autotune/tasks/hf.py).
_FINETUNE_DESTS = ("hf_class", "lora_rank", "lora_alpha", "lora_targets", "lora_dropout", "weights_dtype", "quantize")


def add_finetune_options(p: argparse.ArgumentParser) -> None:
    """--hf-class, --lora-rank/--lora-alpha/--lora-targets/--lora-dropout and --weights-dtype: the head, LoRA
    and the weights' dtype of an hf: task, written into its spec (docs/fine-tuning.md)."""
    p.add_argument(
        "--hf-class",
        metavar="NAME",
        help="hf: tasks: the transformers model class to build (default: the config's architectures, "
        "else a causal LM), e.g. BertForSequenceClassification",
    )
    p.add_argument(
        "--lora-rank", type=positive_int, metavar="R", help="hf: tasks: LoRA of rank R over a frozen base (peft)"
    )
    p.add_argument("--lora-alpha", type=finite_positive, metavar="A", help="LoRA's alpha (default 2 x rank)")
    p.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="the module names LoRA adapts, a comma list (default peft's own for the model type, e.g. q_proj,v_proj), "
        "or all-linear: every linear module but the output layer",
    )
    p.add_argument("--lora-dropout", type=_lora_dropout, metavar="P", help="LoRA's dropout (default 0)")
    p.add_argument(
        "--weights-dtype",
        choices=("fp32", "bf16", "fp16"),
        help="hf: tasks: the dtype the model is held in, gradients and optimizer state following "
        "(default fp32; not --precision, which autocasts over the weights)",
    )
    p.add_argument(
        "--quantize",
        choices=("nf4", "nf4-dq"),
        help="hf: tasks, with --lora-rank: the base's linear layers in 4-bit NF4 as bitsandbytes holds them, "
        "nf4-dq with its absmax 8-bit too (double quantization; QLoRA: docs/fine-tuning.md)",
    )


def task_spec(spec: str, args: argparse.Namespace) -> str:
    """The spec with --optimizer/--lr and the fine-tuning options written into it, so that it alone
    rebuilds the task elsewhere (``--device all`` children, fleet workers). Raises TaskError for a spec
    that is not hf:."""
    from autotune.tasks.hf import with_options

    finetune = {dest: getattr(args, dest, None) for dest in _FINETUNE_DESTS}
    return with_options(
        spec,
        optimizer=getattr(args, "optimizer", None),
        lr=getattr(args, "lr", None),
        zero_grad=getattr(args, "zero_grad", None),
        **finetune,
    )


# The task argument's help, for every command that loads a task.
TASK_HELP = (
    "path/to/file.py:name or package.module:name (a ProbeTask), or hf:PATH: a Hugging Face config.json or a "
    "folder holding one, read locally and built with random weights (e.g. hf:examples/configs/tiny-llama.json)"
)


class Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-5MiB" for a flag ("expected one argument"); a value that starts with a digit after the
        # minus is a value, so that its type names the rule it breaks ("--budget -5MiB": not a size).
        self._negative_number_matcher = re.compile(r"^-\d")

    def error(self, message: str) -> Any:  # one line, exit 2, like every other usage error
        self.exit(EXIT_USAGE, f"autotune: error: {message}\n")
