"""autotune_client.observer(): a job reports its peak without effort, never blocking or failing training."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.core.schemas import Observation
from autotune.loop.accumulate import Accumulator
from autotune_client import PeakObserver, observer
from tests.client._factories import FINGERPRINT, make_profile, make_suggestion
from tests.client.conftest import WRITE_TOKEN

MiB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _collecting(peaks: list[int], clock: Clock, **policy: Any) -> tuple[PeakObserver, list[Observation]]:
    posted: list[Observation] = []
    obs = PeakObserver(
        posted.append,
        peak_bytes=lambda: peaks[-1],
        device_name="cpu",
        world_size=1,
        clock=clock,
        min_interval_seconds=60.0,
        **policy,
    )
    return obs, posted


def test_the_peak_goes_after_the_first_updates_then_at_a_bounded_rate_and_only_when_it_grew() -> None:
    peaks, clock = [1000], Clock()
    obs, posted = _collecting(peaks, clock, max_reports=3)
    for update in (1, 2):
        obs.after_update(update, 26)
    assert obs.flush() and posted == []
    obs.after_update(3, 26)  # the first report
    clock.now, peaks[-1] = 30.0, 2000
    obs.after_update(4, 26)  # within the interval: not yet
    clock.now = 61.0
    obs.after_update(5, 26)  # due, and grown
    clock.now, peaks[-1] = 200.0, 2001
    obs.after_update(6, 26)  # due, but grown by less than 0.5 %
    for step, (now, peak) in enumerate(((300.0, 3000), (400.0, 4000)), start=7):
        clock.now, peaks[-1] = now, peak
        obs.after_update(step, 26)  # the third report, then the cap
    assert obs.flush()
    assert [(o.micro_batch, o.peak_bytes) for o in posted] == [(26, 1000), (26, 2000), (26, 3000)]
    assert posted[0].device_name == "cpu" and "world_size" in posted[0].model_fields_set
    assert "after 3 updates" in posted[0].note
    assert obs.sent == 3 and obs.failed == obs.dropped == 0


def test_a_slow_or_failing_tuner_never_blocks_or_fails_training() -> None:
    release = threading.Event()

    def stuck(_: Observation) -> None:
        release.wait(10)

    def refused(_: Observation) -> None:
        raise ConnectionError("tuner down")

    clock = Clock()
    slow = PeakObserver(stuck, peak_bytes=lambda: int(clock.now) + 1, clock=clock, min_interval_seconds=0.0)
    started = time.perf_counter()
    for update in range(1, 40):
        clock.now = update * 1000.0
        slow.after_update(update, 8)  # every one due and grown: the queue fills, then drops
    assert time.perf_counter() - started < 0.5
    assert slow.dropped > 0
    release.set()
    assert slow.flush()

    failing = PeakObserver(refused, peak_bytes=lambda: 5, clock=clock)
    failing.after_update(3, 8)
    failing(Observation(micro_batch=16, oom=True))
    assert failing.flush()
    assert failing.failed == 2 and failing.sent == 0 and failing.last_error == "ConnectionError: tuner down"

    broken_peak = PeakObserver(lambda _: None, peak_bytes=lambda: 1 // 0, clock=clock)
    broken_peak.after_update(3, 8)
    assert broken_peak.failed == 1 and broken_peak.last_error is not None


def test_without_a_stored_profile_or_a_server_nothing_is_reported(monkeypatch: Any) -> None:
    monkeypatch.delenv("AUTOTUNE_URL", raising=False)
    probed = observer(make_suggestion(profile_id=None, source="probed"))
    assert probed.disabled_reason is not None and "no stored profile" in probed.disabled_reason
    probed.after_update(5, 16)  # nothing to do, and no error
    no_server = observer(make_suggestion())
    assert no_server.disabled_reason is not None and "AUTOTUNE_URL" in no_server.disabled_reason


def test_a_training_loop_reports_its_peak_and_the_next_answer_takes_the_drift(
    in_process_server: Callable[..., Any],
) -> None:
    client = in_process_server(token=WRITE_TOKEN)
    profile_id = client.upload(make_profile(max_micro_batch=50))  # 1 MiB + 1 MiB x m within 57.6 MiB
    plan = client.suggest(fingerprint=FINGERPRINT, device_name="cpu", target_batch=100, world_size=1)
    assert (plan.profile_id, plan.micro_batch, plan.accumulation_steps) == (profile_id, 50, 2)

    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(400, 8), torch.randn(400, 1))
    # The job's peak runs 15 % above the probe's 51 MiB at m = 50 (as the CPU meter of a longer run might).
    report = observer(plan, client=client, peak_bytes=lambda: round(51 * MiB * 1.15), first_report_after=3)
    acc = Accumulator(model, optimizer, accumulation_steps=plan.accumulation_steps, observe=report)
    for group in acc.groups(DataLoader(data, batch_size=plan.micro_batch)):
        for x, y in group:
            with acc.micro_step():
                acc.backward(nn.functional.mse_loss(model(x), y, reduction="sum"))
        acc.step()
    assert acc.counters.updates == 4
    assert report.flush() and (report.sent, report.failed) == (1, 0)

    stored = client._request("GET", f"/profiles/{profile_id}/observations").json()["items"]
    assert [(o["micro_batch"], o["peak_bytes"]) for o in stored] == [(50, round(51 * MiB * 1.15))]
    after = client.suggest(fingerprint=FINGERPRINT, device_name="cpu", target_batch=100, world_size=1)
    # 57.6 MiB / 1.15 = 50.1 MiB: m = 49 (50 MiB).
    assert after.max_micro_batch == 49
    assert "1 job observed up to 15.0 % above the probe at m = 50; answering 49" in after.warnings
