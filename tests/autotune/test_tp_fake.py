"""--tp with fake tensors (``autotune estimate``): a fake trial of a tensor-parallel rank counts what the real
trial on the CPU meter counts, byte for byte, under ddp and under fsdp on a (dp, tp) mesh.

Two things stopped or skewed it (issue 34): FSDP2 over a tp mesh concatenates the dp and tp meshes and finds this
rank's coordinates with ``nonzero`` on a mesh tensor that was fake (the trial stopped there), and the fake kernel of
c10d's ``wait_tensor`` made a new tensor where the real op hands back its input (each DTensor collective's output
counted twice: 521,468 against 505,092 bytes at m = 2, tp 2). The real CPU trial's figures are the ones the
multi-process truth of tests/autotune/test_tensor_parallel.py agrees with (502,988 probed at m = 3, tp 2 x fsdp 2).

Under ``--ac full`` the fake trial read 256 bytes a micro-batch more (358,724 against 358,468 at m = 1): without a KV
cache transformers looks for packed sequences in the position ids, and on a FakeTensor (a trace, to it) it could not
read them, kept a 16 x 16 causal mask a micro-batch and gave up SDPA's is_causal, where the real trial reads that the
positions it made pack nothing and makes no mask (autotune/measure/meters/fake.py, "Positions").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch.distributed as dist

from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import TWO_LAYERS, write_config
from tests.autotune._tp_trials import LIMIT_BYTES, tp_peaks

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]


@pytest.mark.parametrize(("inner", "world_size", "sizes"), [("fsdp", 4, (3,)), ("ddp", 2, (2,))])
def test_a_fake_tp_trial_counts_what_the_real_one_does(
    tmp_path: Path, inner: str, world_size: int, sizes: tuple[int, ...]
) -> None:
    task = hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False, **TWO_LAYERS)).at_length(16)
    real = tp_peaks(CpuMeter(LIMIT_BYTES), task, inner, world_size, sizes)
    fake = tp_peaks(FakeMeter(LIMIT_BYTES, "cpu"), task, inner, world_size, sizes)
    print(f"tp 2 x {inner} {world_size}: real {real}, fake {fake}")
    assert fake == real
    if inner == "fsdp":
        assert real[3] == 502_988  # the probe's figure in docs/meshes.md, 16 bytes above the real ranks' floor


def test_under_full_checkpointing_a_fake_tp_trial_makes_no_mask_the_real_one_does_not(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama", tie_word_embeddings=False, **TWO_LAYERS)).at_length(16)
    task = dataclasses.replace(task, activation_checkpointing="full")
    real = tp_peaks(CpuMeter(LIMIT_BYTES), task, "ddp", 2, (1, 2))
    fake = tp_peaks(FakeMeter(LIMIT_BYTES, "cpu"), task, "ddp", 2, (1, 2))
    print(f"tp 2 x ddp 2, --ac full: real {real}, fake {fake}")
    assert real[1] == 358_468  # docs/meshes.md's figure; the fake read 358,724 (a 16 x 16 mask more)
    assert fake == real
