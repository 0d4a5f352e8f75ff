"""The kernels' own temporaries (autotune/core/kernel_temporaries.py) against a real card: the caching
allocator's exact count of requested bytes (``requested_bytes.all.peak``, before any rounding) over one op,
less its inputs and outputs, is the rule's peak. Printed for the closing note; skipped without a card.

The emulated H200 disagreed with the 2026-11-30 card at one size (m = 1248, where the mem-efficient
attention's grad-Q accumulator is 78 KiB larger than the cached logits-sized blocks); the first case below
measures that accumulator directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.core.kernel_temporaries import peak_bytes
from autotune.measure.meters.temporaries import kernel_facts, op_temporaries

aten = torch.ops.aten
BACKWARD = {
    "efficient": aten._scaled_dot_product_efficient_attention_backward.default,
    "flash": aten._scaled_dot_product_flash_attention_backward.default,
    "cudnn": aten._scaled_dot_product_cudnn_attention_backward.default,
}


class _ScratchOf(TorchDispatchMode):
    """Runs every op; around the one watched, the allocator's peak of requested bytes less what it
    returned (its scratch), and the rule's peak for the same arguments."""

    def __init__(self, watched: object) -> None:
        super().__init__()
        self.watched = watched
        self.found: list[tuple[int, int]] = []
        self.facts = kernel_facts(torch.device("cuda", 0))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is not self.watched:
            return func(*args, **(kwargs or {}))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_stats()["requested_bytes.all.current"]
        out = func(*args, **(kwargs or {}))
        torch.cuda.synchronize()
        peak = torch.cuda.memory_stats()["requested_bytes.all.peak"] - before
        self.found.append((peak - _nbytes(out), peak_bytes(op_temporaries(func, args, self.facts))))
        return out


def _nbytes(tensors: object) -> int:
    flat = tensors if isinstance(tensors, (tuple, list)) else (tensors,)
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in flat if isinstance(t, torch.Tensor)
    }
    return sum(storages.values())


@pytest.mark.parametrize(
    ("batch", "dtype", "backend"),
    [
        (1248, torch.float32, "efficient"),
        (1212, torch.float32, "efficient"),
        (64, torch.bfloat16, "efficient"),
        (64, torch.bfloat16, "flash"),
        (64, torch.bfloat16, "cudnn"),
    ],
)
def test_attention_backward_scratch_is_the_rules(batch: int, dtype: torch.dtype, backend: str) -> None:
    heads, length = 4, 64
    head_dim = 16 if dtype == torch.float32 else 64
    qkv = torch.randn(batch, length, 3 * heads * head_dim, device="cuda", dtype=dtype, requires_grad=True)
    q, k, v = (z.view(batch, length, heads, head_dim).transpose(1, 2) for z in qkv.split(heads * head_dim, dim=2))
    backends = {"efficient": SDPBackend.EFFICIENT_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    try:
        with sdpa_kernel(backends[backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except RuntimeError as exc:  # this card or build lacks the backend
        pytest.skip(f"{backend} attention is not available here: {str(exc).splitlines()[0]}")
    mode = _ScratchOf(BACKWARD[backend])
    with mode:
        out.transpose(1, 2).reshape(batch, length, heads * head_dim).sum().backward()
    ((scratch, rule),) = mode.found
    print(f"{backend} {dtype} B={batch}: scratch {scratch} bytes, rule {rule}")
    if backend == "cudnn":
        assert scratch >= rule  # cuDNN's own engine workspace comes on top of the frontend's
    else:
        assert scratch == rule


def test_embedding_and_layer_norm_backward_scratch_is_at_least_the_rules() -> None:
    """cub's bookkeeping inside its temp storage and the reductions' buffers come on top of the rules."""
    embedding = torch.nn.Embedding(256, 64, device="cuda")
    norm = torch.nn.LayerNorm(64, device="cuda")
    indices = torch.randint(0, 256, (1212, 64), device="cuda")
    for module, watched in ((embedding, aten.embedding_dense_backward.default),
                            (norm, aten.native_layer_norm_backward.default)):
        mode = _ScratchOf(watched)
        inputs = indices if module is embedding else torch.randn(1212, 64, 64, device="cuda", requires_grad=True)
        output = module(inputs)
        with mode:
            output.sum().backward()
        ((scratch, rule),) = mode.found
        print(f"{watched}: scratch {scratch} bytes, rule {rule}")
        assert rule > 0 and scratch >= rule
