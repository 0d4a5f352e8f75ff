"""A fake trial of an hf: model under a memory policy makes the masks the real trial makes (autotune/measure/meters/
fake.py, "Positions").

A checkpointed step keeps no KV cache, and without one transformers looks for packed sequences in the position ids it
made (an ``arange``). On real tensors it reads that they pack nothing and makes no mask (SDPA's is_causal); on a
FakeTensor, which it reads as a trace, it kept an m x L x L boolean mask: the fake trial of a tiny Llama under
``--ac full`` read 680,828 bytes at m = 2 where the real one reads 680,316 (issue 34). The real trial on the CPU meter
is the truth; position ids the batch brings (values the fake trial does not know) keep the mask, as before.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.trial import TrialRunner
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")
LIMIT_BYTES = 1 << 30


def _peaks(meter: CpuMeter, task: object) -> dict[int, int]:
    runner = TrialRunner(task, meter, limit_bytes=LIMIT_BYTES)  # type: ignore[arg-type]
    try:
        return {m: runner(m).peak_bytes for m in (1, 2)}
    finally:
        runner.close()


def test_under_full_checkpointing_a_fake_trial_counts_what_the_real_one_does(tmp_path: Path) -> None:
    task = dataclasses.replace(hf_task(write_config(tmp_path, "llama")).at_length(16), activation_checkpointing="full")
    real, fake = _peaks(CpuMeter(LIMIT_BYTES), task), _peaks(FakeMeter(LIMIT_BYTES, "cpu"), task)
    print(f"llama --ac full: real {real}, fake {fake}")
    assert fake == real


def test_the_mask_helpers_see_a_trace_again_after_a_fake_trial(tmp_path: Path) -> None:
    """The helpers' is_tracing is transformers' own outside a fake trial (a FakeTensor made elsewhere is a trace)."""
    import transformers.masking_utils as masking_utils
    from torch._subclasses.fake_tensor import FakeTensorMode

    before = masking_utils.is_tracing
    _peaks(FakeMeter(LIMIT_BYTES, "cpu"), hf_task(write_config(tmp_path, "llama")).at_length(16))
    assert masking_utils.is_tracing is before
    with FakeTensorMode():
        import torch

        assert masking_utils.is_tracing(torch.zeros(2))
