"""Mixture of experts through fake trials: a tiny Mixtral-style config (4 experts, top-2) routes in a fake trial
by the stated rule (autotune.measure.meters.fake.routed_indices), so the probe uses the pre-search and estimate
answers; checked against the CPU allocator's own count of the model built the ordinary way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autotune.cli import main
from autotune.measure.meters.cpu import CpuMeter
from autotune.measure.meters.fake import FakeMeter, experts_of, moe_routing, routed_indices
from autotune.measure.trial import TrialRunner, build_on_meta
from autotune.orchestrate.estimate import EstimateConfig, estimate
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import CONFIGS

MiB = 1 << 20
SEQ_LEN = 16
MIXTRAL = {
    **CONFIGS["llama"],
    "model_type": "mixtral",
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
}


def _config(tmp_path: Path, **overrides: object) -> Path:
    where = tmp_path / "mixtral"
    where.mkdir(exist_ok=True)
    (where / "config.json").write_text(json.dumps({**MIXTRAL, **overrides}))
    return where


def _task(tmp_path: Path, **overrides: object) -> ProbeTask:
    return load_task(f"hf:{_config(tmp_path, **overrides)}").at_length(SEQ_LEN)


def _autotune(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse refuses a flag's value this way
        return int(exc.code or 0)


def test_the_routing_rule_balances_and_loads_the_busiest_expert() -> None:
    balanced = routed_indices(64, 4, 2).flatten().bincount().tolist()
    assert balanced == [32, 32, 32, 32]
    loaded = routed_indices(64, 4, 2, 1.5).flatten().bincount().tolist()
    assert loaded[0] == 48 and sum(loaded) == 128
    # Every token picks k distinct experts.
    assert all(len(set(row)) == 2 for row in routed_indices(64, 4, 2, 2.0).tolist())


def _fake_peak(task: ProbeTask, micro_batch: int, factor: float) -> int:
    with moe_routing(factor):
        trial = TrialRunner(task, FakeMeter(1 << 30), limit_bytes=1 << 30)(micro_batch)
    assert trial.fits
    return trial.peak_bytes


def test_grouped_experts_do_not_depend_on_the_spread_and_equal_the_cpu_trial(tmp_path: Path) -> None:
    task = _task(tmp_path)  # transformers' default: grouped_mm, every token-expert pair one row
    meta = build_on_meta(task)
    assert meta is not None and experts_of(meta) == (4, 2)
    real = TrialRunner(task, CpuMeter(1 << 30), limit_bytes=1 << 30)(3)
    assert _fake_peak(task, 3, 1.0) == _fake_peak(task, 3, 2.0) == real.peak_bytes


def test_experts_one_after_another_grow_with_the_busiest_expert(tmp_path: Path) -> None:
    task = _task(tmp_path, experts_implementation="eager")
    # The real model routes by its random initial weights, and its peak follows that routing: unseeded, it read
    # 1.06 % above the balanced figure one CI run in several (seeds 0-7 here: -0.33 % to +0.43 %). Seeded, the
    # routing and so the truth are the same every run.
    torch.manual_seed(0)
    real = TrialRunner(task, CpuMeter(1 << 30), limit_bytes=1 << 30)(3)
    balanced, worst = _fake_peak(task, 3, 1.0), _fake_peak(task, 3, 2.0)
    # The saved activations follow the tokens routed; only the busiest expert's transient follows the spread,
    # and 2.0 (4 experts, top-2: every token on one expert) bounds any routing, the model's own included.
    assert balanced < worst
    assert real.peak_bytes <= worst
    assert abs(real.peak_bytes - balanced) < 0.01 * balanced


def test_probe_uses_the_presearch_and_is_exact_against_the_allocator(tmp_path: Path) -> None:
    task = _task(tmp_path)
    budget = 2 * MiB
    config = ProbeConfig(device="cpu", budget_bytes=budget, target_batch=64)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    real = [t for t in measured.trials if not t.fake]
    assert len(real) == 2 and any(t.fake for t in measured.trials)
    limit = int(budget * (1 - config.headroom))
    at_max = allocator_peak_bytes(task, m_max)
    past_max = allocator_peak_bytes(task, m_max + 1)
    assert at_max <= limit < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in real}
    assert peaks[m_max] == at_max and peaks[m_max + 1] == past_max
    estimated = estimate(task, EstimateConfig.of(budget_bytes=budget, device_kind="cpu", target_batch=64))
    assert estimated.max_micro_batch == m_max
    fake_at_max = [t.peak_bytes for t in estimated.trials if t.micro_batch == m_max]
    assert fake_at_max and fake_at_max[0] == peaks[m_max]


def test_estimate_says_the_routing_it_assumed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    where = _config(tmp_path)
    code = _autotune(
        ["estimate", f"hf:{where}", "--device-kind", "cpu", "--budget", "2MiB", "--target-batch", "8"]
        + ["--seq-len", str(SEQ_LEN), "--moe-load-factor", "1.5", "--json", "--max-seq-len", "32"]
    )
    out = capsys.readouterr()
    assert code == 0
    (profile,) = json.loads(out.out)
    assert profile["moe_load_factor"] == 1.5
    assert "fake_tensor.py" not in out.err  # torch's own log lines stay off the terminal


@pytest.mark.parametrize(
    ("arch", "factor", "says"),
    [("mixtral", "0.5", "below 1"), ("llama", "1.5", "dense model"), ("mixtral", "3", "at most 2")],
)
def test_bad_moe_load_factors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], arch: str, factor: str, says: str
) -> None:
    where = _config(tmp_path) if arch == "mixtral" else tmp_path / "llama"
    if arch == "llama":
        where.mkdir()
        (where / "config.json").write_text(json.dumps(CONFIGS["llama"]))
    output = tmp_path / "profile.json"
    code = _autotune(
        ["estimate", f"hf:{where}", "--device-kind", "cpu", "--budget", "2MiB", "--target-batch", "8"]
        + ["--seq-len", str(SEQ_LEN), "--moe-load-factor", factor, "--output", str(output)]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert "--moe-load-factor" in err[-1] and says in err[-1]
    assert not output.exists()
