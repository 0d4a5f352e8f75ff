"""On a real GPU: one probe over three sequence lengths, the surface's answers against the real
CUDA trials that confirm them (allocator rounding and workspaces are what the fake surface cannot
see), and the longest length at m = 1."""

from __future__ import annotations

from autotune.measure.strategy_choice import make_strategy
from autotune.orchestrate.lengths import probe_lengths
from autotune.orchestrate.probe import ProbeConfig
from autotune.search.presearch import fake_surface
from autotune.tasks.load import load_task

GiB = 1 << 30
LENGTHS = [256, 512, 1024]


def test_a_probe_over_lengths_on_cuda_confirms_each_answer_with_real_trials() -> None:
    task = load_task("examples/gpt.py:task_seq")
    config = ProbeConfig(device="cuda:0", budget_bytes=2 * GiB, target_batch=256, throughput=False)
    run = probe_lengths(task, config, LENGTHS)
    assert [p.seq_len for p in run.profiles] == LENGTHS
    surface = run.surface
    assert surface is not None, [p.warnings for p in run.profiles]
    found = fake_surface(
        task, LENGTHS, limit_bytes=run.profiles[0].limit_bytes, device_type="cuda", strategy=make_strategy("ddp", 1),
        multiple_of=1,
    )  # fmt: skip
    assert found.surface is not None
    for profile in run.profiles:
        assert profile.seq_len is not None
        real = [t for t in profile.trials if not t.fake]
        predicted = found.surface.max_fitting(profile.limit_bytes, profile.seq_len, cap=4096)
        print(
            f"L={profile.seq_len}: real m_max {profile.max_micro_batch}, fake surface {predicted}, "
            f"real trials {[(t.micro_batch, t.fits) for t in real]}, offset {surface.offset_bytes} bytes"
        )
        # Exact: m_max fits and m_max + 1 does not, on the card; a handful of real trials.
        assert any(t.micro_batch == profile.max_micro_batch and t.fits for t in real)
        assert any(t.micro_batch == profile.max_micro_batch + 1 and not t.fits for t in real)
        assert len(real) <= 6
        assert abs(profile.max_micro_batch - predicted) <= max(2, predicted // 4)
    assert surface.longest is not None
    print(f"longest L at m=1 on cuda: {surface.longest.seq_len} ({surface.longest.limited_by})")
    assert surface.longest.seq_len >= LENGTHS[-1]
