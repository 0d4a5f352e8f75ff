"""Where the memory goes, on the dashboard, in a real browser (headless Debian chromium under Playwright, a real
``autotune serve``): a real probe of a tiny Llama with its breakdown, uploaded through the client. The bars, the
table and the timelines are SVG drawn by the server (server/autotune_server/breakdown_chart.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from autotune.core.schemas import Lever, Profile
from autotune_client import TunerClient
from tests.e2e.conftest import LiveServer
from tests.e2e.test_dashboard import browser, page  # noqa: F401 -- the fixtures, shared

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def broken_down(live_server: LiveServer, tmp_path_factory: pytest.TempPathFactory) -> tuple[int, Profile]:
    from autotune.orchestrate.config import ProbeConfig
    from autotune.orchestrate.probe import probe
    from autotune.tasks.hf import hf_task
    from tests.autotune._hf_configs import write_config

    where: Path = tmp_path_factory.mktemp("breakdown")
    task = hf_task(write_config(where, "llama")).at_length(16)
    profile = probe(task, ProbeConfig(device="cpu", budget_bytes=1_000_000, headroom=0.0, breakdown=True))
    # Levers as --levers would store them (their figures are tested in tests/autotune/test_levers.py).
    profile.levers = [
        Lever(
            flags="--ac full",
            at_micro_batch=profile.max_micro_batch,
            peak_bytes=500_000,
            freed_bytes=400_000,
            max_micro_batch=7,
        ),
        Lever(flags="--compile", at_micro_batch=profile.max_micro_batch, note="<b>fake trials run the eager model</b>"),
    ]
    with TunerClient(base_url=live_server.url, token=live_server.token) as client:
        return client.upload(profile), profile


def test_the_profile_page_draws_the_breakdown_and_the_step(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    broken_down: tuple[int, Profile],
) -> None:
    number, profile = broken_down
    assert profile.breakdown is not None
    page.goto(f"{live_server.url}/profiles/{number}")
    section = page.locator("#breakdown")
    section.wait_for()
    # One segment per part that holds bytes, in each size's bar, each the bytes the profile says.
    for breakdown in profile.breakdown:
        drawn = page.locator(f"#breakdown svg.breakdown-bars rect.part[data-micro-batch='{breakdown.micro_batch}']")
        assert drawn.count() == len(breakdown.parts)
        assert {
            drawn.nth(i).get_attribute("data-part"): int(drawn.nth(i).get_attribute("data-bytes") or 0)
            for i in range(drawn.count())
        } == breakdown.parts
        # The segments are laid end to end, in proportion: together as wide as the bar's share of the scale.
        boxes = [drawn.nth(i).bounding_box() for i in range(drawn.count())]
        assert all(box is not None and box["width"] > 0 for box in boxes)
    widths = [
        sum(
            box["width"]
            for box in page.locator(f"rect.part[data-micro-batch='{b.micro_batch}']").evaluate_all(
                "els => els.map(e => e.getBoundingClientRect()).map(r => ({width: r.width}))"
            )
        )
        for b in profile.breakdown
    ]
    low, high = profile.breakdown
    assert widths[1] / widths[0] == pytest.approx(high.peak_bytes / low.peak_bytes, rel=0.01)
    # The table: a row per part, and the peaks.
    rows = page.locator("#breakdown table.breakdown-table tbody tr[data-part]")
    assert rows.count() == len(set(low.parts) | set(high.parts))
    assert "peak" in (page.locator("#breakdown tr.total").text_content() or "")
    # A timeline per size: a stacked area per part, the phases along the bottom, the peak marked where it was.
    timelines = page.locator("#breakdown svg.timeline")
    assert timelines.count() == 2
    first = timelines.nth(0)
    assert first.locator("polygon.area").count() == sum(
        1 for i in range(8) if any(point[i + 1] for point in low.timeline)
    )
    bands = first.locator("rect.phase")
    assert [bands.nth(i).get_attribute("data-phase") for i in range(bands.count())] == [name for _, name in low.phases]
    assert {"inputs", "forward", "backward", "step"} <= {name for _, name in low.phases}
    assert low.peak_where in (first.locator("text.peak-label").text_content() or "")
    assert page.console_errors == [] and page.dialogs == []


def test_the_profile_page_lists_the_levers_with_what_each_leaves_out(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    broken_down: tuple[int, Profile],
) -> None:
    number, _ = broken_down
    page.goto(f"{live_server.url}/profiles/{number}")
    rows = page.locator("#levers tbody tr")
    rows.first.wait_for()
    assert rows.count() == 2
    cells = [[" ".join(t.split()) for t in rows.nth(i).locator("td").all_text_contents()] for i in range(2)]
    assert cells == [
        ["--ac full", "390.62 KiB", "7", ""],
        ["--compile", "left out", "<b>fake trials run the eager model</b>"],
    ]
    assert page.locator("#levers b").count() == 0  # the note is text, escaped
    assert page.console_errors == [] and page.dialogs == []


@pytest.fixture(scope="module")
def pipelined(live_server: LiveServer) -> tuple[int, Profile]:
    from autotune.core.mesh import Mesh
    from autotune.orchestrate.config import ProbeConfig
    from autotune.orchestrate.probe import probe
    from examples import gpt

    mesh = Mesh(pp=2, pp_schedule="1f1b", pp_microbatches=2)
    config = ProbeConfig(device="cpu", budget_bytes=4_000_000, headroom=0.0, world_size=2, mesh=mesh, breakdown=True)
    profile = probe(gpt.task, config)
    with TunerClient(base_url=live_server.url, token=live_server.token) as client:
        return client.upload(profile), profile


def test_a_pipelines_breakdown_names_its_most_loaded_stage(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    pipelined: tuple[int, Profile],
) -> None:
    number, profile = pipelined
    assert profile.breakdown is not None and profile.pipeline is not None
    stage = profile.pipeline.most_loaded_stage
    page.goto(f"{live_server.url}/profiles/{number}")
    page.locator("#breakdown").wait_for()
    labels = [f"m = {b.micro_batch}, stage {b.stage}" for b in profile.breakdown]
    assert profile.breakdown[0].stage == stage
    bars = page.locator("#breakdown svg.breakdown-bars text.bar-label").all_text_contents()
    assert [text.split(" (")[0] for text in bars] == labels
    headers = page.locator("#breakdown table.breakdown-table thead th").all_text_contents()
    assert headers[1:] == labels
    headings = page.locator("#breakdown h3").all_text_contents()
    assert headings == [f"The step at {label}" for label in labels]
    assert "most loaded stage" in (page.locator("#breakdown p.muted").first.text_content() or "")
    assert page.console_errors == [] and page.dialogs == []
    shot = os.environ.get("AUTOTUNE_DASHBOARD_PIPELINE_SCREENSHOT")  # a path: the section, for a note or a doc
    if shot:
        page.locator("#breakdown").screenshot(path=shot)


def test_an_offloaded_profile_shows_the_hosts_peak_by_part(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    tmp_path: Path,
) -> None:
    """--offload params under fsdp: the host's peak by part (shards, gradients, AdamW's state, the CPU step's own),
    a table of its own under the device's, each cell the profile's bytes."""
    import dataclasses

    from autotune.orchestrate.config import ProbeConfig
    from autotune.orchestrate.probe import probe
    from examples.gpt import Block, GPTConfig, make_task

    tiny = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4)
    task = dataclasses.replace(make_task(tiny, name="gpt-tiny-offloaded"), shard_classes=(Block,))
    config = ProbeConfig(
        device="cpu", budget_bytes=2 << 20, strategy="fsdp", world_size=2, offload="params", breakdown=True
    )
    profile = probe(task, config)
    assert profile.breakdown and profile.breakdown[0].host_parts
    with TunerClient(base_url=live_server.url, token=live_server.token) as client:
        number = client.upload(profile)
    page.goto(f"{live_server.url}/profiles/{number}")
    table = page.locator("#host-breakdown")
    table.wait_for()
    rows = table.locator("tbody tr[data-part]")
    shown = {rows.nth(i).get_attribute("data-part") for i in range(rows.count())}
    assert shown == {part for b in profile.breakdown for part, nbytes in (b.host_parts or {}).items() if nbytes}
    assert {"trainable_parameters", "gradients", "optimizer_state"} <= shown
    assert "host peak" in (table.locator("tr.total").text_content() or "")
    assert page.console_errors == [] and page.dialogs == []
