"""``--levers`` on an emulated card (issue 61): each change of the setup is estimated on the same card, so its m_max is
the card's m_max of the changed setup and its figure at the job's m_max the card's (reserved + outside the allocator),
where the levers once answered ``null`` without a word for a card's estimate.

The emulated runs need a CUDA build of torch (``make .venv-cuda``, which ``make test`` builds); without one they skip,
saying so, except under CI=true (the ``cuda_python`` fixture).
"""

from __future__ import annotations

import dataclasses

from autotune.orchestrate.config import EstimateConfig
from autotune.orchestrate.estimate import estimate
from autotune.tasks.load import load_task

MiB = 1 << 20
MLP = "examples/mlp.py:task"


def _on_card(**setup: object) -> EstimateConfig:
    return EstimateConfig.of(gpu="h100", budget_bytes=80 * MiB, context_bytes=0, **setup)


def test_each_lever_is_the_changed_setup_on_the_card(cuda_python: str) -> None:
    task = load_task(MLP)
    profile = estimate(task, _on_card(levers=True))
    assert profile.device.name.startswith("NVIDIA H100") and profile.levers is not None
    m_max = profile.max_micro_batch
    job = next(t for t in profile.trials if t.micro_batch == m_max and t.fits)
    pulled = {lever.flags: lever for lever in profile.levers if lever.max_micro_batch is not None}
    print({flags: (lever.max_micro_batch, lever.peak_bytes) for flags, lever in pulled.items()}, "m_max", m_max)
    lever = pulled["--optimizer adamw8bit"]
    changed = estimate(dataclasses.replace(task, optimizer="adamw8bit"), _on_card(micro_batches=(m_max,)))
    assert lever.max_micro_batch == changed.max_micro_batch
    at_job = next(t for t in changed.trials if t.micro_batch == m_max)
    # The card's figure (reserved, a whole number of the allocator's segments, + outside), not live bytes.
    assert lever.peak_bytes == at_job.peak_bytes and at_job.allocated_bytes is not None
    assert at_job.peak_bytes % (2 * MiB) == 0 and at_job.allocated_bytes < at_job.peak_bytes
    assert lever.freed_bytes == job.peak_bytes - at_job.peak_bytes
    assert all(lever.at_micro_batch == m_max for lever in profile.levers)
