"""The sequence-length view in a real browser: headless Debian chromium under Playwright against a
real ``autotune serve``, holding one real surface probe of the GPT example (L = 128, 256, 512 on a
64 MiB CPU budget; tests/data/surface_gpt.json) uploaded through the client.

Set ``AUTOTUNE_DASHBOARD_SURFACE_SCREENSHOT=docs/dashboard-surface.png`` to also write the
screenshot that the README shows; the tests never write into the checkout otherwise.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from autotune.core.schemas import Profile
from autotune_client import TunerClient
from tests.e2e.conftest import REPO, LiveServer
from tests.e2e.test_dashboard import browser, page  # noqa: F401 -- the fixtures, shared
from tests.factories import profile_payload, surface_gpt_payloads


@pytest.fixture(scope="module")
def lengths(live_server: LiveServer) -> dict[int, int]:
    """The surface probe's three profiles and one profile without a length: ids by length (0 for it)."""
    profiles = [Profile.model_validate(body) for body in surface_gpt_payloads()]
    with TunerClient(base_url=live_server.url, token=live_server.token) as client:
        ids = {int(p.seq_len or 0): client.upload(p) for p in profiles}
        ids[0] = client.upload(Profile.model_validate(profile_payload(task="not-sequence-aware")))
    return ids


def _wait_for_charts(tab: Any) -> None:
    tab.wait_for_selector("body[data-charts=ready]")


def _traces(tab: Any, chart: str) -> dict[str, dict[str, list[float]]]:
    script = "id => Object.fromEntries(document.getElementById(id).data.map(t => [t.meta, {x: t.x, y: t.y}]))"
    drawn: dict[str, dict[str, list[float]]] = tab.evaluate(script, chart)
    return drawn


def test_the_surface_datasheet_draws_points_line_and_links_the_siblings(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    lengths: dict[int, int],
) -> None:
    page.goto(f"{live_server.url}/profiles/{lengths[256]}")
    _wait_for_charts(page)
    drawn = _traces(page, "chart-lengths")
    assert drawn["measured-m-max"] == {"x": [128, 256, 512], "y": [36, 18, 9]}
    assert drawn["measured-tokens"]["y"] == [4608, 4608, 4608]
    # The surface's staircase: every step of m_max from 36 at L = 128 to 2 at L = 2048, through the points.
    corners = list(zip(drawn["surface-m-max"]["x"], drawn["surface-m-max"]["y"], strict=True))
    assert corners[0] == (128, 36) and corners[-1] == (2048, 2)
    assert {m for _, m in corners} == set(range(2, 37))
    assert [[m for at, m in corners if at <= length][-1] for length in (128, 256, 512)] == [36, 18, 9]
    assert drawn["longest"] == {"x": [2048], "y": [1]}
    # Plotly put a marker in the SVG for every point: 3 m_max, 3 tokens, the longest length.
    assert page.locator("#chart-lengths .scatterlayer .trace .points path").count() == 3 + 3 + 1
    # Both lines are drawn as paths, and both axes are titled.
    assert page.locator("#chart-lengths .scatterlayer .trace .js-line").count() == 2
    chart_text = page.locator("#chart-lengths").text_content() or ""
    assert "m max (sequences per micro-batch)" in chart_text and "tokens per micro-batch (m max × L)" in chart_text
    # Hovering this profile's point says its length, m_max and tokens.
    box = page.locator("#chart-lengths .scatterlayer .trace .points path").nth(1).bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
    hover = page.locator("#chart-lengths .hoverlayer")
    hover.locator("text", has_text="(this one)").first.wait_for()
    assert "m max 18, 4,608 tokens" in (hover.text_content() or "")

    # The sibling lengths, linked; this profile named, not linked.
    links = page.locator("#length-siblings a")
    assert links.count() == 2
    assert [links.nth(i).get_attribute("href") for i in range(2)] == [
        f"/profiles/{lengths[128]}",
        f"/profiles/{lengths[512]}",
    ]
    assert "(this one)" in page.locator(f"#length-siblings tr[data-sibling-id='{lengths[256]}']").inner_text()
    links.nth(1).click()
    page.wait_for_url(f"**/profiles/{lengths[512]}")
    assert page.locator("#length-summary").inner_text().startswith("L = 512 · m max 9")
    _wait_for_charts(page)
    assert _traces(page, "chart-lengths")["measured-m-max"]["x"] == [128, 256, 512]
    assert page.console_errors == []


def test_the_table_shows_and_filters_the_length(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    lengths: dict[int, int],
) -> None:
    page.goto(f"{live_server.url}/")
    cells = {
        int(row.get_attribute("data-profile-id")): row.locator("td.seq-len").inner_text().strip()
        for row in page.locator("#profiles tbody tr").all()
    }
    assert cells == {lengths[128]: "128", lengths[256]: "256", lengths[512]: "512", lengths[0]: ""}
    page.fill("input[name=seq_len]", "512")
    page.click("form.filters button[type=submit]")
    page.wait_for_url("**seq_len=512**")
    assert [r.get_attribute("data-profile-id") for r in page.locator("#profiles tbody tr").all()] == [
        str(lengths[512])
    ]


def test_screenshot_of_a_surface_datasheet(
    page: Any,  # noqa: F811
    live_server: LiveServer,
    lengths: dict[int, int],
    tmp_path: Path,
) -> None:
    page.goto(f"{live_server.url}/profiles/{lengths[256]}")
    _wait_for_charts(page)
    box = page.locator("#lengths").bounding_box()
    assert box is not None
    shot = tmp_path / "dashboard-surface.png"
    # From the top of the page to the end of the sequence-length section: the part a reader looks at.
    page.screenshot(path=str(shot), clip={"x": 0, "y": 0, "width": 1360, "height": box["y"] + box["height"] + 16})
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 50_000
    target = os.environ.get("AUTOTUNE_DASHBOARD_SURFACE_SCREENSHOT")
    if target:
        destination = Path(target) if Path(target).is_absolute() else REPO / target
        shutil.copyfile(shot, destination)
