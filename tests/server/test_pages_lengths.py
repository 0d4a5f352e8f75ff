"""The dashboard's sequence-length view through TestClient, on both databases: the table's L column
and filter, a surface profile's chart of m_max and tokens against L, and its sibling lengths.

The profiles are one real surface probe of the GPT example (tests/data/surface_gpt.json, made by
tests/data/make_surface_gpt.py): L = 128, 256, 512 at m_max 36, 18, 9 on a 64 MiB CPU budget.
"""

from __future__ import annotations

import copy
import html
import re
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autotune.core.schemas import Profile
from autotune.core.surface import PeakSurface
from autotune_server.dashboard_queries import TableQuery
from autotune_server.pages import parse_table_query, table_url
from autotune_server.surface_chart import CHART_ID, LINE_POINTS, MAX_STEP_WORK, MAX_STEPS, surface_line
from tests.factories import fingerprint_for, profile_payload, surface_gpt_payloads
from tests.server.conftest import WRITE
from tests.server.test_pages import chart_data, text_of, traces

ROW = re.compile(r'<tr data-profile-id="(\d+)">(.*?)</tr>', re.S)
MEASURED = {128: 36, 256: 18, 512: 9}


def post(client: TestClient, body: dict[str, Any]) -> int:
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


@pytest.fixture
def surface_ids(client: TestClient) -> dict[int, int]:
    """The surface probe's three profiles, stored through the API: profile id by length."""
    return {int(body["seq_len"]): post(client, body) for body in surface_gpt_payloads()}


def on_line(corners: list[tuple[int, int]], length: int) -> int:
    """m on a staircase given by its corners (ascending lengths) at length."""
    return [m for at, m in corners if at <= length][-1]


def length_cells(page: str) -> dict[int, str]:
    """The L cell of each table row, by profile id."""
    cells = {}
    for profile_id, row in ROW.findall(page):
        match = re.search(r'<td class="num seq-len">(.*?)</td>', row, re.S)
        assert match is not None
        cells[int(profile_id)] = match.group(1).strip()
    return cells


def test_the_table_shows_the_length_and_filters_by_it(client: TestClient, surface_ids: dict[int, int]) -> None:
    plain = post(client, profile_payload(task="not-sequence-aware", seed=1))
    page = client.get("/").text
    assert '<a href="/?sort=seq_len">L</a>' in page
    assert length_cells(page) == {**{i: str(length) for length, i in surface_ids.items()}, plain: ""}

    only = client.get("/", params={"seq_len": "256"}).text
    assert list(length_cells(only)) == [surface_ids[256]]
    assert 'name="seq_len" min="1" step="1" value="256"' in only and "Clear filters" in only
    assert 'href="/"' in only  # the clear link drops the length too
    assert "No profile matches" in client.get("/", params={"seq_len": "1024"}).text
    # Nonsense is no filter, as the other filters' nonsense is.
    for nonsense in ("abc", "0", "-5", "", "2.5", str(2**40)):
        assert len(length_cells(client.get("/", params={"seq_len": nonsense}).text)) == 4, nonsense
    # Sorted by L: shortest first, profiles without a length last either way.
    ascending = list(length_cells(client.get("/", params={"sort": "seq_len"}).text))
    assert ascending == [surface_ids[128], surface_ids[256], surface_ids[512], plain]
    descending = list(length_cells(client.get("/", params={"sort": "seq_len", "order": "desc"}).text))
    assert descending == [surface_ids[512], surface_ids[256], surface_ids[128], plain]


def test_the_length_filter_round_trips_through_the_url() -> None:
    query = parse_table_query({"seq_len": " 512 ", "q": "gpt"})
    assert query == TableQuery(text="gpt", seq_len=512) and query.filtered
    assert table_url("", query) == "/?q=gpt&seq_len=512"
    assert table_url("", query, seq_len=None) == "/?q=gpt"
    assert parse_table_query({"seq_len": "x"}).seq_len is None


def test_a_surface_datasheet_charts_m_max_and_tokens_against_length(
    client: TestClient, surface_ids: dict[int, int]
) -> None:
    body = surface_gpt_payloads()[1]
    response = client.get(f"/profiles/{surface_ids[256]}")
    assert response.status_code == 200
    page = response.text
    figure = chart_data(page)[CHART_ID]
    lines = traces(figure)
    assert f'<div class="chart" id="{CHART_ID}">' in page

    # The measured lengths are points at their profiles' m_max, and m_max x L on the right axis.
    assert lines["measured-m-max"]["x"] == [128, 256, 512]
    assert lines["measured-m-max"]["y"] == [36, 18, 9]
    assert lines["measured-tokens"]["y"] == [4608, 4608, 4608] and lines["measured-tokens"]["yaxis"] == "y2"
    assert lines["measured-m-max"]["marker"]["size"] == [10, 14, 10]  # this profile's point stands out

    # The surface line: m_max's staircase over the covered range, each step's first and last length.
    corners = list(zip(lines["surface-m-max"]["x"], lines["surface-m-max"]["y"], strict=True))
    assert corners[0][0] == 128 and corners[-1][0] == 2048
    assert {length: on_line(corners, length) for length in MEASURED} == MEASURED  # through every point
    assert {m for _, m in corners} == set(range(2, 37))  # every step, none skipped
    for (l1, m1), (l2, m2) in zip(corners, corners[1:], strict=False):
        assert l2 > l1 and (m2 == m1 or (l2 == l1 + 1 and m2 == m1 - 1)), (l1, l2)
    tokens = list(zip(lines["surface-tokens"]["x"], lines["surface-tokens"]["y"], strict=True))
    assert tokens == [(length, m * length) for length, m in corners]
    # Each m_max on the line is the largest m the surface puts within the profile's limit.
    surface = PeakSurface.from_dict(body["surface"])
    limit = int(body["budget_bytes"] * (1 - body["headroom"]))
    for length, m in corners:
        assert surface.peak_bytes(m, length) <= limit < surface.peak_bytes(m + 1, length), length

    # The longest length at m = multiple_of, as the probe confirmed it.
    assert lines["longest"]["x"] == [2048] and lines["longest"]["y"] == [1]
    assert figure["layout"]["xaxis"]["type"] == "log"
    assert figure["layout"]["xaxis"]["tickvals"] == [128, 256, 512, 1024, 2048]
    text = text_of(page)
    assert "L = 256 · m max 18 · 4,608 tokens per micro-batch" in text
    assert "covers L = 128 … 2048; measured at 128, 256, 512" in text
    assert "checked on a held-out trace at m = 4, L = 192" in text
    assert "longest L at m = 1 2048" in text and "--max-seq-len 2048, was reached: longer may fit" in text


def test_a_surface_datasheet_links_its_sibling_lengths(client: TestClient, surface_ids: dict[int, int]) -> None:
    # The same fingerprint measured on another device: listed, but not drawn (another limit's answer).
    elsewhere = copy.deepcopy(surface_gpt_payloads()[0])
    elsewhere["device"]["name"] = elsewhere["devices"][0]["name"] = "another-cpu"
    other_device = post(client, elsewhere)
    # Another fingerprint at the same length: neither listed nor drawn.
    stranger = copy.deepcopy(surface_gpt_payloads()[2])
    stranger["fingerprint"] = fingerprint_for("another model")
    post(client, stranger)

    page = client.get(f"/profiles/{surface_ids[256]}").text
    siblings = page.split('id="length-siblings"', 1)[1].split("</table>", 1)[0]
    rows = re.findall(r'<tr data-sibling-id="(\d+)"', siblings)
    # By length; at one length newest first (equal times: the later upload first).
    assert [int(i) for i in rows] == [other_device, surface_ids[128], surface_ids[256], surface_ids[512]]
    for length in (128, 512):
        assert f'<a href="/profiles/{surface_ids[length]}">profile {surface_ids[length]}</a>' in siblings
    assert f'href="/profiles/{surface_ids[256]}"' not in siblings  # itself: named, not linked
    assert f"profile {surface_ids[256]} (this one)" in text_of(siblings)
    other_row = siblings.split(f'data-sibling-id="{other_device}"', 1)[1].split("</tr>", 1)[0]
    assert "another-cpu" in other_row and "no: another setup" in text_of(other_row)
    # The chart keeps to this probe's setup.
    lines = traces(chart_data(page)[CHART_ID])
    assert lines["measured-m-max"]["x"] == [128, 256, 512]
    assert [row[0] for row in lines["measured-m-max"]["customdata"]] == [
        f"profile {surface_ids[128]}",
        f"profile {surface_ids[256]} (this one)",
        f"profile {surface_ids[512]}",
    ]
    # A sibling's own page links back.
    back = client.get(f"/profiles/{surface_ids[128]}").text
    assert f'<a href="/profiles/{surface_ids[256]}">profile {surface_ids[256]}</a>' in back


def test_a_length_without_a_surface_shows_its_points_only(client: TestClient) -> None:
    bodies = surface_gpt_payloads()
    ids = []
    for body in bodies[:2]:
        body["surface"] = None
        ids.append(post(client, body))
    page = client.get(f"/profiles/{ids[0]}").text
    assert "none: this length was searched on its own" in page
    lines = traces(chart_data(page)[CHART_ID])
    assert set(lines) == {"measured-m-max", "measured-tokens"}
    assert lines["measured-m-max"]["x"] == [128, 256] and lines["measured-m-max"]["y"] == [36, 18]
    assert f'<a href="/profiles/{ids[1]}">profile {ids[1]}</a>' in page


def test_a_profile_without_a_length_has_no_length_view(client: TestClient) -> None:
    profile_id = post(client, profile_payload(task="not-sequence-aware"))
    page = client.get(f"/profiles/{profile_id}").text
    assert 'id="lengths"' not in page and CHART_ID not in page
    assert CHART_ID not in chart_data(page)


def test_the_surface_line_takes_the_devices_offset_off_the_limit() -> None:
    body = surface_gpt_payloads()[0]
    plain = surface_line(Profile.model_validate(body))
    offset = 4 << 20
    body["surface"]["offset_bytes"] = offset
    raised = surface_line(Profile.model_validate(body))
    surface = PeakSurface.from_dict(body["surface"])
    limit = int(body["budget_bytes"] * (1 - body["headroom"]))
    assert raised[0][0] == 128 and raised[0][1] < on_line(plain, 128) == 36
    for length, m in raised:
        assert surface.peak_bytes(m, length) + offset <= limit < surface.peak_bytes(m + 1, length) + offset
        assert m <= on_line(plain, length)


def test_sibling_text_is_escaped(client: TestClient, surface_ids: dict[int, int]) -> None:
    body = copy.deepcopy(surface_gpt_payloads()[0])
    body["device"]["name"] = body["devices"][0]["name"] = "<img src=x onerror=alert(1)>"
    post(client, body)
    page = client.get(f"/profiles/{surface_ids[256]}").text
    assert "<img src=x" not in page
    assert html.escape("<img src=x onerror=alert(1)>", quote=False) in page


def test_a_staircase_too_long_to_draw_step_by_step_is_read_at_sampled_lengths() -> None:
    # A thousand times the budget: m_max runs from the cap (4096) down to hundreds, thousands of steps.
    body = surface_gpt_payloads()[0]
    body["budget_bytes"] *= 1000
    profile = Profile.model_validate(body)
    line = surface_line(profile)
    surface = PeakSurface.from_dict(body["surface"])
    limit = profile.limit_bytes
    assert line[0] == (128, 4096) and line[0][1] - line[-1][1] > MAX_STEPS
    assert len(line) <= LINE_POINTS + 4
    assert {128, 256, 512, 2048} <= {length for length, _ in line}
    for length, m in line:
        assert surface.peak_bytes(m, length) <= limit, length
        assert m == 4096 or limit < surface.peak_bytes(m + 1, length), length


def test_a_surface_of_many_pieces_is_read_at_sampled_lengths_that_agree_with_its_staircase() -> None:
    body = surface_gpt_payloads()[0]
    exact = surface_line(Profile.model_validate(body))
    # Pieces below the leading one change no answer, only the cost of each step's bisection.
    leading = body["surface"]["pieces"][0]
    body["surface"]["pieces"] = [leading] + [[leading[0] - k, *leading[1:]] for k in range(1, 200)]
    sampled = surface_line(Profile.model_validate(body))
    assert len(exact) == 70 and len(exact) * 200 > MAX_STEP_WORK  # 35 steps of m_max, both ends of each
    assert len(sampled) <= LINE_POINTS + 4 and sampled != exact
    assert {128, 256, 512, 2048} <= {length for length, _ in sampled}
    for length, m in sampled:
        assert m == on_line(exact, length), length
