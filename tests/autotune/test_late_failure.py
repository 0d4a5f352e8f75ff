"""Long work keeps what it measured (issue 41): a failure late in a run over lengths (the longest-length search,
after every asked length is measured) leaves the measured profiles whole, with the failure said in their
warnings, instead of discarding them."""

from __future__ import annotations

from typing import Any

import pytest

import autotune.orchestrate.lengths as lengths
from autotune.orchestrate.lengths import probe_lengths
from autotune.orchestrate.probe import ProbeConfig, probe
from examples.gpt import GPTConfig, make_seq_task

MiB = 1 << 20
TINY = GPTConfig(seq_len=1024, d_model=16, n_heads=2, n_layers=2)


def test_a_failure_in_the_longest_length_search_keeps_every_length_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    # A failure outside any trial (a trial's own failure is the model's limit, said as one): a compiled model's
    # warm-up at a length, a library's error while the search holds its model.
    def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the compiled model's warm-up failed\nat a length past the asked ones")

    monkeypatch.setattr(lengths, "_longest", fails)
    config = ProbeConfig(device="cpu", budget_bytes=4 * MiB, target_batch=32, throughput=False)
    run = probe_lengths(make_seq_task(TINY), config, [32, 64])
    assert [p.seq_len for p in run.profiles] == [32, 64]
    said = "the longest-length search failed after every length was measured (RuntimeError: the compiled model's "
    for profile in run.profiles:
        # Each length's answer is the one a probe of that length alone gives, and the failure is said in one line.
        alone = probe(make_seq_task(TINY).at_length(profile.seq_len or 0), config)
        assert profile.max_micro_batch == alone.max_micro_batch
        assert [w for w in profile.warnings if w.startswith(said)] == [said + "warm-up failed)"], profile.warnings
    assert run.surface is not None and run.surface.longest is None
