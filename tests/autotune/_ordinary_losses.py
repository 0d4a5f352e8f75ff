"""The losses of --loss written out the ordinary way, as the libraries do it, sharing no code with the project's
(autotune/tasks/losses.py): the truths of tests/autotune/test_losses.py.

- TRL's chunked NLL, its ``_chunked_cross_entropy_loss`` and ``_chunk`` (trl/trainer/sft_trainer.py) as written
  there, scalar reads included (the count of supervised tokens, the early return, the loop's bound): on the CPU they
  read real values;
- Liger-Kernel's fused linear cross entropy, ``fused_linear_cross_entropy_forward`` and the autograd function around
  it (src/liger_kernel/ops/fused_linear_cross_entropy.py), its Triton kernel ``liger_cross_entropy_kernel`` written
  as the row-wise arithmetic it does in place, and ``LigerForCausalLMLoss``'s padding and shift.

``patched(model, loss)`` replaces a transformers causal LM's forward on the instance, as TRL's
``_patch_chunked_ce_lm_head`` does (and as Liger's ``apply_liger_kernel_to_llama`` does on the class), so that FSDP2's
root hooks run around it."""

from __future__ import annotations

import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_outputs import CausalLMOutputWithPast

__all__ = ["patched", "rng_states_of_chunked"]

TRL_CHUNK = 256


def _trl_chunk(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, lbl: torch.Tensor) -> Any:
    logits = h.float() @ w.float().t()
    if b is not None:
        logits = logits + b.float()
    log_p = F.log_softmax(logits, dim=-1)
    chunk_loss = F.nll_loss(log_p, lbl, ignore_index=-100, reduction="sum")
    valid = lbl != -100
    chunk_correct = ((logits.argmax(dim=-1) == lbl) & valid).sum().float()
    chunk_entropy = (-(log_p.exp() * log_p).sum(dim=-1) * valid).sum()
    return chunk_loss, chunk_correct, chunk_entropy


def trl_chunked_loss(
    hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, chunk_size: int, labels: torch.Tensor, bias: Any = None
) -> torch.Tensor:
    hidden = hidden_states[..., :-1, :].reshape(-1, hidden_states.size(-1))
    labels = labels[..., 1:].reshape(-1)
    valid = labels != -100
    n_valid_tensor = valid.sum()
    correct = hidden.new_zeros((), dtype=torch.float32)
    entropy_sum = hidden.new_zeros((), dtype=torch.float32)
    if n_valid_tensor == 0:
        return (hidden_states.float().sum() + lm_head_weight.float().sum()) * 0.0
    order = valid.to(torch.int8).argsort(descending=True, stable=True)
    hidden = hidden[order]
    labels = labels[order]
    n_padded = (n_valid_tensor / chunk_size).ceil().to(torch.int64) * chunk_size
    loss = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n_padded, chunk_size):
        chunk_loss, chunk_correct, chunk_entropy = checkpoint(
            _trl_chunk,
            hidden[start : start + chunk_size],
            lm_head_weight,
            bias,
            labels[start : start + chunk_size],
            use_reentrant=False,
        )
        loss = loss + chunk_loss
        correct = correct + chunk_correct
        entropy_sum = entropy_sum + chunk_entropy
    return loss / n_valid_tensor


def _next_power_of_2(n: int) -> int:
    power = 1
    while power < n:
        power *= 2
    return power


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _liger_kernel(x: torch.Tensor, y: torch.Tensor, loss_out: torch.Tensor, n_non_ignore: Any, grads: bool) -> None:
    """liger_cross_entropy_kernel, reduction mean, in torch: row losses into loss_out, and the gradient of the
    logits written over them (softmax minus one-hot, over the supervised count; zero on an ignored row)."""
    keep = (y != -100).unsqueeze(1) / n_non_ignore
    index = y.clamp(min=0).unsqueeze(1)
    x.sub_(x.amax(dim=1, keepdim=True))
    x_y = torch.gather(x, 1, index)
    x.exp_()
    d = x.sum(dim=1, keepdim=True)
    loss_out.copy_(((torch.log(d) - x_y) * keep).squeeze(1))
    if grads:
        x.div_(d)
        x.scatter_add_(1, index, -torch.ones_like(x_y))
        x.mul_(keep)


def liger_forward(_input: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Any) -> Any:
    device = _input.device
    input_requires_grad = _input.requires_grad
    weight_needs_grad = weight.requires_grad
    BT, H = _input.shape  # noqa: N806
    V = weight.shape[0]  # noqa: N806
    inc_factor = _cdiv(V, H)
    chunk_size = _next_power_of_2(_cdiv(BT, inc_factor))
    num_chunks = _cdiv(BT, chunk_size)
    grad_input = torch.zeros_like(_input, device=device)
    if input_requires_grad:
        grad_weight = torch.zeros_like(weight, device=device) if weight_needs_grad else None
        grad_bias = torch.zeros_like(bias, device=device) if bias is not None else None
    else:
        grad_weight = grad_bias = None
    loss_1d = torch.zeros(BT, dtype=torch.float32, device=device)
    target_mask = target != -100
    # A tensor where Liger reads the count (.item(), a sync it has a TODO to avoid): the probe holds it so, as a fake
    # trial has no value to read; 8 bytes more than Liger's while the forward runs.
    total_n_non_ignore = target_mask.sum()
    for chunk_id in range(num_chunks):
        start_idx = chunk_id * chunk_size
        end_idx = min((chunk_id + 1) * chunk_size, BT)
        _input_chunk = _input[start_idx:end_idx]
        logits_chunk = _input_chunk @ weight.t()
        if bias is not None:
            logits_chunk = logits_chunk + bias
        target_chunk = target[start_idx:end_idx]
        loss_1d_slice = loss_1d[start_idx:end_idx]
        logits_chunk = logits_chunk.contiguous()
        target_chunk = target_chunk.contiguous()
        _liger_kernel(logits_chunk, target_chunk, loss_1d_slice, total_n_non_ignore, input_requires_grad)
        loss_1d[start_idx:end_idx] = loss_1d_slice
        grad_logits_chunk = logits_chunk
        if input_requires_grad:
            grad_input[start_idx:end_idx] = grad_logits_chunk @ weight
        if grad_weight is not None and input_requires_grad:
            grad_weight += torch.mm(grad_logits_chunk.t(), _input_chunk).float()
        if bias is not None and input_requires_grad:
            torch.add(input=grad_bias, other=grad_logits_chunk.sum(dim=0), out=grad_bias, alpha=1.0)
    loss = torch.sum(loss_1d)
    grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
    grad_bias = grad_bias.to(bias.dtype) if grad_bias is not None else None
    return loss, grad_input, grad_weight, grad_bias


class LigerFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, _input: Any, weight: Any, target: Any, bias: Any = None) -> Any:
        loss, grad_input, grad_weight, grad_bias = liger_forward(_input, weight, target, bias)
        ctx.save_for_backward(
            grad_input.detach(),
            grad_weight.detach() if grad_weight is not None else None,
            grad_bias.detach() if grad_bias is not None else None,
        )
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: Any) -> Any:
        grad_input, grad_weight, grad_bias = ctx.saved_tensors
        # fused_linear_cross_entropy_backward: element_mul_kernel scales in place (skipped when grad_output is 1,
        # which it never is here: the trial divides each micro-batch's loss by their count).
        grad_input.mul_(grad_output)
        if grad_weight is not None:
            grad_weight.mul_(grad_output)
        if grad_bias is not None:
            grad_bias.mul_(grad_output)
        return grad_input, grad_weight, None, grad_bias


def liger_causal_lm_loss(hidden_states: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor) -> Any:
    labels = nn.functional.pad(labels, (0, 1), value=-100)
    shift_labels = labels[..., 1:].contiguous()
    hidden_states = hidden_states.view(-1, hidden_states.size(-1))
    shift_labels = shift_labels.view(-1)
    return LigerFunction.apply(hidden_states, lm_head_weight, shift_labels, None)


def patched(model: nn.Module, loss: str, chunk_size: int = TRL_CHUNK) -> nn.Module:
    """model (a transformers causal LM) with its forward computing loss ("chunked", in chunks of chunk_size tokens,
    TRL's 256 by default, or "fused-linear") when it is given labels, as the libraries patch it."""
    lm_head = model.get_output_embeddings()

    def chunked_forward(self: nn.Module, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        kwargs.pop("use_cache", None)
        outputs = self.base_model(input_ids=input_ids, use_cache=False, **kwargs)
        loss = trl_chunked_loss(outputs.last_hidden_state, lm_head.weight, chunk_size, labels, lm_head.bias)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    def fused_forward(self: nn.Module, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        outputs = self.model(input_ids=input_ids, **kwargs)
        hidden_states = outputs[0]
        kept_hidden_states = hidden_states[:, slice(0, None), :]
        loss = liger_causal_lm_loss(kept_hidden_states, self.lm_head.weight, labels)
        return CausalLMOutputWithPast(loss=loss, logits=None)

    forward = chunked_forward if loss == "chunked" else fused_forward
    model.forward = types.MethodType(forward, model)  # type: ignore[method-assign]
    return model


def rng_states_of_chunked(micro_batch: int, seq_len: int, chunk_size: int = TRL_CHUNK) -> int:
    """The CPU generator states TRL's chunks keep (torch.utils.checkpoint's preserve_rng_state: a tensor made below
    the dispatcher, which a meter of dispatched ops cannot see) at their most: every chunk of one micro-batch's
    forward, until its backward."""
    return _cdiv(micro_batch * (seq_len - 1), chunk_size) * torch.get_rng_state().nbytes
