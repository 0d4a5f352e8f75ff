"""``hf:PATH`` task specs: the model a Hugging Face ``config.json`` names, no task file to write.

    autotune probe hf:configs/llama-tiny.json --seq-len 512,2048 --budget 24GiB --target-batch 256
    autotune probe hf:path/to/checkpoint_dir --seq-len 1024 --optimizer SGD --lr 0.01 ...
    autotune estimate hf:configs/llama-1b.json --seq-len 2048 --budget 80GiB --lora-rank 16 --weights-dtype bf16

PATH is a ``config.json`` or a directory holding one; nothing is downloaded and no weights are read
(memory does not depend on their values). The task is:

- model: the class the config's ``architectures`` names, or ``?class=NAME`` (``--hf-class``), built by
  its ``_from_config`` as transformers' ``Auto*.from_config`` does; with neither,
  ``AutoModelForCausalLM.from_config(config)``. Exactly transformers' defaults, its attention
  implementation included (recorded in the tags, since sdpa and eager differ in memory and not in
  the module tree the fingerprint sees);
- batch, by the class's family (the ``MODEL_FOR_*_MAPPING_NAMES`` of transformers that holds it):
  causal and masked LM: token ids (m, L) with ``labels`` equal to them; sequence classification:
  ``input_ids`` and an all-ones ``attention_mask`` (m, L), ``labels`` (m,) in ``range(num_labels)``;
  token classification: the same with ``labels`` (m, L); sequence-to-sequence: ``input_ids`` and
  ``labels`` (m, L); all sequence-aware, ``batch(m, seq_len=L)``. Image classification:
  ``pixel_values`` (m, channels, image_size, image_size) and ``labels`` (m,), ``batch(m)``;
- loss: the model's own ``output.loss``; ``loss_sum`` multiplies it back by the count it averaged
  over (m x (L - 1) shifted labels for a causal LM), so ``autotune verify`` normalizes groups exactly;
- optimizer: AdamW (the probe's default) unless ``?optimizer=SPEC`` (``NAME[:key=value,...]``: a
  ``torch.optim`` class, ``package.module.Class`` or a recipe, ``adafactor``, ``adamw8bit``, ``adamw4bit``;
  autotune/tasks/optimizers.py) and/or ``?lr=X`` say otherwise; ``?zero_grad=keep`` keeps the gradients
  allocated between steps (``zero_grad(set_to_none=False)``);
- LoRA (``?lora_rank=R``, with ``lora_alpha`` (default 2R), ``lora_targets`` (comma list; default
  peft's own for the model type) and ``lora_dropout`` (default 0)): ``peft.get_peft_model`` over the
  model, with the peft task type of its family, so the base is frozen (no gradients, no optimizer
  state) and a classifier's head is trained (peft's ``modules_to_save``); ``lora_targets=all-linear`` adapts every
  linear module but the output layer (peft's shorthand, Axolotl's ``lora_target_linear``), resolved into their names;
- quantization (``?quantize=nf4``, with LoRA only): the base's linear layers in 4-bit NF4 as bitsandbytes holds
  them under transformers' ``BitsAndBytesConfig``, prepared by peft's ``prepare_model_for_kbit_training``
  (QLoRA; autotune/tasks/quantize.py); the tag ``quantize`` and the name's ``-nf4`` say it;
- weights (``?weights_dtype=bf16|fp16``): the model built in that dtype (``from_config(dtype=)``, as
  ``from_pretrained(dtype=)`` loads it), its gradients and optimizer state following; peft keeps LoRA
  adapters in fp32 over a bf16 base, as it does by default;
- name: the config's ``model_type``, the family when not a causal LM, its parameter count, e.g.
  ``llama-15M``, ``bert-seq-cls-4.4M``, ``llama-1.2B-lora16-bf16``.

The CLI's ``--optimizer``, ``--lr``, ``--zero-grad``, ``--hf-class``, ``--lora-*``, ``--quantize`` and
``--weights-dtype`` write these options into the spec (:func:`with_options`), so that the spec alone rebuilds
the task in another process (``--device all``, fleet workers, estimate lanes). The class and family (when not
a causal LM), the LoRA options and the quantization are tags of the task, so they enter the fingerprint; the
weights' dtype is the task's ``weights_dtype`` (a tag too, and the parameters' dtypes).

Importing this module imports neither torch nor transformers; :func:`hf_task` imports both.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import TaskError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autotune.tasks.task import OptimizerFactory, ProbeTask

__all__ = [
    "ALL_LINEAR",
    "FAMILIES",
    "HF_PREFIX",
    "LoraOptions",
    "WEIGHTS_DTYPES",
    "hf_task",
    "is_hf_spec",
    "load_hf_spec",
    "parameter_count_text",
    "with_options",
]

HF_PREFIX = "hf:"
# --lora-targets all-linear: every linear module but the output layer (peft's shorthand, Axolotl's lora_target_linear).
ALL_LINEAR = "all-linear"
_OPTIONS = (
    "optimizer",
    "lr",
    "class",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "lora_dropout",
    "weights_dtype",
    "zero_grad",
    "quantize",
)
_LORA_OPTIONS = ("lora_alpha", "lora_targets", "lora_dropout")
# The spec's option -> the CLI flag that writes it (for messages that name what the user typed).
_FLAGS = {
    "optimizer": "--optimizer",
    "lr": "--lr",
    "class": "--hf-class",
    "lora_rank": "--lora-rank",
    "lora_alpha": "--lora-alpha",
    "lora_targets": "--lora-targets",
    "lora_dropout": "--lora-dropout",
    "weights_dtype": "--weights-dtype",
    "zero_grad": "--zero-grad",
    "quantize": "--quantize",
}
WEIGHTS_DTYPES = ("fp32", "bf16", "fp16")
# A ValueError of transformers can run to thousands of characters (every model type it knows).
_REASON_CHARS = 240
# Layer counts past this are refused before the model is built: no published model has more than a few hundred,
# and building a million layers even on meta takes minutes with nothing to say.
_MAX_LAYERS = 10_000
# The config's keys that count layers, as the model families spell them.
_LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "encoder_layers", "decoder_layers", "num_decoder_layers")
# torch takes a dimension as a C long long: a larger integer in a config overflows deep in its tensor factory.
_MAX_DIMENSION = 2**63 - 1


@dataclass(frozen=True)
class _Family:
    """What autotune knows of one kind of head: where transformers lists its classes, how it is
    batched, the peft task type LoRA wraps it with, and the short name the task's name carries."""

    name: str
    mapping: str  # transformers.models.auto.modeling_auto.<mapping>: model_type -> class name(s)
    short: str
    peft_task_type: str | None
    sequence_aware: bool = True


FAMILIES = (
    _Family("causal-lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "", "CAUSAL_LM"),
    # Before masked LM: transformers lists BART's ForConditionalGeneration under both.
    _Family("seq2seq", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq", "SEQ_2_SEQ_LM"),
    _Family("masked-lm", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "mlm", None),
    _Family("sequence-classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "seq-cls", "SEQ_CLS"),
    _Family("token-classification", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-cls", "TOKEN_CLS"),
    _Family("image-classification", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image-cls", None, False),
)
_CAUSAL_LM = FAMILIES[0]


@dataclass(frozen=True)
class LoraOptions:
    """LoRA over an hf: model (peft's ``LoraConfig``): rank, alpha (default 2 x rank), the module
    names it adapts (None: peft's default for the model type) and the adapters' dropout."""

    rank: int
    alpha: float | None = None
    targets: tuple[str, ...] | None = None
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise TaskError(f"--lora-rank must be a positive integer, got {self.rank!r}")
        if self.alpha is not None and not self.alpha > 0:
            raise TaskError(f"--lora-alpha must be positive, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise TaskError(f"--lora-dropout must be in [0, 1), got {self.dropout!r}")
        if self.targets is not None and (not self.targets or not all(self.targets)):
            raise TaskError(f"--lora-targets needs module names (q_proj,v_proj), got {','.join(self.targets)!r}")

    @property
    def scaled_alpha(self) -> float:
        return float(2 * self.rank) if self.alpha is None else float(self.alpha)


def is_hf_spec(spec: str) -> bool:
    """Whether a task spec names a Hugging Face config (``hf:PATH``)."""
    return spec.startswith(HF_PREFIX)


def _number_text(value: float) -> str:
    return repr(float(value))


def with_options(
    spec: str,
    *,
    optimizer: str | None = None,
    lr: float | None = None,
    hf_class: str | None = None,
    lora_rank: int | None = None,
    lora_alpha: float | None = None,
    lora_targets: str | None = None,
    lora_dropout: float | None = None,
    weights_dtype: str | None = None,
    zero_grad: str | None = None,
    quantize: str | None = None,
) -> str:
    """The ``hf:`` spec with the options written into it (``hf:PATH?optimizer=SGD&lr=0.01&lora_rank=16``).

    Raises:
        TaskError: the spec is not an ``hf:`` spec (a task file's ProbeTask sets its own model and optimizer).
    """
    asked: dict[str, str | None] = {
        "optimizer": optimizer,
        "lr": None if lr is None else _number_text(lr),
        "class": hf_class,
        "lora_rank": None if lora_rank is None else str(int(lora_rank)),
        "lora_alpha": None if lora_alpha is None else _number_text(lora_alpha),
        "lora_targets": lora_targets,
        "lora_dropout": None if lora_dropout is None else _number_text(lora_dropout),
        "weights_dtype": weights_dtype,
        # The default writes nothing: the spec (and the task's name) stay what they were.
        "zero_grad": None if zero_grad in (None, "none") else zero_grad,
        "quantize": quantize,
    }
    given = {key: value for key, value in asked.items() if value is not None}
    if not given:
        return spec
    if not is_hf_spec(spec):
        flags = " and ".join(_FLAGS[key] for key in given)
        whose = (
            "optimizer is its own"
            if set(given) <= {"optimizer", "lr", "zero_grad"}
            else "model and optimizer are its own"
        )
        if "zero_grad" in given:
            hint = " (a ProbeTask sets zero_grad= itself)"
        elif "weights_dtype" in given:
            hint = " (a ProbeTask sets weights_dtype= itself)"
        else:
            hint = ""
        raise TaskError(f"{flags} apply to hf: tasks; {spec!r} is a ProbeTask, whose {whose}{hint}")
    path, options = _split(spec)
    options.update(given)
    return HF_PREFIX + path + ("?" + urlencode(options) if options else "")


def _float_option(options: dict[str, str], key: str, spec: str) -> float | None:
    text = options.get(key)
    if text is None:
        return None
    try:
        return float(text)
    except ValueError:
        raise TaskError(f"{key}={text!r} in {spec!r} is not a number ({_FLAGS[key]})") from None


def _lora_of(options: dict[str, str], spec: str) -> LoraOptions | None:
    rank_text = options.get("lora_rank")
    if rank_text is None:
        stray = [_FLAGS[key] for key in _LORA_OPTIONS if key in options]
        if stray:
            verb = "needs" if len(stray) == 1 else "need"
            raise TaskError(f"{' and '.join(stray)} {verb} --lora-rank R (LoRA is off without a rank)")
        return None
    try:
        rank = int(rank_text)
    except ValueError:
        raise TaskError(f"--lora-rank {rank_text!r} is not an integer") from None
    targets_text = options.get("lora_targets")
    targets = None if targets_text is None else tuple(name.strip() for name in targets_text.split(","))
    dropout = _float_option(options, "lora_dropout", spec)
    return LoraOptions(
        rank=rank,
        alpha=_float_option(options, "lora_alpha", spec),
        targets=targets,
        dropout=0.0 if dropout is None else dropout,
    )


def load_hf_spec(spec: str) -> ProbeTask:
    """The task an ``hf:PATH[?optimizer=NAME&lr=X&class=NAME&lora_rank=R&...&weights_dtype=D]`` spec
    names (what ``load_task`` calls).

    Raises:
        TaskError: no such config, not a config transformers can build the class from, an unknown
            option, optimizer, class or family, LoRA that peft refuses, or transformers (peft) missing;
            one line each.
    """
    path, options = _split(spec)
    weights_dtype = options.get("weights_dtype", "fp32")
    if weights_dtype not in WEIGHTS_DTYPES:
        raise TaskError(f"--weights-dtype {weights_dtype!r}: one of {', '.join(WEIGHTS_DTYPES)}")
    zero_grad = options.get("zero_grad", "none")
    if zero_grad not in ("none", "keep"):
        raise TaskError(f"--zero-grad {zero_grad!r}: one of none, keep")
    return hf_task(
        path,
        optimizer=options.get("optimizer"),
        lr=_float_option(options, "lr", spec),
        hf_class=options.get("class"),
        lora=_lora_of(options, spec),
        weights_dtype=weights_dtype,
        zero_grad=zero_grad,
        quantize=options.get("quantize"),
    )


def _split(spec: str) -> tuple[str, dict[str, str]]:
    if not is_hf_spec(spec):
        raise TaskError(f"{spec!r} is not an hf: spec (hf:path/to/config.json or hf:DIRECTORY)")
    path, _, query = spec[len(HF_PREFIX) :].partition("?")
    if not path:
        raise TaskError(f"{spec!r} names no config: hf:path/to/config.json or hf:DIRECTORY")
    options = dict(parse_qsl(query, keep_blank_values=True))
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise TaskError(f"{spec!r}: unknown option {', '.join(unknown)} (known: {', '.join(_OPTIONS)})")
    return path, options


# How to get a local config of a model on the hub: hf: reads local files only (no network, no token, no weights).
_GET_A_CONFIG = "hf download {repo} config.json --local-dir {folder} (huggingface_hub's CLI), then hf:{folder}"


def _config_file(path: str) -> Path:
    """The config.json hf:path names: the file itself, or the one in the folder. Raises TaskError saying which
    of the two is missing, and for what reads as a hub id, that only a local config is read and how to get one."""
    where = Path(path)
    if where.is_dir():
        if not (where / "config.json").is_file():
            raise TaskError(
                f"hf:{path}: the folder has no config.json (hf: reads a config.json, or a folder holding one)"
            )
        return where / "config.json"
    if where.is_file():
        return where
    if where.suffix == ".json" or where.is_absolute() or path.startswith("."):
        raise TaskError(f"hf:{path}: no such file (hf: reads a config.json, or a folder holding one)")
    folder = where.name.lower()
    raise TaskError(
        f"hf:{path}: no local file or folder of that name; hf: reads a local config.json (or a folder holding one), "
        "never the hub: get it with " + _GET_A_CONFIG.format(repo=path, folder=folder)
    )


def _reason(exc: BaseException) -> str:
    """exc's message on one line: every line of it joined (pydantic and transformers put the reason on the
    lines after a heading that ends in a colon), cut at _REASON_CHARS."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()] or [type(exc).__name__]
    line = " ".join(lines)
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS].rstrip() + " ..."


def _check_sizes(path: str, file: Path, values: dict[str, Any]) -> None:
    """Refuse, before transformers sees them, sizes no model can be built with in reasonable time or at all:
    a layer count past _MAX_LAYERS, an integer past what torch takes as a dimension."""
    for key, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int):
            continue
        if key in _LAYER_KEYS and value > _MAX_LAYERS:
            raise TaskError(
                f"hf:{path}: {key} {value} in {file} is above {_MAX_LAYERS} layers: building it would take minutes "
                "even without memory, and no published model has more than a few hundred"
            )
        if abs(value) > _MAX_DIMENSION:
            raise TaskError(
                f"hf:{path}: {key} {value} in {file} is above 2**63 - 1, the largest size torch takes for a dimension"
            )


def _load_config(path: str) -> Any:
    file = _config_file(path)
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskError(f"hf:{path}: {file} is not readable JSON: {_reason(exc)}") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise TaskError(f'hf:{path}: {file} has no "model_type": not a transformers config')
    _check_sizes(path, file, values)
    try:
        from transformers import AutoConfig
    except ImportError:
        raise TaskError("hf: tasks need transformers: pip install 'autotune[hf]'") from None
    model_type = values.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **values)
    except Exception as exc:  # transformers' reason, whatever its type
        raise TaskError(f"hf:{path}: transformers cannot read the config: {_reason(exc)}") from None


def parameter_count_text(count: int) -> str:
    """A parameter count as model names give it: ``15M``, ``1.2B``, ``350K``.

    >>> parameter_count_text(15_203_840), parameter_count_text(1_236_000_000), parameter_count_text(34_976)
    ('15M', '1.2B', '35K')
    """
    for unit, scale in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if count >= scale:
            value = count / scale
            text = f"{value:.1f}" if value < 10 else f"{value:.0f}"
            return text.removesuffix(".0") + unit
    return str(count)


def _optimizer_factory(spec: str | None, lr: float | None) -> OptimizerFactory | None:
    """None (the probe's AdamW) when nothing is asked; else the spec's factory (autotune/tasks/optimizers.py),
    built once on a throwaway parameter so that a refusal comes before any trial."""
    from autotune.tasks.optimizers import optimizer_factory

    if spec is None and lr is None:
        return None
    return optimizer_factory(spec or "AdamW", lr=lr)


def _check_length(seq_len: int, max_positions: int | None, least: int) -> None:
    # ValueError, not TaskError: a trial reports it as the model refusing the length, which is how the
    # probe's search for the longest length learns where the model stops.
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < least:
        why = " (one token predicts the next)" if least == 2 else ""
        raise ValueError(f"seq_len must be an integer of at least {least}{why}, got {seq_len!r}")
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} is longer than the config's max_position_embeddings {max_positions}")


def _token_batch(m: int, *, seq_len: int, vocab_size: int, max_positions: int | None) -> dict[str, torch.Tensor]:
    """Causal and masked LM: token ids (m, L) with labels equal to them."""
    import torch

    _check_length(seq_len, max_positions, 2)
    # Seeded by the shape: the same (m, L) gives the same tokens in every process and every trial.
    generator = torch.Generator().manual_seed(m * 1_000_003 + seq_len)
    input_ids = torch.randint(0, vocab_size, (m, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _classification_batch(
    m: int, *, seq_len: int, vocab_size: int, max_positions: int | None, num_labels: int, per_token: bool
) -> dict[str, torch.Tensor]:
    """Sequence (labels (m,)) and token (labels (m, L)) classification: ids and an all-ones mask (m, L)."""
    import torch

    _check_length(seq_len, max_positions, 1)
    generator = torch.Generator().manual_seed(m * 1_000_003 + seq_len)
    input_ids = torch.randint(0, vocab_size, (m, seq_len), generator=generator)
    shape = (m, seq_len) if per_token else (m,)
    # One label is regression in transformers (mean squared error over float targets).
    labels = torch.zeros(shape) if num_labels == 1 else torch.randint(0, num_labels, shape, generator=generator)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def _seq2seq_batch(m: int, *, seq_len: int, vocab_size: int, max_positions: int | None) -> dict[str, torch.Tensor]:
    """Sequence to sequence: source ids (m, L) and target ids (m, L); the model shifts the labels
    right into its decoder's inputs."""
    import torch

    _check_length(seq_len, max_positions, 1)
    generator = torch.Generator().manual_seed(m * 1_000_003 + seq_len)
    input_ids = torch.randint(0, vocab_size, (m, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (m, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": labels}


def _image_batch(m: int, *, channels: int, height: int, width: int, num_labels: int) -> dict[str, torch.Tensor]:
    """Image classification: fp32 pixel values (m, C, H, W), as an image processor gives them (the
    model casts them to its weights' dtype), and labels (m,)."""
    import torch

    generator = torch.Generator().manual_seed(m * 1_000_003)
    pixel_values = torch.randn((m, channels, height, width), generator=generator)
    labels = torch.zeros(m) if num_labels == 1 else torch.randint(0, num_labels, (m,), generator=generator)
    return {"pixel_values": pixel_values, "labels": labels}


def _model_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = model(**batch).loss
    if loss is None:
        raise TaskError(f"{type(model).__name__} returned no loss for labels")
    return loss  # type: ignore[no-any-return]


def _shifted_count(batch: dict[str, torch.Tensor]) -> int:
    # A causal LM's loss is the mean over the shifted labels: m x (L - 1) of them, none ignored.
    labels = batch["labels"]
    return int(labels.shape[0] * (labels.shape[1] - 1))


def _label_count(batch: dict[str, torch.Tensor]) -> int:
    # Every other family averages over every label it was given (none is -100 here).
    return int(batch["labels"].numel())


def _loss_sum(
    count: Callable[[dict[str, torch.Tensor]], int], model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, int]:
    supervised = count(batch)
    return _model_loss(model, batch) * supervised, supervised


def _shard_classes(model: nn.Module) -> tuple[type[nn.Module], ...] | None:
    names: Iterable[str] = getattr(model, "_no_split_modules", None) or ()
    wanted = set(names)
    found = {type(module) for module in model.modules() if type(module).__name__ in wanted}
    return tuple(sorted(found, key=lambda cls: cls.__name__)) or None


def _known_families() -> str:
    return ", ".join(family.name for family in FAMILIES)


def _family_of(class_name: str) -> _Family | None:
    from transformers.models.auto import modeling_auto

    for family in FAMILIES:
        mapping: dict[str, Any] = getattr(modeling_auto, family.mapping, {})
        for names in mapping.values():
            if class_name == names or (isinstance(names, (tuple, list)) and class_name in names):
                return family
    return None


def _model_class(where: str, config: Any, hf_class: str | None) -> tuple[Any, _Family]:
    """The class to build (None: AutoModelForCausalLM's choice) and its family."""
    import transformers

    if hf_class is not None:
        name, said_by = hf_class, f"--hf-class {hf_class}"
    elif getattr(config, "architectures", None):
        name = str(config.architectures[0])
        said_by = f"hf:{where}: the config's architectures {name}"
    else:
        return None, _CAUSAL_LM
    try:
        cls = getattr(transformers, name, None)
    except Exception:  # the lazy module failed to import that model's code
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise TaskError(f"{said_by}: transformers knows no model class {name!r} (e.g. LlamaForCausalLM)")
    family = _family_of(name)
    if family is None:
        raise TaskError(
            f"{said_by}: autotune cannot batch {name}: it batches the families {_known_families()} "
            "(--hf-class NAME picks another head)"
        )
    config_class = getattr(cls, "config_class", None)
    if isinstance(config_class, type) and not isinstance(config, config_class):
        raise TaskError(f"{said_by}: {name} takes a {config_class.__name__}, the config is a {type(config).__name__}")
    return cls, family


def _max_positions(config: Any, family: _Family) -> int | None:
    """The longest sequence a token family's model takes (its config's max_position_embeddings), None elsewhere."""
    if family.name == "image-classification":
        return None
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


def _batch_factory(family: _Family, config: Any, where: str) -> Callable[..., Any]:
    max_positions = getattr(config, "max_position_embeddings", None)
    positions = int(max_positions) if isinstance(max_positions, int) else None
    if family.name == "image-classification":
        size = getattr(config, "image_size", None)
        height, width = (size, size) if isinstance(size, int) else tuple(size or (0, 0))
        if not (isinstance(height, int) and isinstance(width, int) and height > 0 and width > 0):
            raise TaskError(f"hf:{where}: an image classifier's config needs an image_size, got {size!r}")
        return functools.partial(
            _image_batch,
            channels=int(getattr(config, "num_channels", 3)),
            height=height,
            width=width,
            num_labels=int(config.num_labels),
        )
    vocab_size = int(config.vocab_size)
    if family.name in ("causal-lm", "masked-lm"):
        return functools.partial(_token_batch, vocab_size=vocab_size, max_positions=positions)
    if family.name == "seq2seq":
        return functools.partial(_seq2seq_batch, vocab_size=vocab_size, max_positions=positions)
    return functools.partial(
        _classification_batch,
        vocab_size=vocab_size,
        max_positions=positions,
        num_labels=int(config.num_labels),
        per_token=family.name == "token-classification",
    )


def _lora_wrapper(lora: LoraOptions, family: _Family) -> Callable[[nn.Module], nn.Module]:
    try:
        import peft
    except ImportError:
        raise TaskError("--lora-rank needs peft: pip install 'autotune[hf]'") from None
    config = peft.LoraConfig(
        r=lora.rank,
        lora_alpha=lora.scaled_alpha,  # type: ignore[arg-type]  # peft annotates it int; it scales by alpha / r
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets) if lora.targets is not None else None,
        task_type=family.peft_task_type,
    )

    def wrap(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            # peft asks transformers' deprecated is_gradient_checkpointing while it wraps.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            return peft.get_peft_model(model, config)  # type: ignore[arg-type,return-value]

    return wrap


def _all_linear_names(model: nn.Module) -> tuple[str, ...]:
    """``--lora-targets all-linear``: the last name of every linear module but the output embedding (the LM head),
    as Axolotl's ``lora_target_linear`` finds them (axolotl src/axolotl/loaders/adapter.py ``find_all_linear_names``:
    ``torch.nn.Linear`` and bitsandbytes' 4-bit and 8-bit linears, which subclass it) and as peft's ``all-linear``
    shorthand targets them."""
    from torch import nn

    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    names = {
        name.rpartition(".")[2]
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and module is not output and name
    }
    if not names:
        raise TaskError("--lora-targets all-linear: the model has no linear module but its output layer")
    return tuple(sorted(names))


def _lora_refusal(lora: LoraOptions, model_type: str, exc: BaseException) -> TaskError:
    text = _reason(exc)
    if lora.targets is None and "target_modules" in text:
        return TaskError(
            f"--lora-rank: peft has no default targets for model type {model_type!r}: name them with "
            "--lora-targets (e.g. q_proj,v_proj)"
        )
    if "not found in the base model" in text or "target_modules" in text:
        return TaskError(f"--lora-targets {','.join(lora.targets or ())}: {text}")
    return TaskError(f"--lora-rank {lora.rank}: peft cannot wrap the model: {text}")


def hf_task(
    path: str | Path,
    *,
    optimizer: str | None = None,
    lr: float | None = None,
    hf_class: str | None = None,
    lora: LoraOptions | None = None,
    weights_dtype: str = "fp32",
    zero_grad: str = "none",
    quantize: str | None = None,
) -> ProbeTask:
    """A ProbeTask for the model that a Hugging Face config describes.

    Args:
        path: a ``config.json``, or a directory holding one.
        optimizer: an optimizer spec ``NAME[:key=value,...]`` (``"SGD"``, ``"AdamW:fused=true"``,
            ``"package.module.Class"``, ``"adamw8bit"``: autotune/tasks/optimizers.py); None is AdamW.
        lr: the learning rate given to the optimizer; None leaves the optimizer's default.
        hf_class: a transformers model class name; None is the config's ``architectures`` or, without
            one, the causal LM.
        lora: LoRA over the model (peft); None trains every parameter.
        weights_dtype: "fp32", "bf16" or "fp16": the dtype the model is built (and held) in.
        zero_grad: "none" (``set_to_none=True``) or "keep" (the gradients stay allocated between steps).
        quantize: "nf4": the base's linear layers in 4-bit as bitsandbytes holds them, under LoRA (QLoRA;
            autotune/tasks/quantize.py); None keeps them in ``weights_dtype``.

    Returns:
        The task; ``task.batch(m, seq_len=L)`` needs a length (but for an image classifier's).

    Raises:
        TaskError: one line with the reason (no config, transformers' own reason when it cannot
            build the class from it, an unknown class or family, peft's refusal, a bad optimizer,
            transformers or peft not installed).

    """
    import torch

    from autotune.tasks.task import DTYPES, ProbeTask

    where = str(path)
    config = _load_config(where)
    model_class, family = _model_class(where, config, hf_class)
    if family.name == "sequence-classification" and getattr(config, "pad_token_id", None) is None:
        raise TaskError(
            f"hf:{where}: {model_class.__name__} finds each sequence's last token by the config's pad_token_id, "
            'which is unset: set "pad_token_id" in the config'
        )
    if family.name == "seq2seq" and getattr(config, "decoder_start_token_id", None) is None:
        raise TaskError(
            f"hf:{where}: {model_class.__name__} starts its decoder's inputs with the config's "
            'decoder_start_token_id, which is unset: set "decoder_start_token_id" in the config'
        )
    dtype = DTYPES[weights_dtype]
    wrap = _lora_wrapper(lora, family) if lora is not None else None
    if quantize is not None:
        from autotune.tasks.quantize import quantization_of, quantize_model, require_bitsandbytes

        quantization_of(quantize)
        refuse_composition(Dimensions(quantize=quantize, lora=lora is not None), TaskError)
        require_bitsandbytes(quantize)

    def base() -> nn.Module:
        if model_class is None:
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-any-return]
        return model_class._from_config(config, dtype=dtype)  # type: ignore[no-any-return]

    def model() -> nn.Module:
        built = base() if quantize is None else quantize_model(base(), quantize)
        return built if wrap is None else wrap(built)

    what = "causal LM" if model_class is None else model_class.__name__
    try:
        # On meta: the size for the name, transformers' choice of attention and its block classes,
        # and a refusal now rather than in the first trial; no memory is spent.
        with torch.device("meta"):
            shape_only = base()
    except Exception as exc:
        raise TaskError(f"hf:{where}: transformers cannot build a {what} from it: {_reason(exc)}") from None
    parameters = sum(p.numel() for p in shape_only.parameters())
    model_type = str(config.model_type)
    attention = str(getattr(shape_only.config, "_attn_implementation", None) or "default")
    tags: dict[str, Any] = {"hf_model_type": model_type, "attn_implementation": attention}
    # A causal LM's tags stay what they were, so that its profiles stored before heads still match.
    if family is not _CAUSAL_LM:
        tags.update(hf_class=type(shape_only).__name__, hf_family=family.name)
    name = "-".join(part for part in (model_type, family.short, parameter_count_text(parameters)) if part)
    shard_classes = _shard_classes(shape_only)
    if quantize is not None:
        try:
            with torch.device("meta"):
                shape_only = quantize_model(shape_only, quantize)
        except TaskError:
            raise
        except Exception as exc:
            raise TaskError(f"--quantize {quantize}: bitsandbytes cannot quantize {what}: {_reason(exc)}") from None
        tags["quantize"] = quantize
    if lora is not None and lora.targets == (ALL_LINEAR,):
        # Resolved on the meta model into the names themselves, so the fingerprint is the explicit list's.
        lora = dataclasses.replace(lora, targets=_all_linear_names(shape_only))
        wrap = _lora_wrapper(lora, family)
    if lora is not None and wrap is not None:
        try:
            with torch.device("meta"):
                wrapped = wrap(shape_only)
        except Exception as exc:
            raise _lora_refusal(lora, model_type, exc) from None
        targets = getattr(wrapped, "peft_config", {}).get("default")
        target_names = sorted(getattr(targets, "target_modules", None) or ())
        tags.update(
            lora_rank=lora.rank,
            lora_alpha=lora.scaled_alpha,
            lora_dropout=lora.dropout,
            lora_targets=",".join(target_names),
        )
        name += f"-lora{lora.rank}"
    if quantize is not None:
        name += f"-{quantize}"
    if weights_dtype != "fp32":
        name += f"-{weights_dtype}"
    count = _shifted_count if family is _CAUSAL_LM else _label_count
    return ProbeTask(
        name=name,
        model=model,
        batch=_batch_factory(family, config, where),
        loss=_model_loss,
        loss_sum=functools.partial(_loss_sum, count),
        optimizer=_optimizer_factory(optimizer, lr),
        tags=tags,
        shard_classes=shard_classes,
        weights_dtype=weights_dtype,
        zero_grad=zero_grad,
        max_seq_len=_max_positions(config, family),
    )
