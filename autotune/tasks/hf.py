"""``hf:PATH`` task specs: a causal LM from a Hugging Face ``config.json``, no task file to write.

    autotune probe hf:configs/llama-tiny.json --seq-len 512,2048 --budget 24GiB --target-batch 256
    autotune probe hf:path/to/checkpoint_dir --seq-len 1024 --optimizer SGD --lr 0.01 ...

PATH is a ``config.json`` or a directory holding one; nothing is downloaded and no weights are read
(memory does not depend on their values). The task is:

- model: ``AutoModelForCausalLM.from_config(config)``, exactly: transformers' defaults, its attention
  implementation included (recorded in the tags, since sdpa and eager differ in memory and not in
  the module tree the fingerprint sees);
- batch: ``batch(m, seq_len=L)``, random token ids of shape (m, L) with ``labels`` equal to them, so
  every position but the first of each sequence is supervised; the task is sequence-aware;
- loss: the model's own ``output.loss``; ``loss_sum`` multiplies it back by the m x (L - 1) labels it
  averaged over, so ``autotune verify`` normalizes groups exactly;
- optimizer: AdamW (the probe's default) unless ``?optimizer=NAME`` (a ``torch.optim`` class, or
  ``package.module.Class``) and/or ``?lr=X`` say otherwise; the CLI's ``--optimizer``/``--lr`` write them
  into the spec (:func:`with_options`), so that the spec alone rebuilds the task in another process
  (``--device all``, fleet workers);
- name: the config's ``model_type`` and its parameter count, e.g. ``llama-15M``.

Importing this module imports neither torch nor transformers; :func:`hf_task` imports both.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qsl, urlencode

from autotune.core.errors import TaskError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from autotune.tasks.task import OptimizerFactory, ProbeTask

__all__ = ["HF_PREFIX", "hf_task", "is_hf_spec", "load_hf_spec", "parameter_count_text", "with_options"]

HF_PREFIX = "hf:"
_OPTIONS = ("optimizer", "lr")
# A ValueError of transformers can run to thousands of characters (every model type it knows).
_REASON_CHARS = 240


def is_hf_spec(spec: str) -> bool:
    """Whether a task spec names a Hugging Face config (``hf:PATH``)."""
    return spec.startswith(HF_PREFIX)


def with_options(spec: str, *, optimizer: str | None = None, lr: float | None = None) -> str:
    """The ``hf:`` spec with the optimizer options written into it (``hf:PATH?optimizer=SGD&lr=0.01``).

    Raises:
        TaskError: the spec is not an ``hf:`` spec (a task file's ProbeTask sets its own optimizer).
    """
    if optimizer is None and lr is None:
        return spec
    if not is_hf_spec(spec):
        raise TaskError(f"--optimizer and --lr apply to hf: tasks; {spec!r} is a ProbeTask, whose optimizer is its own")
    path, options = _split(spec)
    if optimizer is not None:
        options["optimizer"] = optimizer
    if lr is not None:
        options["lr"] = repr(float(lr))
    return HF_PREFIX + path + ("?" + urlencode(options) if options else "")


def load_hf_spec(spec: str) -> ProbeTask:
    """The task an ``hf:PATH[?optimizer=NAME&lr=X]`` spec names (what ``load_task`` calls).

    Raises:
        TaskError: no such config, not a config transformers can build a causal LM from, an unknown
            option or optimizer, or transformers missing; one line each.
    """
    path, options = _split(spec)
    lr_text = options.get("lr")
    lr: float | None = None
    if lr_text is not None:
        try:
            lr = float(lr_text)
        except ValueError:
            raise TaskError(f"lr={lr_text!r} in {spec!r} is not a number") from None
    return hf_task(path, optimizer=options.get("optimizer"), lr=lr)


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


def _config_file(path: str) -> Path:
    where = Path(path)
    if where.is_dir():
        where = where / "config.json"
    if not where.is_file():
        raise TaskError(f"hf:{path}: no config.json there")
    return where


def _reason(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line = lines[0]
    return line if len(line) <= _REASON_CHARS else line[:_REASON_CHARS].rstrip() + " ..."


def _load_config(path: str) -> Any:
    file = _config_file(path)
    try:
        values = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TaskError(f"hf:{path}: {file} is not readable JSON: {_reason(exc)}") from None
    if not isinstance(values, dict) or not isinstance(values.get("model_type"), str):
        raise TaskError(f'hf:{path}: {file} has no "model_type": not a transformers config')
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


def _optimizer_factory(name: str | None, lr: float | None) -> OptimizerFactory | None:
    """None (the probe's AdamW) when nothing is asked; else a factory, tried once on a throwaway parameter."""
    import torch

    if name is None and lr is None:
        return None
    name = name or "AdamW"
    if "." in name:
        module_name, _, class_name = name.rpartition(".")
        try:
            cls = getattr(importlib.import_module(module_name), class_name, None)
        except ImportError as exc:
            raise TaskError(f"optimizer {name!r}: cannot import {module_name!r}: {_reason(exc)}") from None
    else:
        known = {key.lower(): value for key, value in vars(torch.optim).items() if isinstance(value, type)}
        cls = known.get(name.lower())
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise TaskError(f"optimizer {name!r} is not a torch.optim.Optimizer class (e.g. AdamW, SGD, or module.Class)")
    optimizer_class: Any = cls  # a subclass of Optimizer, whose own __init__ takes lr
    factory: OptimizerFactory = optimizer_class if lr is None else functools.partial(optimizer_class, lr=lr)
    try:
        factory([torch.nn.Parameter(torch.zeros(1))])
    except Exception as exc:
        raise TaskError(f"optimizer {name!r} cannot be built with lr={lr}: {_reason(exc)}") from None
    return factory


def _token_batch(m: int, *, seq_len: int, vocab_size: int, max_positions: int | None) -> dict[str, torch.Tensor]:
    import torch

    # ValueError, not TaskError: a trial reports it as the model refusing the length, which is how the
    # probe's search for the longest length learns where the model stops.
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an integer of at least 2 (one token predicts the next), got {seq_len!r}")
    if max_positions is not None and seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} is longer than the config's max_position_embeddings {max_positions}")
    # Seeded by the shape: the same (m, L) gives the same tokens in every process and every trial.
    generator = torch.Generator().manual_seed(m * 1_000_003 + seq_len)
    input_ids = torch.randint(0, vocab_size, (m, seq_len), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def _causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = model(**batch).loss
    if loss is None:
        raise TaskError(f"{type(model).__name__} returned no loss for labels")
    return loss  # type: ignore[no-any-return]


def _causal_lm_loss_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    # output.loss is the mean over the shifted labels: m x (L - 1) of them, none ignored.
    labels = batch["labels"]
    count = labels.shape[0] * (labels.shape[1] - 1)
    return _causal_lm_loss(model, batch) * count, count


def _shard_classes(model: nn.Module) -> tuple[type[nn.Module], ...] | None:
    names: Iterable[str] = getattr(model, "_no_split_modules", None) or ()
    wanted = set(names)
    found = {type(module) for module in model.modules() if type(module).__name__ in wanted}
    return tuple(sorted(found, key=lambda cls: cls.__name__)) or None


def hf_task(path: str | Path, *, optimizer: str | None = None, lr: float | None = None) -> ProbeTask:
    """A sequence-aware ProbeTask for the causal LM that a Hugging Face config describes.

    Args:
        path: a ``config.json``, or a directory holding one.
        optimizer: a ``torch.optim`` class name (``"SGD"``) or ``"package.module.Class"``; None is AdamW.
        lr: the learning rate given to the optimizer; None leaves the optimizer's default.

    Returns:
        The task; ``task.batch(m, seq_len=L)`` needs a length.

    Raises:
        TaskError: one line with the reason (no config, transformers' own reason when it cannot
            build a causal LM from it, a bad optimizer, transformers not installed).

    """
    import torch

    from autotune.tasks.task import ProbeTask

    where = str(path)
    config = _load_config(where)
    from transformers import AutoModelForCausalLM

    try:
        # On meta: the size for the name, transformers' choice of attention and its block classes,
        # and a refusal now rather than in the first trial; no memory is spent.
        with torch.device("meta"):
            shape_only = AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        raise TaskError(f"hf:{where}: transformers cannot build a causal LM from it: {_reason(exc)}") from None
    parameters = sum(p.numel() for p in shape_only.parameters())
    model_type = str(config.model_type)
    attention = str(getattr(shape_only.config, "_attn_implementation", None) or "default")
    vocab_size = int(config.vocab_size)
    max_positions = getattr(config, "max_position_embeddings", None)

    def model() -> nn.Module:
        return AutoModelForCausalLM.from_config(config)  # type: ignore[no-any-return]

    return ProbeTask(
        name=f"{model_type}-{parameter_count_text(parameters)}",
        model=model,
        batch=functools.partial(
            _token_batch,
            vocab_size=vocab_size,
            max_positions=int(max_positions) if isinstance(max_positions, int) else None,
        ),
        loss=_causal_lm_loss,
        loss_sum=_causal_lm_loss_sum,
        optimizer=_optimizer_factory(optimizer, lr),
        tags={"hf_model_type": model_type, "attn_implementation": attention},
        shard_classes=_shard_classes(shape_only),
    )
