"""The dashboard in a real browser: headless Debian chromium, driven by Playwright, against a real
``autotune serve`` on loopback whose profiles were uploaded through the API.

Playwright's own browser download cannot work here, so the test launches the system chromium by
its path. Without it the tests skip with the reason -- except under ``CI=true``, where they fail:
CI must not pass by skipping the browser it is meant to test (``make system-deps`` installs it).

Set ``AUTOTUNE_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to also write the datasheet screenshot
that the README shows; the tests never write into the checkout otherwise.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from autotune.core.schemas import Device, Fit, Observation, Plan, Profile, Throughput, Trial
from autotune_client import TunerClient
from tests.e2e.conftest import REPO, LiveServer
from tests.factories import fingerprint_for, make_profile

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# plotly.min.js is 4.6 MB of script to parse on a shared 2-core machine.
PAGE_TIMEOUT_MS = 60_000
XSS_TASK = "<img src=x onerror=alert(1)>"
GIB = 2**30


def _browser_missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: the browser tests must run; `make system-deps` installs it)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Debian's chromium, headless, under Playwright."""
    if not CHROMIUM.exists():
        _browser_missing(f"{CHROMIUM} is not installed")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _browser_missing("playwright (python) is not installed")
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield launched
        launched.close()


@dataclass
class Stored:
    """What the module uploaded: ids and the profiles as sent."""

    gpt_id: int
    gpt: Profile
    cnn_id: int
    xss_id: int


def gpt_profile() -> Profile:
    """A GPT on an 80 GiB card as a probe would store it: fits, one over the limit, one OOM, timings."""
    budget, headroom = 80 * GIB, 0.10
    fixed, per_sample = 10 * GIB, 2.5 * GIB

    def trial(m: int, *, oom: bool = False) -> Trial:
        peak = int(fixed + per_sample * m)
        if oom:
            return Trial(micro_batch=m, peak_bytes=budget - GIB // 4, fits=False, oom=True, seconds=0.8)
        return Trial(
            micro_batch=m,
            peak_bytes=peak,
            fits=peak <= budget * (1 - headroom),
            seconds=round(0.2 + 0.11 * m, 3),
            forward_backward_bytes=peak - GIB,
            allocated_bytes=peak - GIB // 2,
        )

    trials = [trial(1), trial(2), trial(28, oom=True), trial(25), trial(24), trial(12)]
    return Profile(
        fingerprint=fingerprint_for("e2e-dashboard-gpt"),
        task="examples/gpt.py:task",
        device=Device(kind="cuda", name="NVIDIA H100 80GB HBM3", index=0, total_bytes=budget),
        precision="bf16",
        tags={"suite": "e2e", "seq_len": 1024},
        budget_bytes=budget,
        headroom=headroom,
        max_micro_batch=24,
        plan=Plan(
            micro_batch=24,
            accumulation_steps=4,
            world_size=1,
            effective_batch=96,
            target_batch=96,
            exact=True,
            max_micro_batch=24,
        ),
        trials=trials,
        fit=Fit(fixed_bytes=fixed, bytes_per_sample=per_sample),
        trial_count=len(trials),
        oom_count=1,
        seconds=21.4,
        warnings=["m = 24 peaks at 70.00 GiB, within 2.00 GiB of the limit: leave the headroom in place"],
        # Timed runs after the search: one micro-batch of m_max, and the plan's update.
        throughput=[
            Throughput(
                micro_batch=24,
                samples_per_second=40.0,
                seconds_per_update=0.6,
                micro_batches=[(24, 1)],
                micro_batch_seconds=[(24, 0.5)],
                step_seconds=0.1,
                repeats=3,
            ),
            Throughput(
                micro_batch=24,
                samples_per_second=45.7,
                seconds_per_update=2.1,
                micro_batches=[(24, 4)],
                micro_batch_seconds=[(24, 0.5)],
                step_seconds=0.1,
                repeats=3,
            ),
        ],
        torch_version="2.13.0",
        autotune_version="0.1.0",
        created_at=datetime.now(timezone.utc) - timedelta(hours=3),
    )


@pytest.fixture(scope="module")
def stored(live_server: LiveServer) -> Stored:
    """Three profiles uploaded through the API, and one job's observation of the GPT."""
    gpt = gpt_profile()
    cnn = make_profile(
        fingerprint=fingerprint_for("e2e-dashboard-cnn"),
        task="examples/cnn.py:task",
        device_kind="cpu",
        device_name="cpu",
        precision="fp32",
        budget_bytes=64 * 2**20,
        fixed_bytes=8 * 2**20,
        bytes_per_sample=2 * 2**20,
        max_micro_batch=20,
    )
    xss = make_profile(fingerprint=fingerprint_for("e2e-dashboard-xss"), task=XSS_TASK, precision="fp16", seed=7)
    with TunerClient(base_url=live_server.url, token=live_server.token) as client:
        gpt_id = client.upload(gpt)
        stored = Stored(gpt_id=gpt_id, gpt=gpt, cnn_id=client.upload(cnn), xss_id=client.upload(xss))
        client.observe(gpt_id, Observation(micro_batch=24, peak_bytes=71 * GIB, note="nightly run"))
    return stored


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh page that records dialogs (alert, confirm, ...) and console errors."""
    context = browser.new_context(viewport={"width": 1360, "height": 1500})
    tab = context.new_page()
    tab.set_default_timeout(PAGE_TIMEOUT_MS)
    tab.dialogs = []
    tab.console_errors = []

    def on_dialog(dialog: Any) -> None:
        tab.dialogs.append(dialog.message)
        dialog.dismiss()

    tab.on("dialog", on_dialog)
    tab.on("console", lambda msg: tab.console_errors.append(msg.text) if msg.type == "error" else None)
    tab.on("pageerror", lambda error: tab.console_errors.append(str(error)))
    yield tab
    context.close()


def _row_tasks(tab: Any) -> list[str]:
    return [text.strip() for text in tab.locator("#profiles tbody td.task").all_inner_texts()]


def _wait_for_charts(tab: Any) -> None:
    tab.wait_for_selector("body[data-charts=ready]")


def _trace_lengths(tab: Any, chart: str) -> dict[str, int]:
    # Read what Plotly holds on the graph div: the traces it drew, by the name each carries in meta.
    script = "id => Object.fromEntries(document.getElementById(id).data.map(t => [t.meta, t.x.length]))"
    lengths: dict[str, int] = tab.evaluate(script, chart)
    return lengths


def test_the_table_lists_the_uploaded_profiles(page: Any, live_server: LiveServer, stored: Stored) -> None:
    page.goto(f"{live_server.url}/")
    assert sorted(_row_tasks(page)) == sorted(["examples/gpt.py:task", "examples/cnn.py:task", XSS_TASK])
    assert page.locator("#match-count").inner_text().endswith("of 3 profiles")
    gpt_row = page.locator(f"#profiles tr[data-profile-id='{stored.gpt_id}']")
    # m x A x D = effective batch, and the peak share of the largest fitting trial (70 GiB of 80).
    assert "24 × 4 × 1 = 96" in gpt_row.inner_text()
    assert "87.5%" in gpt_row.inner_text()


def test_the_filter_narrows_the_table(page: Any, live_server: LiveServer, stored: Stored) -> None:
    page.goto(f"{live_server.url}/")
    page.fill("input[name=q]", "cnn")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**q=cnn**")
    assert _row_tasks(page) == ["examples/cnn.py:task"]

    page.select_option("select[name=precision]", "bf16")
    page.fill("input[name=q]", "")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**precision=bf16**")
    assert _row_tasks(page) == ["examples/gpt.py:task"]


def test_the_table_filters_and_sorts_without_javascript(browser: Any, live_server: LiveServer, stored: Stored) -> None:
    context = browser.new_context(java_script_enabled=False)
    try:
        tab = context.new_page()
        tab.set_default_timeout(PAGE_TIMEOUT_MS)
        tab.goto(f"{live_server.url}/")
        tab.select_option("select[name=device]", "cpu")
        tab.click("form.filters button[type=submit]")
        tab.wait_for_url("**device=cpu**")
        assert _row_tasks(tab) == ["examples/cnn.py:task"]

        tab.goto(f"{live_server.url}/")
        tab.click("th a:has-text('m max')")
        tab.wait_for_url("**sort=m_max**")
        # m max: cnn 20, gpt 24, the xss profile 24 (ties: newest upload first).
        assert _row_tasks(tab) == ["examples/cnn.py:task", XSS_TASK, "examples/gpt.py:task"]
    finally:
        context.close()


def test_the_datasheet_draws_both_charts_with_every_point(page: Any, live_server: LiveServer, stored: Stored) -> None:
    page.goto(f"{live_server.url}/profiles/{stored.gpt_id}")
    _wait_for_charts(page)
    trials = stored.gpt.trials
    memory = _trace_lengths(page, "chart-memory")
    assert memory["trials-fit"] == sum(t.fits for t in trials) == 4
    assert memory["trials-over"] == sum(not t.fits and not t.oom for t in trials) == 1
    assert memory["trials-oom"] == sum(t.oom for t in trials) == 1
    assert memory["observed"] == 1
    assert memory["budget"] == memory["limit"] == memory["chosen"] == 2
    assert memory["fit"] >= 2
    # Plotly drew a marker for each of those points in the SVG, not only kept the data.
    drawn = page.locator("#chart-memory .scatterlayer .trace .points path").count()
    assert drawn == 4 + 1 + 1 + 1
    # The time chart is the timed runs' throughput (one point per timed update), not the trials' seconds.
    timing = _trace_lengths(page, "chart-time")
    assert timing == {"throughput-none": len(stored.gpt.throughput or [])} == {"throughput-none": 2}
    assert page.locator("#chart-time .main-svg").count() >= 1
    assert "samples per second (timed run)" in (page.locator("#chart-time").text_content() or "")
    customdata = page.evaluate(
        "() => document.getElementById('chart-memory').data.find(t => t.meta === 'trials-fit').customdata"
    )
    assert [row[0] for row in customdata] == ["12.50 GiB", "15.00 GiB", "70.00 GiB", "40.00 GiB"]
    # Hovering the point at m = 24 shows m and its peak in binary units.
    # Plotly's drag layer lies over the points and takes the events: move the mouse, as a person would.
    box = page.locator("#chart-memory .scatterlayer .trace").first.locator(".points path").nth(2).bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = page.locator("#chart-memory .hoverlayer")
    hover.locator("text", has_text="70.00 GiB").first.wait_for()
    assert "m = 24" in (hover.text_content() or "")
    # The datasheet marks the OOM trial and shows the job's observation.
    assert page.locator("#trials tr.oom").count() == 1
    assert "nightly run" in page.locator("#observations").inner_text()
    assert page.console_errors == []


def test_the_xss_task_name_is_text_and_runs_nothing(
    page: Any, live_server: LiveServer, stored: Stored, tmp_path: Path
) -> None:
    page.goto(f"{live_server.url}/")
    page.get_by_text(XSS_TASK, exact=True).wait_for(state="visible")
    page.goto(f"{live_server.url}/profiles/{stored.xss_id}")
    _wait_for_charts(page)
    heading = page.locator("#task-name")
    assert heading.inner_text() == XSS_TASK
    assert heading.is_visible()
    assert page.locator("img").count() == 0
    assert page.dialogs == []
    assert page.title().startswith(XSS_TASK)
    assert page.console_errors == []


def test_screenshot_of_a_datasheet(page: Any, live_server: LiveServer, stored: Stored, tmp_path: Path) -> None:
    page.goto(f"{live_server.url}/profiles/{stored.gpt_id}")
    _wait_for_charts(page)
    shot = tmp_path / "dashboard.png"
    page.screenshot(path=str(shot), full_page=True)
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    target = os.environ.get("AUTOTUNE_DASHBOARD_SCREENSHOT")
    if target:
        destination = Path(target) if Path(target).is_absolute() else REPO / target
        shutil.copyfile(shot, destination)


def test_a_missing_profile_is_a_404_page(page: Any, live_server: LiveServer, stored: Stored) -> None:
    response = page.goto(f"{live_server.url}/profiles/999999")
    assert response is not None and response.status == 404
    assert "No such profile" in page.locator("h1").inner_text()
