"""`autotune estimate --gpu NAME --cp N`: context parallelism on an emulated card, under ddp, fsdp and fsdp x tp.
Rank 0 of the cp group (the most loaded, tests/autotune/test_context_parallel.py) runs in the emulated child with
fake CUDA tensors: SDPA reaches torch's own CUDA flash op and its context-parallel rule (torch's ring flash
attention, no CPU adapter), the fake process group's collectives hand back fake buffers, and each trial is replayed
through the caching allocator's model.

What is checked against the same rank's fake trial with CPU semantics (whose figures the real gloo ranks hold,
tests/autotune/test_context_parallel.py), on an attention-heavy Llama where the peak is in the ring: the card's
allocated bytes are the CPU-semantics bytes (the ring's gathered key/value, merges and gradients counted on both),
plus at most what CUDA's flash backward takes of its own for one ring block (``softmax_d`` and ``dq_accum``, float,
the queries rounded to 128: flash_attn's ``mha_bwd``), which no CPU kernel has, plus the two cuBLAS handles'
workspaces (32 MiB each on sm90, torch's CublasHandlePool default) and the allocator's rounding of each block to
512 bytes; the reserved bytes hold them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from autotune.cli import main
from autotune.core.mesh import Mesh
from autotune.core.schemas import Profile, Strategy
from autotune.measure.context_parallel import ContextParallel
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.trial import TrialRunner
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")

# One block of 8 heads of 64 over a hidden size of 32 (test_context_parallel.py's ATTENTION_HEAVY): the peak is in
# the ring's backward. bf16: the flash kernel on an H100 (fp32 would take the math path, which DTensor refuses).
HEADS, HEAD_DIM, SEQ_LEN, M = 8, 64, 256, 4
CONFIG = {
    "tie_word_embeddings": False,
    "vocab_size": 32,
    "hidden_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
    "intermediate_size": 32,
    "max_position_embeddings": 1024,
}
# A scalar the CPU-semantics trial holds and the card's does not (40 bytes, measured): well under a block.
SLACK_BYTES = 64
CUBLAS_WORKSPACES = 2 * 32 * 2**20
# The caching allocator rounds each block up to 512 bytes: at most 511 bytes for each of the few hundred tensors
# live at the peak (7,400 bytes measured).
ROUNDING_BYTES = 65_536


@pytest.mark.parametrize(("strategy", "tp"), [("ddp", 1), ("fsdp", 1), ("fsdp", 2)])
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")  # fsdp x tp's root returns the gathered logits, a view
def test_cp2_estimates_on_an_emulated_card_as_the_cpu_rank_plus_cudas_flash_scratch(
    cuda_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, strategy: Strategy, tp: int
) -> None:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    folder = write_config(tmp_path, "llama", **CONFIG)
    out = tmp_path / "cp.json"
    code = main(
        ["estimate", f"hf:{folder}", "--gpu", "h100", "--precision", "bf16", "--world-size", str(2 * tp), "--cp", "2",
         "--tp", str(tp), "--strategy", strategy, "--seq-len", str(SEQ_LEN), "--max-micro-batch", str(M),
         "--output", str(out)]
    )  # fmt: skip
    assert code == 0
    (raw,) = json.loads(out.read_text())
    profile = Profile.model_validate(raw)
    assert profile.device.name == "NVIDIA H100 80GB HBM3" and profile.source == "estimate"
    assert profile.mesh == Mesh(cp=2, tp=tp).as_dict() and profile.strategy == strategy
    assert profile.max_micro_batch == M  # a tiny model: the cap
    at_m = next(t for t in profile.trials if t.micro_batch == M)
    outside = at_m.outside_allocator_bytes
    assert at_m.fake and outside and at_m.allocated_bytes
    assert at_m.allocated_bytes <= at_m.peak_bytes - outside  # the allocator reserves what it hands out

    # The same rank (0 of the cp pair), fake, with CPU semantics, in this process.
    task = dataclasses.replace(hf_task(folder).at_length(SEQ_LEN), precision="bf16")
    cp = ContextParallel(2 * tp, Mesh(cp=2, tp=tp), inner=strategy)
    with cp.process_group(torch.device("cpu")):
        runner = TrialRunner(task, FakeMeter(1 << 40, "cpu"), limit_bytes=1 << 40, strategy=cp)
        cpu = runner(M).peak_bytes
        runner.close()
    # CUDA's flash backward over one ring block of the rank's L / 2 = 128 queries: softmax_d (m, H, 128) and
    # dq_accum (m, 128, H, 64), float.
    block = SEQ_LEN // 2
    flash_scratch = 4 * M * HEADS * block + 4 * M * block * HEADS * HEAD_DIM  # H / tp under tp: a bound still
    card = f"card allocated {at_m.allocated_bytes}, reserved + outside {at_m.peak_bytes}"
    print(f"cp 2 x tp {tp} ({strategy}) at m={M}: {card}; CPU {cpu}")
    on_card = at_m.allocated_bytes - CUBLAS_WORKSPACES
    assert cpu - SLACK_BYTES <= on_card <= cpu + flash_scratch + ROUNDING_BYTES


def test_fp32_grouped_attention_under_cp_on_a_card_is_one_line_and_exit_2(
    cuda_python: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp32 with fewer key/value heads than query heads: no flash (bf16/fp16 only), no efficient kernel (no GQA), so
    SDPA's math path, whose causal mask torch's ring cannot shard; the real job fails there too."""
    folder = write_config(tmp_path, "llama")  # 4 heads over 2 key/value heads
    out = tmp_path / "cp.json"
    code = main(
        ["estimate", f"hf:{folder}", "--gpu", "h100", "--world-size", "2", "--cp", "2", "--seq-len", "16",
         "--max-micro-batch", "2", "--output", str(out)]
    )  # fmt: skip
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autotune: error:")]
    assert code == 2 and len(errors) == 1 and "fp32 attention over grouped key/value heads (2 for 4)" in errors[0]
    assert not out.exists()
