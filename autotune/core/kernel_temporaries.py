"""What CUDA kernels allocate for themselves: the temporaries a real op takes from the caching allocator
beyond the outputs it returns, as arithmetic on the op's shapes.

A fake (meta) kernel allocates an op's outputs only; the CUDA kernel behind the same op may also ask the
caching allocator for scratch space (``at::empty`` inside the op, cub's temp storage, a cuDNN workspace)
and give it back before it returns. Such a temporary never shows in the live bytes after the op, but the
allocator must find a block for it while everything else is live, and where no cached block fits it adds a
segment that stays reserved. So the replay of a fake trial on a card (autotune/search/reserved.py) puts
each op's temporaries into the trace right after the op's outputs, allocated and freed in the order the
source does it. Every rule names the function it follows (PyTorch 2.11 - 2.13 sources, checked against the
2.13 headers where they ship); nothing here is a margin or a factor.

Each rule returns the op's steps as ``(name, nbytes)`` pairs in order: ``nbytes >= 0`` allocates under
``name``, ``nbytes == FREE`` frees it; every name allocated is freed by the end (an op's scratch never
outlives it). The worked case of the mem-efficient attention backward, fp32, 1212 sequences of 64 tokens,
4 heads of 16 on sm_90: delta's product of grad_out and out, its sum and the transposed copy, then the
grad-Q accumulator of 16,400 bytes per (sequence, head):

    >>> steps = efficient_attention_backward(1212, 4, 64, 64, 16, 16, itemsize=4, capability=(9, 0))
    >>> [(name, n) for name, n in steps if n != FREE]
    [('delta_product', 19857408), ('delta_sum', 1241088), ('delta', 1241088), ('workspace', 79507200)]
    >>> peak_bytes(steps)
    80748288

Covered (each with its conditions in its docstring): the mem-efficient attention's backward and forward
(``mem_eff_attention/kernel_backward.h``, ``kernel_forward.h``, ``attention_backward.cu``,
``attention.cu``), flash attention's backward (``flash_attn/flash_api.cpp``: ``mha_bwd``), cuDNN
attention's backward (the cudnn-frontend SDPA backward node's workspace), the embedding's backward
(``Embedding.cu``, ``EmbeddingBackwardKernel.cu``), layer norm's backward (``layer_norm_kernel.cu``),
bitsandbytes' 4-bit matmul where it dequantizes the weight first (``gemm_4bit``'s unfused path), and cuDNN's
convolution workspaces as a stated bound, two column matrices of the convolution's GEMM lowering per cuDNN
call (``native/cudnn/Conv_v8.cpp`` takes what cuDNN's top engine asks, a size only its heuristics know; see
:func:`convolution_workspace_bound`). Not covered, and so not in any figure: the split reductions' buffers of
``Reduce.cuh`` (a few KiB to a few MiB), cuDNN's own engine workspace for attention, and compute capabilities
below 8.0. Torch-free, on the floor beside allocator.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

__all__ = [
    "FREE",
    "Step",
    "efficient_attention_backward",
    "efficient_attention_forward",
    "CONV_WORKSPACE_CAP_VARIABLE",
    "DEFAULT_CONV_WORKSPACE_CAP_BYTES",
    "conv_workspace_cap_bytes",
    "convolution_output_spatial",
    "convolution_workspace",
    "convolution_workspace_bound",
    "CONV_WORKSPACE_COLUMN_MATRICES",
    "im2col_columns_bytes",
    "cudnn_attention_backward",
    "dequantized_4bit_weight",
    "embedding_dense_backward",
    "flash_attention_backward",
    "layer_norm_backward",
    "peak_bytes",
]

FREE = -1
Step = tuple[str, int]

# Embedding.cu: up to this many indices (and without scale_grad_by_freq) the backward needs no sort.
EMBEDDING_DIRECT_MAX_INDICES = 3072
# EmbeddingBackwardKernel.cu: NROWS_PER_THREAD, the rows one partial segment sums.
EMBEDDING_ROWS_PER_PARTIAL = 10
# layer_norm_kernel.cu (LaunchGammaBetaBackwardCUDAKernel): the "M >> N" path's thresholds.
LAYER_NORM_BLOCKED_MIN_ROWS = 65536
LAYER_NORM_BLOCK_X = 32
LAYER_NORM_MAX_GRID = 64 * 1024 // 2
# kernel_forward.h: kAlignLSE, the logsumexp's padding of the query length.
LSE_ALIGN = 32
# cuDNN's cap on the workspace of the convolution engines it offers, in MiB (PyTorch's "CUDA Environment
# Variables" page lists it beside CUBLAS_WORKSPACE_CONFIG: the workspace cuDNN may take per allocation). Where
# the job's environment sets it, each workspace is min(bound, cap).
CONV_WORKSPACE_CAP_VARIABLE = "CUDNN_CONV_WSCAP_DBG"
DEFAULT_CONV_WORKSPACE_CAP_BYTES: int | None = None
# Column matrices of the GEMM lowering per cuDNN convolution call in the stated bound. One is the explicit-GEMM
# engine's workspace; it is not enough for the one card measured (the CNN example on the H200 of 2026-11-30
# held m = 1152 at 2 GiB, fit 926.51 KiB per sample; with one matrix the emulated H200 answers 1976, fit 467
# KiB per sample); two answer 1056, fit 904 KiB per sample. Calibrated on that card, not derived from cuDNN's
# engines: see docs/cuda-estimates.md for the figures, including the factors that answer above the card.
CONV_WORKSPACE_COLUMN_MATRICES = 2


def peak_bytes(steps: Sequence[Step]) -> int:
    """The most bytes the steps hold at once.

    >>> peak_bytes([("a", 10), ("b", 5), ("a", FREE), ("c", 20), ("b", FREE), ("c", FREE)])
    25
    """
    held: dict[str, int] = {}
    peak = 0
    for name, nbytes in steps:
        if nbytes == FREE:
            held.pop(name)
        else:
            held[name] = nbytes
            peak = max(peak, sum(held.values()))
    return peak


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _align_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def _efficient_backward_tile(max_k: int, half: bool, capability: tuple[int, int]) -> tuple[int, int, int]:
    """(kBlockSizeI, kBlockSizeJ, kMaxK) of the kernel ``dispatch_cutlassB`` (kernels/cutlassB.h) launches
    first for this head size on sm_80 and up, without dropout, for unaligned sequence lengths (the
    sequence-aligned variants have the same tiles)."""
    ampere_consumer = capability in ((8, 6), (8, 9))  # 99 KiB of shared memory per block
    if not half:  # dispatch_cutlassB_f32_sm80
        if max_k <= 32:
            return 64, 64, 32
        if max_k <= 64:
            return 64, 64, 64
        if max_k <= 128:
            return (64, 64, 128) if ampere_consumer else (128, 64, 128)
        return 128, 64, 65536
    # dispatch_cutlassB_{f16,bf16}_sm80
    if max_k <= 32:
        return 64, 64, 32
    if max_k <= 64:
        return 64, 64, 64
    if ampere_consumer and max_k <= 96:
        return 128, 64, 96
    if max_k <= 128:
        return (64, 64, 128) if ampere_consumer else (128, 128, 128)
    return 128, 64, 65536


def efficient_attention_backward(
    batch: int,
    heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    value_dim: int,
    *,
    itemsize: int,
    capability: tuple[int, int],
    grad_out_contiguous: bool = True,
    deterministic: bool = False,
) -> list[Step]:
    """``_efficient_attention_backward`` (attention_backward.cu), reached from SDPA's mem-efficient
    backward, after its outputs grad_q, grad_k, grad_v:

    - ``grad_out.contiguous()`` where the (B, M, nH, Kv) view of grad_out is not contiguous;
    - ``delta``: kernels that compute it themselves (fp16/bf16 on sm_80 and up) take an empty (B, nH, M)
      float; fp32 kernels compute ``(grad_out.float() * out.float()).sum(-1).transpose(-2, -1)
      .contiguous()`` first: the product, the sum, and the copy (the first two die at the statement's end);
    - ``workspace`` = ``Params::workspace_size()`` (kernel_backward.h): per (sequence, head) the grad-Q
      accumulator (``kNeedsAccumGradQ``: every kernel for sm_70 and up, since they can split keys),
      ``ceil(M / BI) * ceil(K / BJ)`` tiles of ``GradQTempStorage`` (16 bytes of lock and counter, then
      BI x BJ floats), plus grad-K and grad-V accumulators (``num_splits_key * BJ * align_up(K, BI)`` floats
      each) where the kernel cannot keep the output in registers (fp16/bf16 with head size above BI).

    Compute capabilities below 8.0 (other kernel lists) give no steps. Batches above 65535 run in chunks
    (the sizes here are then those of one chunk; the caller passes the chunk).
    """
    if capability < (8, 0):
        return []
    half = itemsize <= 2
    max_k = max(head_dim, value_dim)
    block_i, block_j, kernel_max_k = _efficient_backward_tile(max_k, half, capability)
    output_in_registers = half and kernel_max_k <= block_i
    accum_kv = half and not output_in_registers
    steps: list[Step] = []
    if not grad_out_contiguous:
        steps.append(("grad_out_contiguous", batch * queries * heads * value_dim * itemsize))
    if half:
        steps.append(("delta", 4 * batch * heads * queries))
    else:
        steps += [
            ("delta_product", 4 * batch * queries * heads * value_dim),
            ("delta_sum", 4 * batch * queries * heads),
        ]
        if heads > 1 and queries > 1:
            steps += [("delta", 4 * batch * heads * queries), ("delta_sum", FREE)]
        else:  # the transposed sum is contiguous already: it is delta, no copy
            steps[-1] = ("delta", 4 * batch * queries * heads)
        steps.append(("delta_product", FREE))
    # num_splits_key (attention_backward.cu's heuristic); it sizes only the grad-K/V accumulators.
    splits = _ceil_div(keys, block_j)
    if batch * heads >= 256 and keys <= 2 * block_j:
        splits = 1
    if accum_kv:
        splits = min(splits, 200 // max(1, batch * heads))
    if splits < 1 or deterministic:
        splits = 1
    grad_q_storage = 16 + 4 * block_i * block_j
    elements_gq = _ceil_div(queries, block_i) * _ceil_div(head_dim, block_j) * grad_q_storage // 4
    elements_kv = splits * block_j * (_align_up(head_dim, block_i) + _align_up(value_dim, block_i)) if accum_kv else 0
    workspace = batch * heads * _align_up(elements_gq + elements_kv, 4) * 4
    if workspace:
        steps.append(("workspace", workspace))
    steps.append(("delta", FREE))
    if workspace:
        steps.append(("workspace", FREE))
    if not grad_out_contiguous:
        steps.append(("grad_out_contiguous", FREE))
    return steps


def efficient_attention_forward(
    batch: int, heads: int, queries: int, head_dim: int, value_dim: int, *, itemsize: int, capability: tuple[int, int]
) -> list[Step]:
    """``_efficient_attention_forward`` (attention.cu): beyond the output and the logsumexp, a float
    ``output_accum`` (B, M, nH, Kv) where the kernel cannot finish in one pass over the value's head
    (``kNeedsOutputAccumulatorBuffer``: fp16/bf16 with a head size above 128, the 32 x 128 kernel).

    >>> efficient_attention_forward(2, 4, 64, 256, 256, itemsize=2, capability=(9, 0))
    [('output_accum', 524288), ('output_accum', -1)]
    >>> efficient_attention_forward(2, 4, 64, 128, 128, itemsize=2, capability=(9, 0))
    []
    """
    if capability < (8, 0) or itemsize > 2 or max(head_dim, value_dim) <= 128:
        return []
    return [("output_accum", 4 * batch * queries * heads * value_dim), ("output_accum", FREE)]


def flash_attention_backward(
    batch: int,
    heads: int,
    kv_heads: int,
    queries: int,
    keys: int,
    head_dim: int,
    *,
    itemsize: int,
    sm_count: int,
    deterministic: bool = False,
) -> list[Step]:
    """``mha_bwd`` (flash_attn/flash_api.cpp), after grad_q, grad_k, grad_v: ``softmax_d`` (B, nH, M
    rounded to 128) float, which ``_flash_attention_backward`` drops at its end; ``dq_accum`` (B, M rounded
    to 128, nH, head rounded to 32) float, one per split of ``ceil(SMs / (B * nH))`` when deterministic;
    and where keys have fewer heads (GQA), grad-K and grad-V over every query head before they are summed.

    >>> [n for _, n in flash_attention_backward(8, 32, 8, 4096, 4096, 128, itemsize=2, sm_count=132)]
    [4194304, 536870912, 268435456, 268435456, -1, -1, -1, -1]
    """
    queries_rounded = _align_up(queries, 128)
    head_rounded = _align_up(head_dim, 32)
    steps: list[Step] = [("softmax_d", 4 * batch * heads * queries_rounded)]
    splits = _ceil_div(sm_count, batch * heads) if deterministic else 1
    steps.append(("dq_accum", 4 * splits * batch * queries_rounded * heads * head_rounded))
    expanded = kv_heads != heads
    if expanded:
        steps += [
            ("dk_expanded", batch * keys * heads * head_dim * itemsize),
            ("dv_expanded", batch * keys * heads * head_dim * itemsize),
        ]
        steps += [("dv_expanded", FREE), ("dk_expanded", FREE)]
    steps += [("dq_accum", FREE), ("softmax_d", FREE)]
    return steps


def cudnn_attention_backward(batch: int, heads: int, queries: int, head_dim: int) -> list[Step]:
    """cuDNN's SDPA backward (``run_cudnn_SDP_bprop`` in native/cudnn/MHA.cpp) takes the graph's workspace
    from the caching allocator for the call; of it, the cudnn-frontend backward node
    (``CompositeSDPABackwardNode::get_fe_workspace_size_node``, cuDNN 9) needs a float grad-Q accumulator
    (B, nH, M, K) and the softmax sums (B, nH, M). The engine's own part of the workspace is cuDNN's and is
    not modelled.

    >>> cudnn_attention_backward(1, 32, 4096, 128)
    [('workspace', 67633152), ('workspace', -1)]
    """
    return [("workspace", 4 * batch * heads * queries * (head_dim + 1)), ("workspace", FREE)]


def embedding_dense_backward(
    num_indices: int,
    dim: int,
    num_weights: int,
    *,
    index_itemsize: int,
    accumulate_itemsize: int = 4,
    scale_grad_by_freq: bool = False,
) -> list[Step]:
    """``embedding_dense_backward_cuda`` (Embedding.cu) past 3072 indices: the indices sorted with their
    positions (cub's radix sort: its temp storage holds an alternate keys and values buffer), then
    ``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu): segment offsets, partial segments of
    10 rows, and the float partial sums per partial segment; all freed before the op returns (the weight's
    gradient is the output). cub's bookkeeping inside its temp storage (a few KiB) is left out.

    >>> [n for _, n in embedding_dense_backward(3072, 64, 256, index_itemsize=8)]
    []
    >>> max(n for _, n in embedding_dense_backward(77568, 64, 256, index_itemsize=8))
    2051072
    """
    if num_indices <= EMBEDDING_DIRECT_MAX_INDICES and not scale_grad_by_freq:
        return []
    n, size = num_indices, index_itemsize
    max_segments = min(num_indices, num_weights)
    max_partial = num_indices // EMBEDDING_ROWS_PER_PARTIAL + max_segments
    return [
        ("sorted_indices", n * size),
        ("orig_indices", n * size),
        ("range", n * size),
        ("sort_temp", 2 * n * size),
        ("sort_temp", FREE),
        ("range", FREE),
        ("segment_offsets", n * size),
        ("unique_keys", n * size),
        ("unique_keys", FREE),
        ("partials_per_segment", max_segments * size),
        ("partials_per_segment_offset", max_segments * size),
        ("partial_segment_offset", max_partial * size),
        ("grad_weight_per_segment", max_partial * dim * accumulate_itemsize),
        ("grad_weight_per_segment", FREE),
        ("partial_segment_offset", FREE),
        ("partials_per_segment_offset", FREE),
        ("partials_per_segment", FREE),
        ("segment_offsets", FREE),
        ("orig_indices", FREE),
        ("sorted_indices", FREE),
    ]


def layer_norm_backward(
    rows: int, cols: int, *, weight_itemsize: int, sm_count: int, weight_grad: bool = True, bias_grad: bool = True
) -> list[Step]:
    """``LaunchGammaBetaBackwardCUDAKernel`` (layer_norm_kernel.cu): with many more rows than columns
    (M > 65536 and N / 32 < SMs / 2) the weight's and bias's gradients are first summed per block of rows,
    into (blocks_y, N) tensors of the weight's dtype, then over blocks.

    >>> layer_norm_backward(77568, 64, weight_itemsize=4, sm_count=132)
    [('dgamma_blocks', 620544), ('dbeta_blocks', 620544), ('dbeta_blocks', -1), ('dgamma_blocks', -1)]
    >>> layer_norm_backward(4096, 64, weight_itemsize=4, sm_count=132)
    []
    """
    if rows <= LAYER_NORM_BLOCKED_MIN_ROWS or cols // LAYER_NORM_BLOCK_X >= sm_count // 2:
        return []
    blocks_x = _ceil_div(cols, LAYER_NORM_BLOCK_X)
    blocks_y = min(LAYER_NORM_MAX_GRID // blocks_x, _ceil_div(rows, LAYER_NORM_BLOCK_X))
    size = blocks_y * cols * weight_itemsize
    steps: list[Step] = []
    if weight_grad:
        steps.append(("dgamma_blocks", size))
    if bias_grad:
        steps.append(("dbeta_blocks", size))
    steps += [(name, FREE) for name, _ in reversed(steps)]
    return steps


def dequantized_4bit_weight(
    out_features: int, in_features: int, *, itemsize: int, absmax_blocks: int = 0
) -> list[Step]:
    """bitsandbytes' ``gemm_4bit`` on CUDA where it does not run its fused kernel (``_dequant_linear_fallback``,
    backends/cuda/ops.py, bitsandbytes 0.50): a double-quantized absmax first dequantized to fp32 and offset
    (two fp32 tensors of its blocks' count), then the whole weight dequantized into the input's dtype, then
    ``F.linear``; all of it freed when the op returns.

    >>> dequantized_4bit_weight(14336, 4096, itemsize=2)
    [('dequantized_weight', 117440512), ('dequantized_weight', -1)]
    """
    steps: list[Step] = []
    if absmax_blocks:
        steps += [("absmax_dequantized", 4 * absmax_blocks), ("absmax_offset", 4 * absmax_blocks)]
    steps.append(("dequantized_weight", out_features * in_features * itemsize))
    steps += [(name, FREE) for name, _ in reversed(steps)]
    return steps


def conv_workspace_cap_bytes(environ: Mapping[str, str]) -> int | None:
    """The cap on each cuDNN convolution's workspace in bytes: cuDNN's ``CUDNN_CONV_WSCAP_DBG`` (MiB) where
    the environment sets it to a whole number, else :data:`DEFAULT_CONV_WORKSPACE_CAP_BYTES` (None: no cap,
    the stated bound alone).

    >>> conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "256"})
    268435456
    >>> conv_workspace_cap_bytes({}) is None
    True
    """
    text = environ.get(CONV_WORKSPACE_CAP_VARIABLE, "").strip()
    if text.isdigit():
        return int(text) * 2**20
    return DEFAULT_CONV_WORKSPACE_CAP_BYTES


def im2col_columns_bytes(
    batch: int, in_channels: int, kernel_size: Sequence[int], out_spatial: Sequence[int], *, itemsize: int
) -> int:
    """The column matrix of a convolution lowered to one GEMM: every input value each output position reads,
    ``N x C_in x prod(kernel) x prod(output positions)`` elements of the input's dtype (over all groups: a
    group's columns are its C_in / groups channels). This is the workspace of cuDNN's explicit-GEMM engine
    (``CUDNN_CONVOLUTION_FWD_ALGO_GEMM``: an explicit matrix product, its workspace the input's matrix), and the
    same matrix is what a backward-data GEMM scatters from and a backward-weight GEMM reads.

    The CNN example's second convolution, 16 -> 32 channels, 3 x 3, 16 x 16 positions, fp32, one image:

    >>> im2col_columns_bytes(1, 16, (3, 3), (16, 16), itemsize=4)
    147456
    """
    elements = batch * in_channels * math.prod(kernel_size) * math.prod(out_spatial)
    return elements * itemsize


def convolution_output_spatial(
    in_spatial: Sequence[int],
    kernel_size: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
    dilation: Sequence[int],
) -> list[int]:
    """A convolution's output positions per dimension (ATen's ``conv_output_size``).

    >>> convolution_output_spatial((32, 32), (3, 3), (1, 1), (1, 1), (1, 1))
    [32, 32]
    >>> convolution_output_spatial((224,), (7,), (2,), (3,), (1,))
    [112]
    """
    return [
        (size + 2 * pad - dil * (k - 1) - 1) // s + 1
        for size, k, s, pad, dil in zip(in_spatial, kernel_size, stride, padding, dilation, strict=True)
    ]


def convolution_workspace_bound(
    batch: int, x_channels: int, kernel_size: Sequence[int], y_spatial: Sequence[int], *, itemsize: int
) -> int:
    """The stated bound on one cuDNN convolution call's workspace: :data:`CONV_WORKSPACE_COLUMN_MATRICES`
    column matrices (:func:`im2col_columns_bytes`) of the call, where ``x_channels`` are the channels of the
    convolution's input side (C_in over all groups; a transposed convolution's output) and ``y_spatial`` the
    positions of its output side (a transposed convolution's input). The same for the forward, backward-data
    and backward-weight calls of one convolution: each lowers the same column matrix.

    The CNN example (3 x 32 x 32 images, 3 x 3 convolutions with padding 1, fp32) at m = 1152, its three
    layers' bounds in MiB:

    >>> [convolution_workspace_bound(1152, c, (3, 3), (s, s), itemsize=4) // 2**20
    ...  for c, s in ((3, 32), (16, 16), (32, 8))]
    [243, 324, 162]
    """
    columns = im2col_columns_bytes(batch, x_channels, kernel_size, y_spatial, itemsize=itemsize)
    return CONV_WORKSPACE_COLUMN_MATRICES * columns


def convolution_workspace(cudnn_calls: int, *, bound_bytes: int, cap_bytes: int | None = None) -> list[Step]:
    """The workspaces of a convolution op that runs on cuDNN, one per cuDNN call in order (the forward: one;
    ``convolution_backward``: grad_input, then grad_weight, each that its output mask asks for), each at
    the stated bound ``bound_bytes`` (:func:`convolution_workspace_bound`), or at cuDNN's cap
    ``CUDNN_CONV_WSCAP_DBG`` where the job sets a smaller one, and freed before the next.

    What PyTorch's non-benchmark path does (``run_single_conv`` in native/cudnn/Conv_v8.cpp, PyTorch 2.11 -
    2.13; ``torch.backends.cudnn.benchmark`` is off by default): ``get_configs_from_heuristics`` lists the
    engine configs of cuDNN's heuristics (``CUDNN_HEUR_MODE_INSTANT``), ``try_configs`` builds each in turn,
    and ``run_conv_plan`` asks the caching allocator for ``plan.getWorkspaceSize()`` bytes, with no cap of
    PyTorch's own; where the allocator raises ``OutOfMemoryError`` (or the plan fails) the next config is
    tried, then cuDNN's fallback list. Only the benchmark path limits the workspace, to the largest block the
    allocator could give (``generate_and_filter_plans``: ``get_available_workspace``, ``cacheInfo``), which
    says nothing of the size chosen. So the workspace is what the top engine asks, a size only cuDNN's
    heuristics know (they cannot be asked under the emulation: ``cudnnCreate`` fails on the stand-in driver),
    and no shape formula bounds every engine (pytorch/pytorch issue 31500: a 1 x 1 transposed convolution of
    a 2 GiB fp16 input asked 48 GiB). The bound here is a statement, checked against the one card measured.

    The backward of the CNN example's second convolution at m = 1152, under no cap and under a 64 MiB cap:

    >>> bound = convolution_workspace_bound(1152, 16, (3, 3), (16, 16), itemsize=4)
    >>> steps = convolution_workspace(2, bound_bytes=bound)
    >>> [n // 2**20 for _, n in steps if n != FREE], peak_bytes(steps) // 2**20
    ([324, 324], 324)
    >>> [n // 2**20 for _, n in convolution_workspace(1, bound_bytes=bound, cap_bytes=64 * 2**20) if n != FREE]
    [64]
    >>> convolution_workspace(1, bound_bytes=bound, cap_bytes=0)
    []
    """
    each = bound_bytes if cap_bytes is None else min(bound_bytes, cap_bytes)
    if each <= 0:
        return []
    return [step for _ in range(cudnn_calls) for step in (("workspace", each), ("workspace", FREE))]
