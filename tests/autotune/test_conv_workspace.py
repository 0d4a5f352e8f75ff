"""cuDNN convolution workspaces on CUDA: the stated bound per cuDNN call (two column matrices of the call's GEMM
lowering, autotune/core/kernel_temporaries.py), read from the convolution ops' arguments, and in the trace of
the CNN example on an emulated H200, with CUDNN_CONV_WSCAP_DBG capping it.

The column matrix's truth is torch's own ``unfold`` (im2col) of the input, which shares no code with the rule.
The emulated case needs a CUDA build of torch (``make .venv-cuda``); without one it skips, saying so (CI has it).
The CNN's answer against the card (m_max at 1 and 2 GiB) is a slow case: bench/emulated.py --part cnn.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from autotune.core.allocator import FREE
from autotune.core.kernel_temporaries import (
    CONV_WORKSPACE_COLUMN_MATRICES,
    conv_workspace_cap_bytes,
    convolution_output_spatial,
    convolution_workspace_bound,
    im2col_columns_bytes,
)
from autotune.measure.meters import temporaries
from autotune.measure.meters.temporaries import KernelFacts, op_temporaries

aten = torch.ops.aten
MiB = 1 << 20
H200 = KernelFacts(capability=(9, 0), sm_count=132)
# (N, C_in, H, W, C_out, kernel, stride, padding, dilation): the CNN's layers, a strided 7 x 7 stem, a dilated
# 3 x 5, a 1 x 1 projection.
CONV2D_SHAPES = [
    (4, 3, 32, 32, 16, (3, 3), (1, 1), (1, 1), (1, 1)),
    (4, 16, 16, 16, 32, (3, 3), (1, 1), (1, 1), (1, 1)),
    (2, 3, 224, 224, 64, (7, 7), (2, 2), (3, 3), (1, 1)),
    (3, 8, 20, 17, 8, (3, 5), (1, 2), (2, 0), (2, 1)),
    (5, 64, 14, 14, 256, (1, 1), (1, 1), (0, 0), (1, 1)),
]


@pytest.mark.parametrize("shape", CONV2D_SHAPES)
def test_the_column_matrix_is_torchs_unfold(shape: tuple[Any, ...]) -> None:
    n, c, h, w, _, kernel, stride, padding, dilation = shape
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(n, c, h, w, dtype=dtype)
        unfolded = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        out = convolution_output_spatial((h, w), kernel, stride, padding, dilation)
        assert im2col_columns_bytes(n, c, kernel, out, itemsize=x.element_size()) == unfolded.numel() * x.element_size()


def test_the_bound_for_conv1d_conv3d_and_the_cnn() -> None:
    """conv1d: the 2-D unfold of a height-1 input; conv3d by hand: 2 x 4 channels x 27 taps x 4 x 4 x 4
    positions x 2 bytes, twice; the CNN at m = 1152 in fp32: 243, 324 and 162 MiB for its three layers."""
    x = torch.zeros(3, 6, 1, 50)
    columns_1d = F.unfold(x, (1, 5), padding=(0, 2), stride=(1, 3)).numel() * 4
    out_1d = convolution_output_spatial((50,), (5,), (3,), (2,), (1,))
    assert out_1d == [17]
    assert convolution_workspace_bound(3, 6, (5,), out_1d, itemsize=4) == CONV_WORKSPACE_COLUMN_MATRICES * columns_1d
    out_3d = convolution_output_spatial((8, 8, 8), (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1))
    assert out_3d == [4, 4, 4]
    assert convolution_workspace_bound(2, 4, (3, 3, 3), out_3d, itemsize=2) == 2 * (2 * 4 * 27 * 64 * 2)
    cnn = [convolution_workspace_bound(1152, c, (3, 3), (s, s), itemsize=4) for c, s in ((3, 32), (16, 16), (32, 8))]
    assert cnn == [2 * 1152 * c * 9 * s * s * 4 for c, s in ((3, 32), (16, 16), (32, 8))]
    assert [b // MiB for b in cnn] == [243, 324, 162]


def _sizes(steps: list[tuple[str, int]]) -> list[int]:
    return [n for _, n in steps if n != FREE]


def test_the_ops_arguments_give_the_bound_where_cudnn_runs_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where ATen's selection says cuDNN (forced here: this torch has no CUDA), the forward gets one workspace,
    the backward one per gradient its mask asks for; grouped convolutions count every group's columns, a
    transposed convolution's column matrix is its output's channels at its input's positions."""
    monkeypatch.setattr(temporaries, "_on_cudnn", lambda *args: True)
    x, w = torch.zeros(4, 16, 16, 16), torch.zeros(32, 16, 3, 3)
    bound = 2 * 4 * 16 * 9 * 256 * 4
    forward = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    assert _sizes(op_temporaries(aten.convolution.default, forward, H200)) == [bound]
    grad_y = torch.zeros(4, 32, 16, 16)
    backward = (grad_y, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    assert _sizes(op_temporaries(aten.convolution_backward.default, backward, H200)) == [bound, bound]
    first_layer = (*backward[:10], [False, True, False])
    assert _sizes(op_temporaries(aten.convolution_backward.default, first_layer, H200)) == [bound]
    # groups = 4: weight (32, 4, 3, 3) over 16 input channels, the same columns as one group of 16
    grouped = (x, torch.zeros(32, 4, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 4)
    assert _sizes(op_temporaries(aten.convolution.default, grouped, H200)) == [bound]
    # ConvTranspose2d(32 -> 16, 3, stride 2): input (4, 32, 8, 8), weight (32, 16, 3, 3): 16 x 9 x 64 columns
    transposed = (torch.zeros(4, 32, 8, 8), torch.zeros(32, 16, 3, 3), None, [2, 2], [1, 1], [1, 1], True, [1, 1], 1)
    assert _sizes(op_temporaries(aten.convolution.default, transposed, H200)) == [2 * 4 * 16 * 9 * 64 * 4]
    capped = KernelFacts(capability=(9, 0), sm_count=132, conv_workspace_cap_bytes=MiB)
    assert _sizes(op_temporaries(aten.convolution.default, forward, capped)) == [MiB]


def _scratch_sizes(events: Sequence[tuple[int, int]]) -> list[int]:
    """The sizes of allocations freed by the very next event: a kernel's temporaries."""
    return [n for (key, n), (after, m) in zip(events, events[1:], strict=False) if m == FREE and after == key]


def test_the_cnns_workspaces_are_in_the_emulated_h200s_trace(cuda_python: str) -> None:
    """The CNN example at m = 2 on an emulated H200: every cuDNN call's workspace at its bound, in the step's
    order (forward: 3 layers; backward: the third and second layers' grad_input and grad_weight, the first's
    grad_weight only), once per step."""
    from autotune.emulation import run_emulated_trials

    layers = [convolution_workspace_bound(2, c, (3, 3), (s, s), itemsize=4) for c, s in ((3, 32), (16, 16), (32, 8))]
    one_step = [*layers, layers[2], layers[2], layers[1], layers[1], layers[0]]
    (trial,) = run_emulated_trials("examples/cnn.py:task", (2,), card="h200").trials
    found = [n for n in _scratch_sizes(trial.events) if n in set(layers)]
    assert len(found) >= len(one_step) and found == one_step * (len(found) // len(one_step))


def test_the_child_reads_the_jobs_cap(tmp_path: Path) -> None:
    """The cap reaches the emulated card's child (its environment is this process's, which kernel_facts reads
    there): CUDNN_CONV_WSCAP_DBG=1 makes the first layer's 1.7 MiB at m = 8 one MiB, 0 none."""
    from autotune.core.cards import lookup
    from autotune.emulation import child_environment
    from autotune.emulation.build import EmulationLibraries

    libraries = EmulationLibraries(tmp_path / "libautotune_cudart.so", tmp_path / "driver", tmp_path)
    env = child_environment(lookup("h200"), libraries, driver_version=13000, base={"CUDNN_CONV_WSCAP_DBG": "1"})
    assert conv_workspace_cap_bytes(env) == MiB
    monkey_facts = KernelFacts(capability=(9, 0), sm_count=132, conv_workspace_cap_bytes=conv_workspace_cap_bytes(env))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(temporaries, "_on_cudnn", lambda *args: True)
        forward = (torch.zeros(8, 3, 32, 32), torch.zeros(16, 3, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        assert _sizes(op_temporaries(aten.convolution.default, forward, monkey_facts)) == [MiB]
        none = KernelFacts(
            capability=(9, 0),
            sm_count=132,
            conv_workspace_cap_bytes=conv_workspace_cap_bytes({"CUDNN_CONV_WSCAP_DBG": "0"}),
        )
        assert op_temporaries(aten.convolution.default, forward, none) == []
