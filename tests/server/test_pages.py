"""The dashboard's pages through TestClient, on both databases: table, filters, sorting, pagination,
the datasheet and its chart data, HTML error pages, escaping, static files."""

from __future__ import annotations

import html
import json
import re
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from fastapi.testclient import TestClient

from autotune.core.plan import plan
from autotune.core.units import format_bytes
from autotune_server.dashboard_queries import TableQuery
from autotune_server.pages import (
    CONTENT_SECURITY_POLICY,
    PLOTLY_URL,
    STATIC_DIR,
    TEMPLATES_DIR,
    human_age,
    human_bytes,
    parse_table_query,
    plotly_js_path,
    table_url,
)
from tests.factories import fingerprint_for, make_run_payload, profile_payload
from tests.server.conftest import READ, WRITE, store_unchecked

XSS_TASK = "<img src=x onerror=alert(1)>"
ROW = re.compile(r'<tr data-profile-id="(\d+)">')
TASK_CELL = re.compile(r'<td class="task"><a href="/profiles/\d+">(.*?)</a></td>')


def upload(client: TestClient, **kwargs: Any) -> int:
    """Store a profile through the API; kwargs go to the factory. Returns its id."""
    kwargs.setdefault("fingerprint", fingerprint_for(f"{kwargs.get('task')}-{kwargs.get('seed', 0)}"))
    response = client.post("/api/v1/profiles", json=profile_payload(**kwargs), headers=WRITE)
    assert response.status_code == 201, response.text
    return int(response.json()["id"])


def tasks(page_html: str) -> list[str]:
    """The task column of the table, unescaped, in page order."""
    return [html.unescape(cell) for cell in TASK_CELL.findall(page_html)]


def text_of(page_html: str) -> str:
    """What a reader sees: tags dropped, entities decoded, white space collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page_html)).split())


def chart_data(page_html: str) -> dict[str, Any]:
    """The JSON block the chart script reads."""
    match = re.search(r'<script type="application/json" id="chart-data">(.*?)</script>', page_html, re.S)
    assert match is not None
    data: dict[str, Any] = json.loads(match.group(1))
    return data


def traces(figure: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {trace["meta"]: trace for trace in figure["data"]}


@pytest.fixture
def three(client: TestClient) -> dict[str, int]:
    """Three profiles of distinct tasks, devices and precisions (ids by short name)."""
    return {
        "gpt": upload(client, task="examples/gpt.py:task", precision="bf16", max_micro_batch=24, seed=1),
        "cnn": upload(
            client,
            task="examples/cnn.py:task",
            device_kind="cpu",
            device_name="cpu",
            precision="fp32",
            budget_bytes=64 * 2**20,
            fixed_bytes=8 * 2**20,
            bytes_per_sample=2 * 2**20,
            max_micro_batch=20,
            seed=2,
        ),
        "mlp": upload(client, task="examples/mlp.py:task", precision="fp16", max_micro_batch=8, seed=3),
    }


def test_empty_store_shows_how_to_probe_a_first_model(client: TestClient) -> None:
    response = client.get("/")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "No profiles yet" in response.text
    assert "autotune probe examples/gpt.py:task --device cpu --budget 32MiB --server http://testserver" in response.text
    assert 'id="profiles"' not in response.text


def test_table_lists_every_profile_with_its_columns(client: TestClient, three: dict[str, int]) -> None:
    page = client.get("/").text
    assert sorted(tasks(page)) == ["examples/cnn.py:task", "examples/gpt.py:task", "examples/mlp.py:task"]
    assert len(ROW.findall(page)) == 3
    gpt_row = page.split(f'data-profile-id="{three["gpt"]}"', 1)[1].split("</tr>", 1)[0]
    assert f'title="{fingerprint_for("examples/gpt.py:task-1")}"' in gpt_row
    # The form /suggest takes (issue 62): the 16 digits the datasheet and `profiles ls` show too.
    assert ">" + fingerprint_for("examples/gpt.py:task-1")[:16] + "</code>" in gpt_row
    assert "NVIDIA A100-SXM4-80GB" in gpt_row and "bf16" in gpt_row
    assert "24 × 1 × 1 = 24" in gpt_row
    # Largest fitting trial: 10 GiB + 2.5 GiB x 24 (+ seed 1 byte) of an 80 GiB budget.
    assert "87.5%" in gpt_row
    assert "<time datetime=" in gpt_row
    assert "1–3 of 3 profiles" in page


def test_text_filter_narrows_by_task_fingerprint_or_device(client: TestClient, three: dict[str, int]) -> None:
    assert tasks(client.get("/", params={"q": "CNN"}).text) == ["examples/cnn.py:task"]
    assert sorted(tasks(client.get("/", params={"q": "a100"}).text)) == [
        "examples/gpt.py:task",
        "examples/mlp.py:task",
    ]
    fingerprint = fingerprint_for("examples/mlp.py:task-3")
    assert tasks(client.get("/", params={"q": fingerprint[:10]}).text) == ["examples/mlp.py:task"]
    # LIKE wildcards are characters to find, not patterns.
    page = client.get("/", params={"q": "%"}).text
    assert tasks(page) == [] and "No profile matches these filters" in page


def test_device_and_precision_filters_narrow_and_combine(client: TestClient, three: dict[str, int]) -> None:
    assert tasks(client.get("/", params={"device": "cpu"}).text) == ["examples/cnn.py:task"]
    assert tasks(client.get("/", params={"precision": "fp16"}).text) == ["examples/mlp.py:task"]
    both = client.get("/", params={"device": "NVIDIA A100-SXM4-80GB", "precision": "fp32"}).text
    assert tasks(both) == []
    # The device filter offers every stored device, and keeps the selection.
    page = client.get("/", params={"device": "cpu"}).text
    assert '<option value="cpu" selected>cpu</option>' in page
    assert '<option value="NVIDIA A100-SXM4-80GB">' in page
    # An unknown precision is no filter rather than an error.
    assert len(tasks(client.get("/", params={"precision": "fp8"}).text)) == 3


def test_sorting_by_columns_both_ways(client: TestClient, three: dict[str, int]) -> None:
    by_m = tasks(client.get("/", params={"sort": "m_max"}).text)
    assert by_m == ["examples/mlp.py:task", "examples/cnn.py:task", "examples/gpt.py:task"]
    assert tasks(client.get("/", params={"sort": "m_max", "order": "desc"}).text) == by_m[::-1]
    assert tasks(client.get("/", params={"sort": "task"}).text) == sorted(by_m)
    # Age: ascending is newest first (created_at moves by seed seconds in the factory).
    assert tasks(client.get("/").text) == ["examples/mlp.py:task", "examples/cnn.py:task", "examples/gpt.py:task"]
    assert tasks(client.get("/", params={"sort": "age", "order": "desc"}).text)[0] == "examples/gpt.py:task"
    # The active column's header links to the other direction and says which way it sorts.
    page = client.get("/", params={"sort": "m_max"}).text
    assert 'aria-sort="ascending"' in page
    assert 'href="/?sort=m_max&amp;order=desc"' in page
    # An unknown key falls back to the default order.
    assert tasks(client.get("/", params={"sort": "nonsense"}).text) == tasks(client.get("/").text)


def test_sorting_by_peak_share(client: TestClient) -> None:
    linear = {"fixed_bytes": 2**30, "bytes_per_sample": 2**30}
    upload(client, task="low", budget_bytes=100 * 2**30, max_micro_batch=4, **linear)
    upload(client, task="high", budget_bytes=40 * 2**30, max_micro_batch=30, **linear)
    upload(client, task="middle", budget_bytes=40 * 2**30, max_micro_batch=15, **linear)
    assert tasks(client.get("/", params={"sort": "peak_share"}).text) == ["low", "middle", "high"]
    assert tasks(client.get("/", params={"sort": "peak_share", "order": "desc"}).text) == ["high", "middle", "low"]


def test_pagination_keeps_filters_and_clamps_the_page(client: TestClient) -> None:
    for seed in range(5):
        upload(client, task=f"task-{seed}", precision="bf16", seed=seed)
    upload(client, task="other", precision="fp32", seed=9)
    params = {"precision": "bf16", "per_page": "2"}
    first = client.get("/", params=params).text
    assert tasks(first) == ["task-4", "task-3"]
    assert "page 1 of 3" in first
    assert 'rel="next" href="/?precision=bf16&amp;page=2&amp;per_page=2"' in first
    last = client.get("/", params={**params, "page": "3"}).text
    assert tasks(last) == ["task-0"] and "5–5 of 5 profiles" in last
    assert 'rel="prev" href="/?precision=bf16&amp;page=2&amp;per_page=2"' in last
    # Past the end is the last page; nonsense is the first.
    assert tasks(client.get("/", params={**params, "page": "99"}).text) == ["task-0"]
    assert tasks(client.get("/", params={**params, "page": "abc"}).text) == ["task-4", "task-3"]
    # The pages together hold every match exactly once.
    seen = [t for p in (1, 2, 3) for t in tasks(client.get("/", params={**params, "page": str(p)}).text)]
    assert sorted(seen) == [f"task-{i}" for i in range(5)]


def test_datasheet_shows_plan_budget_fit_trials_warnings_and_observations(client: TestClient) -> None:
    body = profile_payload(task="examples/gpt.py:task", seed=1)
    body["warnings"] = ["BatchNorm sees micro-batch statistics"]
    body["trials"].append({"micro_batch": 30, "peak_bytes": 85 * 2**30, "fits": False, "oom": True, "seconds": 0.2})
    profile_id = client.post("/api/v1/profiles", json=body, headers=WRITE).json()["id"]
    observed = {"micro_batch": 24, "peak_bytes": 71 * 2**30, "note": "</script><script>alert(2)</script>"}
    assert client.post(f"/api/v1/profiles/{profile_id}/observations", json=observed, headers=WRITE).status_code == 201

    response = client.get(f"/profiles/{profile_id}")
    assert response.status_code == 200
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    page = response.text
    for text in ("24 × 1 × 1 = 24", "budget 80.00 GiB", "headroom 10.0%", "72.00 GiB", "10.00 GiB + 2.50 GiB × m"):
        assert text in text_of(page), text
    assert "BatchNorm sees micro-batch statistics" in page
    assert page.count('<tr class="oom">') == 1
    assert page.count('<strong class="bad">OOM</strong>') == 1
    assert "71.00 GiB" in page
    assert "&lt;/script&gt;&lt;script&gt;alert(2)&lt;/script&gt;" in page
    assert "<script>alert(2)" not in page
    assert f'href="/api/v1/profiles/{profile_id}"' in page
    assert f'src="{PLOTLY_URL}"' in page


def test_chart_data_has_every_point_the_lines_and_human_hover(client: TestClient) -> None:
    body = profile_payload(seed=1)
    body["trials"].append({"micro_batch": 30, "peak_bytes": 85 * 2**30, "fits": False, "oom": True, "seconds": 0.2})
    profile_id = client.post("/api/v1/profiles", json=body, headers=WRITE).json()["id"]
    observation = {"micro_batch": 24, "peak_bytes": 71 * 2**30}
    client.post(f"/api/v1/profiles/{profile_id}/observations", json=observation, headers=WRITE)
    client.post(f"/api/v1/profiles/{profile_id}/observations", json={"micro_batch": 26, "oom": True}, headers=WRITE)

    figures = chart_data(client.get(f"/profiles/{profile_id}").text)
    memory = traces(figures["chart-memory"])
    # Factory trials: m = 1, 2, 12, 24 fit; 25 is over the limit; plus the OOM at 30.
    assert memory["trials-fit"]["x"] == [1, 2, 12, 24]
    assert memory["trials-over"]["x"] == [25]
    assert memory["trials-oom"]["x"] == [30]
    assert memory["observed"]["x"] == [24] and memory["observed-oom"]["x"] == [26]
    assert figures["chart-memory"]["layout"]["yaxis"]["title"]["text"] == "peak memory (GiB)"
    assert memory["budget"]["y"] == [80.0, 80.0] and memory["limit"]["y"] == [72.0, 72.0]
    assert memory["chosen"]["x"] == [24, 24]
    fit_line = dict(zip(memory["fit"]["x"], memory["fit"]["y"], strict=True))
    assert fit_line[12] == pytest.approx(40.0)
    # Hover text is preformatted in binary units, since Plotly's own formats are SI.
    assert memory["trials-fit"]["customdata"][3][0] == format_bytes(10 * 2**30 + 2.5 * 2**30 * 24 + 1)
    assert "%{customdata[0]}" in memory["trials-fit"]["hovertemplate"]
    # The trials' seconds are never charted: time comes from timed runs only, and this one has none.
    assert "chart-time" not in figures


def timed(micro_batch: int, samples_per_second: float, micro_batches: list[list[int]] | None = None) -> dict:
    update = micro_batches or [[micro_batch, 1]]
    samples = sum(size * count for size, count in update)
    return {
        "micro_batch": micro_batch,
        "samples_per_second": samples_per_second,
        "seconds_per_update": samples / samples_per_second,
        "micro_batches": update,
        "micro_batch_seconds": [[size, 0.1] for size, _ in update],
        "step_seconds": 0.05,
        "repeats": 3,
    }


def test_the_time_chart_shows_measured_throughput_per_policy_and_the_table_filters_on_it(
    client: TestClient,
) -> None:
    fingerprint = fingerprint_for("policies")
    plain = profile_payload(task="policies", fingerprint=fingerprint, seed=1)
    plain["throughput"] = [timed(24, 180.0), timed(24, 190.0, [[24, 4]])]
    full = profile_payload(task="policies", fingerprint=fingerprint, seed=2, max_micro_batch=26, bytes_per_sample=2**31)
    full["activation_checkpointing"] = "full"
    full["throughput"] = [timed(26, 150.0)]
    plain_id = client.post("/api/v1/profiles", json=plain, headers=WRITE).json()["id"]
    full_id = client.post("/api/v1/profiles", json=full, headers=WRITE).json()["id"]
    upload(client, task="untimed", seed=3)

    page = client.get(f"/profiles/{plain_id}").text
    timing = traces(chart_data(page)["chart-time"])
    assert set(timing) == {"throughput-none", "throughput-full"}  # this policy's and the sibling's
    assert timing["throughput-none"]["x"] == [24, 24] and timing["throughput-none"]["y"] == [180.0, 190.0]
    assert timing["throughput-full"]["x"] == [26] and timing["throughput-full"]["y"] == [150.0]
    assert "4×24" in timing["throughput-none"]["customdata"][1][1]
    assert "checkpointing none" in text_of(page) and "190 samples/s" in text_of(page)
    full_page = client.get(f"/profiles/{full_id}").text
    assert "checkpointing full (every block recomputes its forward)" in text_of(full_page)

    table = client.get("/", params={"ac": "full"}).text
    assert tasks(table) == ["policies"] and '<option value="full" selected>' in table
    assert '<td class="policy">full</td>' in table
    assert len(tasks(client.get("/").text)) == 3
    assert table_url("", parse_table_query({"ac": "every-2"})) == "/?ac=every-2"
    assert parse_table_query({"ac": "half"}).policy == ""  # unknown: ignored, as the other filters'


def test_chart_json_holds_no_stored_text_and_no_raw_markup(client: TestClient) -> None:
    task = "</script><script>alert(3)</script>"
    profile_id = upload(client, task=task, tags={"k": "</script>"})
    page = client.get(f"/profiles/{profile_id}").text
    block = page.split('<script type="application/json" id="chart-data">', 1)[1].split("</script>", 1)[0]
    # Plotly reads a little HTML in names and titles: stored text stays out of the figures entirely...
    assert "alert(3)" not in html.unescape(json.dumps(json.loads(block)))
    # ...and even the figures' own markup ("<br>" in hover templates) is escaped inside the block.
    assert "<" not in block and ">" not in block and "\\u003cbr\\u003e" in block
    assert "<script>alert(3)" not in page


def test_xss_task_name_is_escaped_everywhere(client: TestClient) -> None:
    profile_id = upload(client, task=XSS_TASK)
    for page in (client.get("/").text, client.get(f"/profiles/{profile_id}").text):
        assert XSS_TASK not in page
        assert "&lt;img src=x onerror=alert(1)&gt;" in page
    assert tasks(client.get("/").text) == [XSS_TASK]


def test_missing_profile_is_an_html_404_page_and_the_api_keeps_json(client: TestClient) -> None:
    for path in ("/profiles/999", "/profiles/abc", "/profiles/0", f"/profiles/{2**40}"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert response.headers["content-type"].startswith("text/html"), path
        assert "No such profile" in response.text, path
    api = client.get("/api/v1/profiles/999")
    assert api.status_code == 404 and api.json()["error"]["code"] == "profile_not_found"
    # A browser asking for an unknown page gets HTML; an API client gets the JSON shape.
    assert client.get("/nowhere", headers={"Accept": "text/html"}).headers["content-type"].startswith("text/html")
    assert client.get("/nowhere").json()["error"]["code"] == "not_found"
    browser_on_api = client.get("/api/v1/nowhere", headers={"Accept": "text/html,*/*"})
    assert browser_on_api.json()["error"]["code"] == "not_found"


def test_pages_need_a_token_where_reads_do(make_client: Callable[..., TestClient]) -> None:
    client = make_client(read_token_required=True)
    denied = client.get("/")
    assert denied.status_code == 401
    assert denied.headers["content-type"].startswith("text/html")
    assert denied.headers["www-authenticate"] == "Bearer"
    assert client.get("/", headers={"Authorization": "Bearer wrong"}).status_code == 403
    assert client.get("/", headers=READ).status_code == 200


def test_plotly_comes_from_the_installed_package_and_no_cdn(client: TestClient) -> None:
    path = plotly_js_path()
    assert path is not None
    response = client.get(PLOTLY_URL)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/javascript")
    assert response.content == path.read_bytes()
    assert client.get("/static/dashboard.js").status_code == 200
    assert client.get("/static/dashboard.css").headers["content-type"].startswith("text/css")
    # Nothing the pages load comes from another host: clusters are often offline.
    for source in [*TEMPLATES_DIR.glob("*.html"), *STATIC_DIR.glob("*")]:
        assert "://" not in source.read_text(), source


def test_dashboard_routes_are_not_in_the_openapi_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/" not in paths and "/profiles/{profile_id}" not in paths
    assert "/api/v1/profiles/{profile_id}" in paths


def test_human_bytes_matches_the_probe_library() -> None:
    for value in (0, 1, 1023, 1024, 1536, 5 * 2**20, 80 * 2**30 - 1, 3 * 2**40, 2**52, -2048):
        assert human_bytes(value) == format_bytes(value), value
    assert human_bytes(None) == "-"


def test_human_age() -> None:
    now = datetime(2026, 6, 1, 12, 0, tzinfo=timezone.utc)
    assert human_age(now - timedelta(seconds=30), now) == "just now"
    assert human_age(now - timedelta(minutes=5), now) == "5 min"
    assert human_age(now - timedelta(hours=3, minutes=59), now) == "3 h"
    assert human_age(now - timedelta(days=12), now) == "12 d"
    assert human_age(now - timedelta(days=90), now) == "2026-03-03"
    # A clock ahead of ours: the date, not a negative age.
    assert human_age(now + timedelta(hours=1), now) == "2026-06-01"
    assert human_age(datetime(2026, 6, 1, 11, 0), now) == "1 h"  # naive is UTC


def test_parse_table_query_is_lenient_and_table_url_round_trips() -> None:
    query = parse_table_query({"q": " gpt\x00 ", "sort": "m_max", "order": "desc", "page": "2", "per_page": "9999"})
    assert query == TableQuery(text="gpt", sort="m_max", descending=True, page=2, per_page=100)
    assert parse_table_query({"page": "-3", "per_page": "0"}).page == 1
    assert parse_table_query({"per_page": "0"}).per_page == 1
    url = table_url("", query)
    assert url == "/?q=gpt&sort=m_max&order=desc&page=2&per_page=100"
    from urllib.parse import parse_qsl, urlsplit

    assert parse_table_query(dict(parse_qsl(urlsplit(url).query))) == query
    assert table_url("/tuner", TableQuery()) == "/tuner/"


def test_a_profile_without_plan_fit_timings_or_fitting_trial_still_renders(client: TestClient) -> None:
    # Nothing fits: the store refuses such a profile now, but one stored before the checks is still
    # shown, with what it contradicts.
    body = profile_payload(
        task="nothing-fits", budget_bytes=2**30, fixed_bytes=2**20, bytes_per_sample=2**20, with_fit=False
    )
    body["plan"] = None
    body["trials"] = [{"micro_batch": 1, "peak_bytes": 2**31, "fits": False, "oom": True}]
    refused = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert refused.status_code == 422 and refused.json()["error"]["field"] == "max_micro_batch"
    bare_id = store_unchecked(client, body)
    upload(client, task="fits", seed=1)

    response = client.get(f"/profiles/{bare_id}")
    assert response.status_code == 200
    text = text_of(response.text)
    assert "No plan" in text and "fit none" in text and "No timed run was recorded" in text
    assert 'id="inconsistent"' in response.text and "contradicts its own trials" in text
    assert "max_micro_batch : 24 is contradicted by trial 0: m=1 ran out of memory" in text
    figures = chart_data(response.text)
    assert "chart-time" not in figures and 'id="chart-time"' not in response.text
    memory = traces(figures["chart-memory"])
    assert set(memory) == {"trials-oom", "budget", "limit", "chosen"}
    # No fitting trial: no share in the table, and last whichever way the share is sorted.
    for order in ("asc", "desc"):
        assert tasks(client.get("/", params={"sort": "peak_share", "order": order}).text) == ["fits", "nothing-fits"]


# --- Strategy, source and fake trials -----------------------------------------------------------


def test_table_shows_strategy_with_world_size_and_marks_estimates(client: TestClient) -> None:
    ddp = upload(client, task="ddp-job", seed=1)
    fsdp = upload(client, task="fsdp-job", seed=2, strategy="fsdp", world_size=8)
    estimate = upload(client, task="estimated-job", seed=3, source="estimate")
    page = client.get("/").text
    cells = re.split(r'<tr data-profile-id="\d+">', page)[1:]
    rows = dict(zip((int(i) for i in ROW.findall(page)), cells, strict=True))
    assert "fsdp ×8" in text_of(rows[fsdp]) and "ddp ×1" in text_of(rows[ddp])
    assert 'class="badge estimate"' in rows[estimate]
    assert 'class="badge estimate"' not in rows[ddp] + rows[fsdp]


def test_strategy_and_source_filters_narrow_and_clear(client: TestClient) -> None:
    upload(client, task="ddp-job", seed=1)
    upload(client, task="fsdp-job", seed=2, strategy="fsdp", world_size=8)
    upload(client, task="estimated-job", seed=3, source="estimate")
    assert tasks(client.get("/", params={"strategy": "fsdp"}).text) == ["fsdp-job"]
    assert tasks(client.get("/", params={"source": "estimate"}).text) == ["estimated-job"]
    both = client.get("/", params={"strategy": "ddp", "source": "measured"}).text
    assert tasks(both) == ["ddp-job"]
    assert '<option value="fsdp">' in both and '<option value="measured" selected>' in both
    assert 'href="/"' in both and "Clear filters" in both
    # A value the page does not know is ignored, as the other filters' are.
    assert len(tasks(client.get("/", params={"strategy": "zero3", "source": "guess"}).text)) == 3
    query = parse_table_query({"strategy": "fsdp", "source": "estimate"})
    assert (query.strategy, query.source, query.filtered) == ("fsdp", "estimate", True)
    assert table_url("", query) == "/?strategy=fsdp&source=estimate"


def test_the_peak_share_of_a_measurement_ignores_its_fake_trials(client: TestClient) -> None:
    # A fake pre-search point at m = 24 claims half the real peak; the share is the real one's.
    upload(client, task="with-fake", seed=1, fake_micro_batches=(24,))
    page = client.get("/").text
    assert f"{(10 * 2**30 + 2.5 * 2**30 * 24 + 1) / (80 * 2**30) * 100:.1f}%" in text_of(page)


def test_datasheet_shows_strategy_source_and_counts_fake_trials_apart(client: TestClient) -> None:
    body = profile_payload(task="fsdp-job", strategy="fsdp", world_size=8, fake_micro_batches=(6, 20, 30))
    body["trials"].append({"micro_batch": 40, "peak_bytes": 85 * 2**30, "fits": False, "oom": True})
    profile_id = client.post("/api/v1/profiles", json=body, headers=WRITE).json()["id"]
    page = client.get(f"/profiles/{profile_id}").text
    text = text_of(page)
    assert "fsdp over 8 ranks" in text and "answers only for world size 8" in text
    assert "source measured" in text
    assert "trials 6 real (1 OOM), 3 fake" in text
    assert page.count('<span class="badge fake"') == 3
    memory = traces(chart_data(page)["chart-memory"])
    assert memory["trials-fake"]["x"] == [6, 20, 30]
    assert [point[2] for point in memory["trials-fake"]["customdata"]] == ["fake: fits"] * 3
    assert memory["trials-fit"]["x"] == [1, 2, 12, 24] and memory["trials-oom"]["x"] == [40]
    assert "chart-time" not in chart_data(page)  # no timed run: the trials' seconds are not a time chart


def test_an_estimates_datasheet_says_it_is_one(client: TestClient) -> None:
    profile_id = upload(client, task="estimated-job", source="estimate")
    page = client.get(f"/profiles/{profile_id}").text
    text = text_of(page)
    assert "source estimate (fake-tensor trials, not a measurement on the device)" in text
    assert "estimate estimated" in text  # the subtitle's badge and verb
    assert "trials 0 real, 5 fake" in text
    assert "of budget, estimated by a fake trial)" in text  # the peak at the chosen m
    figures = chart_data(page)
    assert set(traces(figures["chart-memory"])) >= {"trials-fake"}
    assert not {"trials-fit", "trials-over"} & set(traces(figures["chart-memory"]))
    assert "chart-time" not in figures and "their time is the host's" in text


# --- Balanced plans -----------------------------------------------------------------------------


def test_a_balanced_plan_is_shown_as_its_micro_batches(client: TestClient) -> None:
    body = make_run_payload()
    body["plan"] = plan(26, 256).model_dump(mode="json")  # 6 x 26 + 4 x 25 in 10 steps
    response = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert response.status_code == 201, response.text
    profile_id = response.json()["id"]
    row_text = text_of(re.split(r'<tr data-profile-id="\d+">', client.get("/").text)[1])
    assert "6×26 + 4×25 = 256 (10 steps)" in row_text
    page = client.get(f"/profiles/{profile_id}").text
    assert 'id="plan-balanced"' in page and "6×26 + 4×25 = 256 (10 steps)" in text_of(page)
    assert 'id="inconsistent"' not in page


def test_datasheet_shows_the_observed_drift_in_the_chart_and_the_table(client: TestClient) -> None:
    profile_id = client.post("/api/v1/profiles", json=profile_payload(), headers=WRITE).json()["id"]
    url = f"/api/v1/profiles/{profile_id}/observations"
    probe_24 = 10 * 2**30 + int(2.5 * 2**30 * 24)
    for _ in range(3):
        client.post(url, json={"micro_batch": 24, "peak_bytes": round(probe_24 * 1.04)}, headers=WRITE)
    client.post(url, json={"micro_batch": 26, "oom": True}, headers=WRITE)

    page = client.get(f"/profiles/{profile_id}").text
    assert "3 jobs observed up to 4.0 % above the probe at m = 24; drift +4.0 %: /suggest answers m = 23" in page
    observations = page[page.index('<section id="observations">') :]
    cells = re.findall(r'<td class="num">([^<]*%|-)</td>', observations)
    assert cells == ["+4.0 %", "+4.0 %", "+4.0 %", "-", "-"]  # the OOM has no peak, nor a ratio
    memory = traces(chart_data(page)["chart-memory"])
    raised = dict(zip(memory["drift"]["x"], memory["drift"]["y"], strict=True))
    assert raised[24] == pytest.approx(70.0 * 1.04)
    assert memory["drift"]["name"] == "fit + observed drift (+4.0 %)"


def test_the_datasheet_and_the_table_speak_the_setup(client: TestClient) -> None:
    # Issue 40: a tp 2 profile with D 2 read "ddp over 4 replicas (DDP's gradient buckets counted)", and no page
    # showed the mesh, a pipeline's stages or the host figure.
    body = profile_payload(task="tp-job", world_size=4)
    body["mesh"] = {"tp": 2}
    meshed = client.post("/api/v1/profiles", json=body, headers=WRITE).json()["id"]
    text = text_of(client.get(f"/profiles/{meshed}").text)
    assert "ddp over 2 replicas (DDP's gradient buckets counted)" in text and "over 4 replicas" not in text
    assert "mesh tp 2 over world size 4 (D = 2 data-parallel replicas" in text
    body = profile_payload(task="pp-job", world_size=2, seed=1)
    peak = body["trials"][-2]["peak_bytes"]
    body["mesh"] = {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 2}
    body["pipeline"] = {"microbatches": 2, "stage_peak_bytes": [peak - 10, peak], "most_loaded_stage": 1,
                        "bubble_fraction": 1 / 3}  # fmt: skip
    staged = client.post("/api/v1/profiles", json=body, headers=WRITE).json()["id"]
    text = text_of(client.get(f"/profiles/{staged}").text)
    assert "ddp, one replica" in text
    assert f"stage 0 {format_bytes(peak - 10)} · stage 1 {format_bytes(peak)} (most loaded)" in text
    assert "K 2 micro-batches per step, bubble 0.333" in text
    body = profile_payload(task="offload-job", seed=2, tags={"offload": "activations"})
    body |= {"offload": "activations", "host_budget_bytes": 2**20, "host_peak_bytes": 900_000}
    for trial in body["trials"]:
        trial["host_peak_bytes"] = 900_000 if trial["fits"] else 2**21
    hosted = client.post("/api/v1/profiles", json=body, headers=WRITE)
    assert hosted.status_code == 201, hosted.text
    text = text_of(client.get(f"/profiles/{hosted.json()['id']}").text)
    assert f"host offload activations: {format_bytes(900_000)} on the host" in text
    assert "within a host budget of 1.00 MiB" in text
    table = client.get("/").text
    cells = re.split(r'<tr data-profile-id="\d+">', table)[1:]
    rows = dict(zip((int(i) for i in ROW.findall(table)), cells, strict=True))
    assert "ddp ×4 tp 2" in text_of(rows[meshed]) and "pp 2 (gpipe, K 2)" in text_of(rows[staged])
