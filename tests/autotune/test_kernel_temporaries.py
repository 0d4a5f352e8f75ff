"""The CUDA kernels' own temporaries (autotune/core/kernel_temporaries.py), each rule on a case derived by
hand from the source it names, and the fake meter putting them into a trial's allocation trace."""

from __future__ import annotations

import pytest

from autotune.core.kernel_temporaries import (
    FREE,
    conv_workspace_cap_bytes,
    convolution_workspace,
    cudnn_attention_backward,
    efficient_attention_backward,
    efficient_attention_forward,
    embedding_dense_backward,
    flash_attention_backward,
    layer_norm_backward,
    peak_bytes,
)

H200 = (9, 0)


def _balanced(steps: list[tuple[str, int]]) -> bool:
    held: set[str] = set()
    for name, nbytes in steps:
        if nbytes == FREE:
            held.remove(name)
        else:
            assert name not in held
            held.add(name)
    return not held


def test_efficient_backward_fp32_computes_delta_outside_the_kernel() -> None:
    """fp32: kKernelComputesDelta is false, so attention_backward.cu computes delta with ATen ops: the
    product (B, M, nH, Kv) and its sum (B, M, nH) die at the statement's end, the transposed copy (B, nH, M)
    at the launch's; the 64 x 64 kernel's grad-Q accumulator is 16 + 4 * 64 * 64 bytes per (b, h)."""
    steps = efficient_attention_backward(8, 4, 64, 64, 16, 16, itemsize=4, capability=H200)
    assert steps == [
        ("delta_product", 8 * 64 * 4 * 16 * 4),
        ("delta_sum", 8 * 64 * 4 * 4),
        ("delta", 8 * 4 * 64 * 4),
        ("delta_sum", FREE),
        ("delta_product", FREE),
        ("workspace", 8 * 4 * 16400),
        ("delta", FREE),
        ("workspace", FREE),
    ]
    assert peak_bytes(steps) == 8 * 4 * 16400 + 8 * 4 * 64 * 4


def test_efficient_backward_half_computes_delta_in_the_kernel() -> None:
    """bf16, head 128 on sm_90: the 128 x 128 kernel keeps its output in registers (kMaxK <= BI), delta is
    an empty (B, nH, M) float, and the workspace is the grad-Q accumulator: ceil(M / 128) tiles of
    16 + 4 * 128 * 128 bytes per (b, h)."""
    steps = efficient_attention_backward(2, 8, 1000, 1000, 128, 128, itemsize=2, capability=H200)
    tiles = -(-1000 // 128)
    assert steps == [
        ("delta", 4 * 2 * 8 * 1000),
        ("workspace", 2 * 8 * tiles * (16 + 4 * 128 * 128)),
        ("delta", FREE),
        ("workspace", FREE),
    ]


def test_efficient_backward_accumulates_grad_k_and_v_past_the_kernels_block() -> None:
    """bf16, head 256: the (128, 64, 65536) kernel cannot keep grad K and V in registers and adds
    num_splits_key * BJ * align_up(K, BI) floats for each (one split: 256 sequences x heads)."""
    steps = dict(s for s in efficient_attention_backward(64, 4, 256, 256, 256, 256, itemsize=2, capability=H200)
                 if s[1] != FREE)
    per_head = 4 * (2 * 64 * 256) + (16 + 4 * 128 * 64) * 2 * 4  # gk + gv floats, then 2 x 4 grad-Q tiles
    assert steps["workspace"] == 64 * 4 * per_head


def test_efficient_backward_copies_a_non_contiguous_grad_out_first() -> None:
    steps = efficient_attention_backward(2, 4, 64, 64, 16, 16, itemsize=4, capability=H200, grad_out_contiguous=False)
    assert steps[0] == ("grad_out_contiguous", 2 * 64 * 4 * 16 * 4)
    assert steps[-1] == ("grad_out_contiguous", FREE)
    assert _balanced(steps)


def test_no_rules_below_sm_80() -> None:
    assert efficient_attention_backward(8, 4, 64, 64, 16, 16, itemsize=4, capability=(7, 5)) == []


def test_efficient_forward_needs_an_accumulator_only_past_head_128_in_half() -> None:
    assert efficient_attention_forward(2, 4, 64, 256, 256, itemsize=4, capability=H200) == []
    assert efficient_attention_forward(2, 4, 64, 160, 160, itemsize=2, capability=H200) == [
        ("output_accum", 4 * 2 * 64 * 4 * 160),
        ("output_accum", FREE),
    ]


def test_flash_backward_rounds_and_expands_for_grouped_queries() -> None:
    """mha_bwd: softmax_d (B, H, roundup(S, 128)) and dq_accum (B, roundup(S, 128), H, roundup(d, 32))
    floats; with 4 query heads per key head, grad K and V over all query heads before the sum."""
    steps = flash_attention_backward(2, 8, 2, 1000, 1000, 80, itemsize=2, sm_count=132)
    named = dict(s for s in steps if s[1] != FREE)
    assert named == {
        "softmax_d": 4 * 2 * 8 * 1024,
        "dq_accum": 4 * 2 * 1024 * 8 * 96,
        "dk_expanded": 2 * 1000 * 8 * 80 * 2,
        "dv_expanded": 2 * 1000 * 8 * 80 * 2,
    }
    assert _balanced(steps)
    deterministic = dict(s for s in flash_attention_backward(2, 8, 8, 1000, 1000, 80, itemsize=2, sm_count=132,
                                                             deterministic=True) if s[1] != FREE)
    assert deterministic["dq_accum"] == -(-132 // 16) * 4 * 2 * 1024 * 8 * 96  # one per split of the SMs


def test_cudnn_backward_workspace_holds_grad_q_in_float_and_the_softmax_sums() -> None:
    assert cudnn_attention_backward(2, 16, 2048, 64) == [("workspace", 4 * 2 * 16 * 2048 * 65), ("workspace", FREE)]


@pytest.mark.parametrize(
    ("indices", "expected_peak"),
    [
        (3072, 0),  # the direct kernel: no sort
        # sort path: 3 index arrays and cub's alternate keys and values, then the segment buffers
        (4096, 4096 * 8 * 5),
    ],
)
def test_embedding_backward_sorts_past_3072_indices(indices: int, expected_peak: int) -> None:
    steps = embedding_dense_backward(indices, 64, 256, index_itemsize=8)
    assert _balanced(steps)
    assert peak_bytes(steps) >= expected_peak
    if indices > 3072:
        per_segment = dict(s for s in steps if s[1] != FREE)["grad_weight_per_segment"]
        assert per_segment == (4096 // 10 + 256) * 64 * 4
        assert embedding_dense_backward(100, 64, 256, index_itemsize=8, scale_grad_by_freq=True) != []


def test_layer_norm_backward_sums_per_block_of_rows_only_when_rows_dwarf_columns() -> None:
    rows, cols = 77568, 64
    blocks_y = min(32768 // 2, -(-rows // 32))
    assert layer_norm_backward(rows, cols, weight_itemsize=4, sm_count=132) == [
        ("dgamma_blocks", blocks_y * cols * 4),
        ("dbeta_blocks", blocks_y * cols * 4),
        ("dbeta_blocks", FREE),
        ("dgamma_blocks", FREE),
    ]
    assert layer_norm_backward(65536, cols, weight_itemsize=4, sm_count=132) == []  # not more than 65536 rows
    assert layer_norm_backward(rows, 4096, weight_itemsize=4, sm_count=132) == []  # 128 column blocks >= 66
    assert layer_norm_backward(rows, cols, weight_itemsize=2, sm_count=132, bias_grad=False) == [
        ("dgamma_blocks", blocks_y * cols * 2),
        ("dgamma_blocks", FREE),
    ]


def test_every_rule_frees_what_it_allocates() -> None:
    for steps in (
        efficient_attention_backward(3, 5, 77, 91, 40, 40, itemsize=2, capability=(8, 9)),
        efficient_attention_backward(3, 1, 77, 91, 40, 40, itemsize=4, capability=(8, 0)),
        flash_attention_backward(1, 4, 4, 10, 10, 64, itemsize=2, sm_count=108),
        embedding_dense_backward(10_000, 8, 50_000, index_itemsize=4),
        convolution_workspace(2, bound_bytes=1 << 20),
    ):
        assert _balanced(steps), steps


def test_convolution_workspace_is_the_bound_per_cudnn_call_one_at_a_time_under_the_cap() -> None:
    """Conv_v8.cpp: one workspace per cuDNN call (run_conv_plan), taken and given back inside it; the backward
    of a convolution with an input that needs a gradient makes two calls (grad_input, then grad_weight), the
    first layer's (an input that needs none) one. Each is the stated bound, or CUDNN_CONV_WSCAP_DBG's cap where
    that is smaller: 100 MiB under a 256 MiB cap, 256 MiB of a 300 MiB bound; one at a time, never both."""
    bound, cap = 100 * 2**20, 256 * 2**20
    assert convolution_workspace(1, bound_bytes=bound) == [("workspace", bound), ("workspace", FREE)]
    backward = convolution_workspace(2, bound_bytes=bound, cap_bytes=cap)
    assert backward == [("workspace", bound), ("workspace", FREE)] * 2
    assert peak_bytes(backward) == bound
    assert peak_bytes(convolution_workspace(2, bound_bytes=300 * 2**20, cap_bytes=cap)) == cap
    assert convolution_workspace(0, bound_bytes=bound) == []
    assert convolution_workspace(2, bound_bytes=bound, cap_bytes=0) == []  # a cap of 0: no workspace


def test_the_cap_is_cudnns_variable_in_mib_and_none_without_it() -> None:
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "512"}) == 512 * 2**20
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "0"}) == 0
    assert conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "lots"}) is None
    assert conv_workspace_cap_bytes({}) is None


def test_a_convolution_off_cudnn_takes_no_workspace_and_the_warning_says_which_case() -> None:
    """The meter's reading of a convolution: ATen's own backend selection decides whether cuDNN runs it (on
    CPU tensors it never does); the warning says the workspaces are a stated bound, and the cap where set."""
    import torch

    from autotune.measure.meters.temporaries import KernelFacts, op_temporaries, unmodelled

    aten = torch.ops.aten
    images, weight = torch.zeros(2, 3, 8, 8), torch.zeros(4, 3, 3, 3)
    facts = KernelFacts(capability=(9, 0), sm_count=132, conv_workspace_cap_bytes=64 * 2**20)
    forward_args = (images, weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert op_temporaries(aten.convolution.default, forward_args, facts) == []
    capped = unmodelled(aten.convolution.default, facts)
    assert capped is not None and "capped at 64 MiB by the job's CUDNN_CONV_WSCAP_DBG" in capped
    uncapped = unmodelled(aten.convolution_backward.default, KernelFacts(capability=(9, 0), sm_count=132))
    assert uncapped is not None and uncapped.startswith("cuDNN convolution workspaces are a stated bound")
    assert "capped" not in uncapped and "\n" not in uncapped
    assert unmodelled(aten.mm.default, facts) is None
