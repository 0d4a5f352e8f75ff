"""The loss as a language model's job computes it (``--loss``; the names: autotune/core/loss_names.py).

A transformers causal LM computes its loss in its forward: the head over every position (the logits whole, m x L x
vocabulary), then the cross entropy. The jobs people run often do not: TRL's SFTTrainer computes a chunked NLL by
default, and Liger-Kernel fuses the head with the loss. What each keeps decides the peak, so the trials run the
job's own form, in plain torch (it runs on the CPU, on fake tensors and on emulated cards; Liger itself needs Triton
and a card):

- ``chunked:N``, TRL's ``_chunked_cross_entropy_loss`` (trl/trainer/sft_trainer.py): the base model's hidden states
  shifted and flattened, the supervised tokens packed to the front (an ``argsort`` and a gather: a copy of the hidden
  states, which every chunk's checkpoint keeps for its backward), then for each chunk of N tokens, under
  non-reentrant gradient checkpointing, the head in fp32, ``log_softmax``, ``nll_loss`` and TRL's two metrics
  (argmax accuracy and entropy). The forward keeps no logits; the backward recomputes one chunk at a time.
- ``fused-linear``, Liger's ``LigerFusedLinearCrossEntropyFunction`` (src/liger_kernel/ops/fused_linear_cross_
  entropy.py) as its causal-LM forward calls it (``LigerForCausalLMLoss``: labels padded with -100 and shifted,
  every position flattened): one autograd function whose forward allocates the gradients of the hidden states
  (BT x H) and of the head's weight (V x H), walks chunks of ``next_power_of_2(BT / ceil(V / H))`` rows, each chunk's
  logits overwritten in place by the loss's gradient (Liger's Triton kernel, here in-place torch ops) and multiplied
  into both gradients, and saves only the two gradients; its backward scales them in place.

Both replace the model's ``forward`` on the instance, as TRL's ``_patch_chunked_ce_lm_head`` does, so that every
wrapper (DDP, FSDP2's root hooks, torch.compile) calls through it; ``model(**batch)`` with labels returns the loss and
no logits. A peft model is patched at its causal LM (``get_base_model()``), whose forward peft's calls end in.

Where each differs from its library, for memory: the chunk loops read their bounds off the shapes (every label of
the trial's batches is supervised, so TRL's count of supervised tokens, a scalar read, is every token; a fake trial
has no values to read), TRL's early return for a batch with no supervised token is not taken, Liger's count of
supervised tokens, which it reads (``.item()``), is held as a tensor (8 bytes more while its forward runs), and
Liger's backward scales even where the upstream gradient is 1 (in place: no memory either way). Liger's Triton kernel
holds nothing beside a chunk's logits; its torch form here holds one value per row of the chunk besides.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.core.errors import TaskError
from autotune.core.loss_names import PLAIN_LOSS, chunk_tokens

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "WithLoss",
    "apply_loss",
    "check_loss",
    "chunked_nll",
    "factory_refusal",
    "fused_linear_causal_lm_loss",
    "loss_refusal",
]

# The label transformers and both libraries ignore.
IGNORE_INDEX = -100
# Config keys that change the logits after the head (Gemma's softcapping, Cohere's scale) or add a loss beside the
# cross entropy (a mixture of experts' router loss): the losses here do not model them.
_UNMODELLED_CONFIG = {
    "final_logit_softcapping": lambda value: value is not None,
    "logit_scale": lambda value: value not in (None, 1, 1.0),
    "output_router_logits": lambda value: bool(value),
}


@dataclass(frozen=True)
class WithLoss:
    """A model factory whose model computes ``loss`` (a canonical name other than plain) in its forward: every path
    that calls ``task.model()`` (meta builds, trials, fake lanes, the emulated child) gets the job's loss."""

    factory: Callable[[], Any]
    loss: str

    def __call__(self) -> nn.Module:
        model = self.factory()
        apply_loss(model, self.loss)
        return model  # type: ignore[no-any-return]


def _causal_lm(model: nn.Module) -> nn.Module:
    """The transformers model whose forward computes the loss: a peft model's base model, else model itself."""
    inner = getattr(model, "get_base_model", None)
    return inner() if callable(inner) else model  # type: ignore[no-any-return]


def _causal_lm_classes() -> set[str]:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return set()
    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def loss_refusal(model: nn.Module, loss: str) -> str | None:
    """Why model cannot compute loss in its forward (one line naming the flag and the model), or None where it can:
    a transformers causal LM whose head is a plain ``nn.Linear`` over the base model's last hidden states, with no
    logit softcapping, scale or router loss."""
    from torch import nn

    if loss == PLAIN_LOSS:
        return None
    lm = _causal_lm(model)
    name = type(lm).__name__
    if name not in _causal_lm_classes() or getattr(lm, "base_model", lm) is lm:
        return (
            f"--loss {loss}: {name} has no LM head to fuse: chunked and fused-linear replace the head and cross "
            "entropy of a transformers causal LM (an hf: task of the causal-lm family); this model computes its "
            "own loss"
        )
    head = lm.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(head, nn.Linear) or hasattr(head, "base_layer"):
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        return (
            f"--loss {loss}: the LM head of {name} is a {kind}, not a plain torch Linear (an adapted or wrapped "
            "head, which TRL's chunked loss refuses too): leave lm_head out of --lora-targets"
        )
    config = getattr(lm, "config", None)
    for key, unmodelled in _UNMODELLED_CONFIG.items():
        value = getattr(config, key, None)
        if unmodelled(value):
            return f"--loss {loss}: {name}'s config sets {key} {value!r}, which autotune's losses do not model"
    return None


def factory_refusal(factory: Callable[[], Any], loss: str) -> str | None:
    """:func:`loss_refusal` of the model factory builds, built on meta (no memory); None where it cannot be built
    there (its first build says why, or refuses). Kept per factory and loss: a large model's meta build takes
    seconds, and every config that applies a loss asks."""
    try:
        return _cached_refusal(factory, loss)
    except TypeError:  # a factory that cannot be a key (an object without a hash)
        return _meta_refusal(factory, loss)


@functools.lru_cache(maxsize=32)
def _cached_refusal(factory: Callable[[], Any], loss: str) -> str | None:
    return _meta_refusal(factory, loss)


def _meta_refusal(factory: Callable[[], Any], loss: str) -> str | None:
    import torch

    try:
        with torch.device("meta"):
            model = factory()
    except Exception:
        return None
    return loss_refusal(model, loss)


def check_loss(task: Any) -> None:
    """Refuse, before any trial, a task whose model cannot compute its loss.

    Raises:
        TaskError: :func:`loss_refusal`'s line, naming the task.
    """
    loss = getattr(task, "lm_loss", PLAIN_LOSS)
    if loss == PLAIN_LOSS:
        return
    factory = task.model.factory if isinstance(task.model, WithLoss) else task.model
    refusal = factory_refusal(factory, loss)
    if refusal is not None:
        raise TaskError(f"{refusal} (task {task.name!r})")


def apply_loss(model: nn.Module, loss: str) -> None:
    """Make model's forward compute loss (a canonical name) when it is given labels, as the job's library patches it.

    Raises:
        TaskError: the model cannot (:func:`loss_refusal`).
    """
    refusal = loss_refusal(model, loss)
    if refusal is not None:
        raise TaskError(refusal)
    if loss == PLAIN_LOSS:
        return
    lm = _causal_lm(model)
    tokens = chunk_tokens(loss)
    forward = _chunked_forward(lm, tokens) if tokens is not None else _fused_forward(lm)
    lm.forward = types.MethodType(forward, lm)  # type: ignore[method-assign]


def _output(loss: torch.Tensor, outputs: Any) -> Any:
    from transformers.modeling_outputs import CausalLMOutputWithPast

    # A transformers output (a pytree node): FSDP2 registers its backward hooks on the tensors it holds.
    return CausalLMOutputWithPast(loss=loss, logits=None, hidden_states=outputs.hidden_states)


def _chunked_forward(lm: nn.Module, tokens: int) -> Callable[..., Any]:
    original = lm.forward
    head = lm.get_output_embeddings()  # type: ignore[operator]

    def forward(self: Any, input_ids: Any = None, attention_mask: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        kwargs.pop("use_cache", None)  # TRL runs the base without a cache
        outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
        loss = chunked_nll(outputs.last_hidden_state, head.weight, head.bias, labels, tokens)
        return _output(loss, outputs)

    return forward


def _fused_forward(lm: nn.Module) -> Callable[..., Any]:
    original = lm.forward
    head = lm.get_output_embeddings()  # type: ignore[operator]

    def forward(self: Any, input_ids: Any = None, attention_mask: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if labels is None:
            return original(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        # Liger's causal-LM forward passes the caller's use_cache on (None: the config's), as the plain forward does.
        outputs = self.base_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        loss = fused_linear_causal_lm_loss(outputs.last_hidden_state, head.weight, head.bias, labels)
        return _output(loss, outputs)

    return forward


def _chunk_nll(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk of TRL's chunked NLL (its ``_chunk``): the head in fp32, the summed NLL, and the metrics TRL
    computes in the same checkpointed call (accuracy and entropy), which its forward and recompute hold too."""
    import torch.nn.functional as F

    logits = hidden.float() @ weight.float().t()
    if bias is not None:
        logits = logits + bias.float()
    log_p = F.log_softmax(logits, dim=-1)
    loss = F.nll_loss(log_p, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    supervised = targets != IGNORE_INDEX
    correct = ((logits.argmax(dim=-1) == targets) & supervised).sum().float()
    entropy = (-(log_p.exp() * log_p).sum(dim=-1) * supervised).sum()
    return loss, correct, entropy


def chunked_nll(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    labels: torch.Tensor,
    tokens: int,
) -> torch.Tensor:
    """TRL's chunked next-token NLL over the base model's hidden states (m, L, H) and the head's weight (V, H), in
    chunks of ``tokens`` supervised tokens, each checkpointed; the mean over the supervised tokens."""
    import torch
    from torch.utils.checkpoint import checkpoint

    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    targets = labels[..., 1:].reshape(-1)
    supervised = targets != IGNORE_INDEX
    count = supervised.sum()
    correct = hidden.new_zeros((), dtype=torch.float32)
    entropy = hidden.new_zeros((), dtype=torch.float32)
    # TRL packs the supervised tokens to the front with a static-shape argsort and gathers them: a copy of the hidden
    # states that the chunks' checkpoints keep until their backward.
    order = supervised.to(torch.int8).argsort(descending=True, stable=True)
    hidden = hidden[order]
    targets = targets[order]
    # TRL's bound is the supervised count rounded up to whole chunks, a tensor it reads; every token of the trial's
    # batches is supervised, so it is the tokens rounded up, read off the shape (a fake trial has no values).
    padded = (count / tokens).ceil().to(torch.int64) * tokens
    stop = -(-hidden.shape[0] // tokens) * tokens
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, stop, tokens):
        chunk_loss, chunk_correct, chunk_entropy = checkpoint(
            _chunk_nll,
            hidden[start : start + tokens],
            weight,
            bias,
            targets[start : start + tokens],
            use_reentrant=False,
        )
        loss = loss + chunk_loss
        correct = correct + chunk_correct
        entropy = entropy + chunk_entropy
    del padded  # held through the loop, as TRL's is
    return loss / count


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _liger_rows(
    logits: torch.Tensor, targets: torch.Tensor, losses: torch.Tensor, count: torch.Tensor, gradients: bool
) -> None:
    """Liger's ``liger_cross_entropy_kernel`` over a chunk's rows, in place: each row's loss over ``count`` into
    ``losses`` (0 for an ignored row, reduction mean), and with ``gradients`` the logits overwritten by the loss's
    gradient, (softmax - one-hot) / count, zero on an ignored row. The kernel holds no other chunk-sized tensor; the
    temporaries here are one value per row."""
    import torch

    scale = (targets != IGNORE_INDEX).unsqueeze(1) / count
    index = targets.clamp(min=0).unsqueeze(1)
    logits.sub_(logits.amax(dim=1, keepdim=True))
    picked = logits.gather(1, index)
    logits.exp_()
    total = logits.sum(dim=1, keepdim=True)
    losses.copy_(((total.log() - picked) * scale).squeeze(1))
    if gradients:
        logits.div_(total)
        logits.scatter_add_(1, index, torch.full_like(picked, -1.0))
        logits.mul_(scale)


def _accumulates_out_dtype(grad_weight: torch.Tensor, grad_logits: torch.Tensor) -> bool:
    """Liger's test for ``torch.addmm(..., out_dtype=torch.float32, out=grad_weight)``: an fp32 gradient of the weight
    from half-precision logits on a card of compute capability 8 or more (no temporary of the weight's size)."""
    import torch

    if grad_weight.device.type != "cuda" or grad_weight.dtype != torch.float32:
        return False
    if grad_logits.dtype not in (torch.float16, torch.bfloat16):
        return False
    return torch.cuda.get_device_capability(grad_weight.device)[0] >= 8


def _fused_forward_pass(
    inputs: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Liger's ``fused_linear_cross_entropy_forward`` (reduction mean, no class weights, no z-loss): the loss, and the
    gradients of the inputs, the weight and the bias, made chunk by chunk."""
    import torch

    rows, hidden_size = inputs.shape
    vocabulary = weight.shape[0]
    growth = -(-vocabulary // hidden_size)
    chunk_rows = _next_power_of_2(-(-rows // growth))
    chunks = -(-rows // chunk_rows)
    with_gradients = inputs.requires_grad
    grad_input = torch.zeros_like(inputs)
    grad_weight = torch.zeros_like(weight) if with_gradients and weight.requires_grad else None
    grad_bias = torch.zeros_like(bias) if with_gradients and bias is not None else None
    losses = torch.zeros(rows, dtype=torch.float32, device=inputs.device)
    supervised = targets != IGNORE_INDEX
    count = supervised.sum()  # Liger reads it (.item()); a tensor here, which a fake trial can hold
    for chunk in range(chunks):
        start, end = chunk * chunk_rows, min((chunk + 1) * chunk_rows, rows)
        input_chunk = inputs[start:end]
        logits = input_chunk @ weight.t()
        if bias is not None:
            logits = logits + bias
        _liger_rows(logits, targets[start:end], losses[start:end], count, with_gradients)
        # Liger names the overwritten logits grad_logits_chunk: that name keeps this chunk's until the next chunk's
        # gradient is written, so two chunks are whole while the next one's rows are computed.
        grad_logits = logits
        if with_gradients:
            grad_input[start:end] = grad_logits @ weight
        if grad_weight is not None:
            if _accumulates_out_dtype(grad_weight, grad_logits):
                half_input = input_chunk.to(grad_logits.dtype)
                torch.addmm(grad_weight, grad_logits.t(), half_input, out_dtype=torch.float32, out=grad_weight)
            else:
                grad_weight += torch.mm(grad_logits.t(), input_chunk).float()
        if grad_bias is not None:
            torch.add(input=grad_bias, other=grad_logits.sum(dim=0), out=grad_bias, alpha=1.0)
    loss = torch.sum(losses)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None and bias is not None else None
    return loss, grad_input, grad_weight, grad_bias


@functools.cache
def _fused_function() -> Any:
    import torch

    class FusedLinearCrossEntropy(torch.autograd.Function):
        """Liger's ``LigerFusedLinearCrossEntropyFunction`` (reduction mean): the gradients made in the forward and
        saved, scaled in place by the upstream gradient in the backward."""

        @staticmethod
        def forward(ctx: Any, inputs: Any, weight: Any, targets: Any, bias: Any) -> Any:
            loss, grad_input, grad_weight, grad_bias = _fused_forward_pass(inputs, weight, targets, bias)
            ctx.save_for_backward(
                grad_input.detach(),
                grad_weight.detach() if grad_weight is not None else None,
                grad_bias.detach() if grad_bias is not None else None,
            )
            return loss

        @staticmethod
        def backward(ctx: Any, grad_output: Any) -> Any:
            grad_input, grad_weight, grad_bias = ctx.saved_tensors
            # Liger's element_mul_kernel, in place; it skips the multiply where grad_output is 1 (a scalar read).
            grad_input.mul_(grad_output)
            if grad_weight is not None:
                grad_weight.mul_(grad_output)
            if grad_bias is not None:
                grad_bias.mul_(grad_output)
            return grad_input, grad_weight, None, grad_bias

    return FusedLinearCrossEntropy


def fused_linear_causal_lm_loss(
    hidden_states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor
) -> torch.Tensor:
    """Liger's ``LigerForCausalLMLoss``: labels padded with the ignored label and shifted (every position has a
    target, the last one ignored), the hidden states (m, L, H) flattened, then the fused function."""
    import torch.nn.functional as F

    padded = F.pad(labels, (0, 1), value=IGNORE_INDEX)
    targets = padded[..., 1:].contiguous()
    inputs = hidden_states.view(-1, hidden_states.size(-1))
    return _fused_function().apply(inputs, weight, targets.view(-1), bias)  # type: ignore[no-any-return]
