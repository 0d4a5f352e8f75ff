"""The dashboard: server-rendered HTML pages of the stored profiles, from the same app as the API.

    GET /                             the profile table: ?q=&device=&precision=&strategy=&source=&sort=
                                      &order=&page=&per_page=
    GET /profiles/{id}                one profile's datasheet with two charts
    GET /static/...                   the dashboard's own CSS and JS
    GET /static/vendor/plotly.min.js  plotly.js, read from the installed ``plotly`` package

The table is plain HTML: filters, sorting and pagination are GET parameters and links, so it works
without JavaScript. Only the charts need JS: their Plotly figures are computed here and embedded as
JSON in a ``<script type="application/json">`` block (escaped by Jinja's ``tojson``), which
``static/dashboard.js`` hands to Plotly. No stored text ever goes into script source, chart titles or
trace names (Plotly reads a little HTML in those), and the pages carry a Content-Security-Policy
that forbids inline scripts, so an injected ``<img onerror=...>`` could not run even if it got through.

Dashboard routes answer errors as HTML pages (a missing profile is a 404 page); a browser asking
for a path outside ``/api`` gets HTML error pages too. API routes keep their JSON errors.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, Response
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup
from sqlalchemy.orm import Session
from starlette.exceptions import HTTPException as StarletteHTTPException

from autotune.core.plan import is_single_step, micro_batches_text
from autotune.core.policy_names import canonical_policy
from autotune.core.schemas import (
    ACTIVATION_CHECKPOINTING,
    MAX_SEQ_LEN,
    PRECISIONS,
    SOURCES,
    STRATEGIES,
    Plan,
    Profile,
    shown_fingerprint,
)
from autotune.core.setup import JobSetup
from autotune.core.units import format_bytes as human_bytes
from autotune_server.api import API_PREFIX, MAX_ID
from autotune_server.breakdown_chart import breakdown_bars, breakdown_rows, host_rows, size_label, timeline_svg
from autotune_server.consistency import stored_problems
from autotune_server.convert import to_profile
from autotune_server.dashboard_queries import (
    DEFAULT_PER_PAGE,
    DEFAULT_SORT,
    MAX_FILTER_CHARS,
    MAX_PER_PAGE,
    SORT_KEYS,
    TableQuery,
    device_names,
    policy_siblings,
    profile_table,
)
from autotune_server.deps import GateDep, SettingsDep, require_read
from autotune_server.drift import profile_drift
from autotune_server.errors import (
    AuthenticationRequired,
    PermissionDenied,
    ProfileNotFound,
    ServerBusy,
    database_error_response,
)
from autotune_server.gate import DatabaseGate
from autotune_server.models import ObservationRow
from autotune_server.outage import DATABASE_ERRORS
from autotune_server.repository import get_profile, list_observations, to_utc
from autotune_server.surface_chart import length_view

__all__ = [
    "CONTENT_SECURITY_POLICY",
    "PLOTLY_URL",
    "STATIC_DIR",
    "TEMPLATES_DIR",
    "TRIAL_MICRO_BATCHES",
    "PageError",
    "chart_figures",
    "human_age",
    "human_bytes",
    "install",
    "parse_table_query",
    "plan_text",
    "plotly_js_path",
    "router",
    "table_url",
    "trial_counts",
]

PACKAGE_DIR = Path(__file__).resolve().parent
TEMPLATES_DIR = PACKAGE_DIR / "templates"
STATIC_DIR = PACKAGE_DIR / "static"
PLOTLY_URL = "/static/vendor/plotly.min.js"
# A trial runs 2 micro-batches, an optimizer step, then 2 more and a second step (docs/design.md, "The
# trial"): its seconds cover this many micro-batches.
TRIAL_MICRO_BATCHES = 4
# 'unsafe-inline' for styles only: Plotly sets style attributes and injects <style> rules as it draws.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
_SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
_BINARY_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


class PageError(Exception):
    """An error a dashboard route answers with an HTML page (rendered by the handler ``install`` adds)."""

    def __init__(
        self, status_code: int, title: str, message: str, *, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.title = title
        self.message = message
        self.headers = headers


# ---------------------------------------------------------------------------------------------------
# Formatting (human_bytes: autotune.core.units.format_bytes, as the CLI and the API's notes write bytes)


def human_age(created_at: datetime, now: datetime | None = None) -> str:
    """How long ago ``created_at`` was, in the largest whole unit ('5 min', '3 h', '12 d').

    Older than 60 days, or in the future (a probe host's clock ahead of ours), it is the date itself:
    a relative age would then be vague or wrong.
    """
    now = now if now is not None else datetime.now(timezone.utc)
    seconds = (to_utc(now) - to_utc(created_at)).total_seconds()
    if seconds < 0 or seconds >= 60 * 86400:
        return to_utc(created_at).date().isoformat()
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} d"


def _ago(created_at: datetime, now: datetime | None = None) -> str:
    age = human_age(created_at, now)
    if age == "just now":
        return age
    return f"on {age}" if age[0].isdigit() and "-" in age else f"{age} ago"


def _percent(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:.1f}%"


def _seconds(value: float) -> str:
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def plan_text(plan: Plan | dict[str, Any] | None) -> str:
    """A plan as the table and the datasheet show it: ``16 × 16 × 1 = 256`` for equal micro-batches,
    ``6×26 + 4×25 = 256 (10 steps)`` for a balanced plan's (``(…) × D = T`` on D replicas)."""
    if plan is None:
        return ""
    if isinstance(plan, dict):  # the table reads the stored JSON column
        plan = Plan.model_validate(plan)
    if plan.uneven:
        return micro_batches_text(plan.micro_batches, plan.world_size)
    return f"{plan.micro_batch} × {plan.accumulation_steps} × {plan.world_size} = {plan.effective_batch}"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        # Every template is HTML: escape everything, always, whatever the file name says.
        autoescape=True,
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["bytes"] = human_bytes
    env.filters["percent"] = _percent
    env.filters["seconds"] = _seconds
    env.filters["age"] = human_age
    env.filters["ago"] = _ago
    env.filters["plan_text"] = plan_text
    env.filters["shown_fingerprint"] = shown_fingerprint
    return env


_ENV = _environment()


def _root(request: Request) -> str:
    # Behind a proxy that mounts the service under a prefix, every link must carry it.
    return str(request.scope.get("root_path", "")).rstrip("/")


def _render(
    request: Request,
    template: str,
    context: dict[str, Any],
    *,
    status_code: int = 200,
    headers: dict[str, str] | None = None,
) -> HTMLResponse:
    html = _ENV.get_template(template).render(root=_root(request), **context)
    return HTMLResponse(html, status_code=status_code, headers={**_SECURITY_HEADERS, **(headers or {})})


# ---------------------------------------------------------------------------------------------------
# The table's query parameters


def _int_or(value: str | None, default: int) -> int:
    try:
        return int(value) if value is not None else default
    except ValueError:
        return default


def _seq_len_or_none(value: str | None) -> int | None:
    # A length the store can hold, or no filter: "abc", "0" or "" from a hand-edited URL is ignored.
    length = _int_or((value or "").strip() or None, 0)
    return length if 1 <= length <= MAX_SEQ_LEN else None


def _text(value: str | None) -> str:
    # NUL can never match stored text (uploads refuse it) and PostgreSQL refuses it in a query.
    return (value or "").replace("\x00", "").strip()[:MAX_FILTER_CHARS]


def _policy_or_any(text: str) -> str:
    """A policy name in its canonical spelling (every-K, op:OP/... too), or "" (any) for what is not one."""
    try:
        return canonical_policy(text) if text else ""
    except ValueError:
        return ""


def parse_table_query(params: dict[str, str]) -> TableQuery:
    """The table query of a page's GET parameters, lenient as a page should be.

    A value that cannot be used (an unknown sort key, ``page=abc``, ``per_page=10000``) falls back to
    its default or is clamped into range, rather than answering an error to a hand-edited URL.

    >>> parse_table_query({"q": " gpt ", "sort": "m_max", "order": "desc", "page": "2"}).page
    2
    """
    sort = params.get("sort", DEFAULT_SORT)
    precision = _text(params.get("precision"))
    strategy = _text(params.get("strategy"))
    source = _text(params.get("source"))
    policy = _text(params.get("ac"))
    return TableQuery(
        text=_text(params.get("q")),
        device=_text(params.get("device")),
        precision=precision if precision in PRECISIONS else "",
        strategy=strategy if strategy in STRATEGIES else "",
        source=source if source in SOURCES else "",
        policy=_policy_or_any(policy),
        seq_len=_seq_len_or_none(params.get("seq_len")),
        sort=sort if sort in SORT_KEYS else DEFAULT_SORT,
        descending=params.get("order") == "desc",
        page=max(1, _int_or(params.get("page"), 1)),
        per_page=min(MAX_PER_PAGE, max(1, _int_or(params.get("per_page"), DEFAULT_PER_PAGE))),
    )


def table_url(root: str, query: TableQuery, **changes: Any) -> str:
    """The URL of the table for ``query`` with ``changes`` applied; defaults are left out of it."""
    target = replace(query, **changes)
    params: dict[str, str | int] = {}
    if target.text:
        params["q"] = target.text
    if target.device:
        params["device"] = target.device
    if target.precision:
        params["precision"] = target.precision
    if target.strategy:
        params["strategy"] = target.strategy
    if target.source:
        params["source"] = target.source
    if target.policy:
        params["ac"] = target.policy
    if target.seq_len is not None:
        params["seq_len"] = target.seq_len
    if target.sort != DEFAULT_SORT:
        params["sort"] = target.sort
    if target.descending:
        params["order"] = "desc"
    if target.page != 1:
        params["page"] = target.page
    if target.per_page != DEFAULT_PER_PAGE:
        params["per_page"] = target.per_page
    return f"{root}/" + (f"?{urlencode(params)}" if params else "")


# ---------------------------------------------------------------------------------------------------
# Charts: Plotly figures as plain data


@dataclass(frozen=True)
class _Unit:
    name: str
    size: int


def _axis_unit(largest_bytes: float) -> _Unit:
    for name, size in _BINARY_UNITS:
        if largest_bytes >= size:
            return _Unit(name, size)
    return _Unit("B", 1)


def _points(
    meta: str, name: str, xs: list[int], ys: list[int], unit: _Unit, budget: int, marker: dict[str, Any],
    label: str | list[str],
) -> dict[str, Any]:
    labels = label if isinstance(label, list) else [label] * len(ys)
    return {
        "type": "scatter",
        "mode": "markers",
        "meta": meta,
        "name": name,
        "x": xs,
        "y": [y / unit.size for y in ys],
        # Preformatted: Plotly's own number formats would print bytes in SI units (G = 10**9).
        "customdata": [[human_bytes(y), _percent(y / budget), text] for y, text in zip(ys, labels, strict=True)],
        "hovertemplate": "m = %{x}<br>peak %{customdata[0]} (%{customdata[1]} of budget)"
        "<br>%{customdata[2]}<extra></extra>",
        "marker": marker,
    }


def _line(
    meta: str, name: str, xs: Sequence[float], ys: Sequence[float], unit: _Unit, style: dict[str, Any], label: str
) -> dict[str, Any]:
    return {
        "type": "scatter",
        "mode": "lines",
        "meta": meta,
        "name": name,
        "x": xs,
        "y": [y / unit.size for y in ys],
        "customdata": [[human_bytes(y), label] for y in ys],
        "hovertemplate": "m = %{x}<br>%{customdata[1]}: %{customdata[0]}<extra></extra>",
        "line": style,
    }


def _chosen_micro_batch(profile: Profile) -> int:
    return profile.plan.micro_batch if profile.plan is not None else profile.max_micro_batch


def _memory_figure(profile: Profile, observations: list[ObservationRow]) -> dict[str, Any]:
    budget = profile.budget_bytes
    limit = profile.limit_bytes
    chosen = _chosen_micro_batch(profile)
    # An OOM's peak is what the device held when it failed; 0 (nothing read) is drawn at the budget.
    peaks = [t.peak_bytes for t in profile.trials] + [o.peak_bytes or 0 for o in observations]
    top = max([budget, *peaks])
    unit = _axis_unit(top)
    x_values = [t.micro_batch for t in profile.trials] + [o.micro_batch for o in observations] + [chosen]
    x_end = max(x_values) + max(1, max(x_values) // 20)

    # Fake-tensor trials (an estimate's, or a measurement's pre-search points) are a mark of their
    # own: they are never to be read as measurements on the device.
    real = [t for t in profile.trials if not t.fake]
    fake = [t for t in profile.trials if t.fake]
    fits = [t for t in real if t.fits]
    over = [t for t in real if not t.fits and not t.oom]
    ooms = [t for t in real if t.oom]
    traces: list[dict[str, Any]] = []
    if fits:
        traces.append(_points("trials-fit", "trials that fit", [t.micro_batch for t in fits],
                              [t.peak_bytes for t in fits], unit, budget,
                              {"symbol": "circle", "size": 9, "color": "#1f6fb2"}, "fits"))
    if over:
        traces.append(_points("trials-over", "trials over the limit", [t.micro_batch for t in over],
                              [t.peak_bytes for t in over], unit, budget,
                              {"symbol": "circle-open", "size": 10, "color": "#d97706", "line": {"width": 2}},
                              "over budget × (1 − headroom)"))
    if ooms:
        traces.append(_points("trials-oom", "OOM", [t.micro_batch for t in ooms],
                              [t.peak_bytes or budget for t in ooms], unit, budget,
                              {"symbol": "x", "size": 12, "color": "#c0262d"}, "out of memory"))
    if fake:
        verdicts = ["fake: " + ("out of memory" if t.oom else "fits" if t.fits else "over the limit") for t in fake]
        traces.append(_points("trials-fake", "fake-tensor trials", [t.micro_batch for t in fake],
                              [t.peak_bytes or budget for t in fake], unit, budget,
                              {"symbol": "square-open", "size": 9, "color": "#6b7280", "line": {"width": 2}},
                              verdicts))
    if profile.fit is not None:
        fit = profile.fit
        xs = sorted({1, chosen, x_end, *(t.micro_batch for t in profile.trials)})
        traces.append(_line("fit", "fit: fixed + per sample × m", xs,
                            [fit.fixed_bytes + fit.bytes_per_sample * x for x in xs], unit,
                            {"color": "#6b7280", "dash": "dot", "width": 2}, "fitted"))
    traces.append(_line("budget", "budget", [0, x_end], [budget, budget], unit,
                        {"color": "#c0262d", "width": 2}, "budget"))
    traces.append(_line("limit", "budget × (1 − headroom)", [0, x_end], [limit, limit], unit,
                        {"color": "#d97706", "dash": "dash", "width": 2}, "limit"))
    traces.append(_line("chosen", f"chosen m = {chosen}", [chosen, chosen], [0, top * 1.05], unit,
                        {"color": "#15803d", "dash": "dashdot", "width": 2}, f"chosen m = {chosen}"))
    seen = [o for o in observations if not o.oom and o.peak_bytes is not None]
    failed = [o for o in observations if o.oom]
    observed = profile_drift(profile, observations).drift
    if observed is not None and observed.applied > 0 and profile.fit is not None:
        # The fit raised by the jobs' drift: what /suggest holds within the limit (autotune_server.drift).
        raise_by = 1.0 + observed.applied
        xs = sorted({1, chosen, x_end, *(o.micro_batch for o in seen)})
        traces.append(_line("drift", f"fit + observed drift ({observed.applied * 100:+.1f} %)", xs,
                            [(profile.fit.fixed_bytes + profile.fit.bytes_per_sample * x) * raise_by for x in xs],
                            unit, {"color": "#7c3aed", "dash": "dot", "width": 2}, "fit raised by the drift"))
    if seen:
        traces.append(_points("observed", "jobs' observations", [o.micro_batch for o in seen],
                              [o.peak_bytes or 0 for o in seen], unit, budget,
                              {"symbol": "diamond", "size": 10, "color": "#7c3aed"}, "observed by a job"))
    if failed:
        traces.append(_points("observed-oom", "jobs' OOMs", [o.micro_batch for o in failed],
                              [o.peak_bytes or budget for o in failed], unit, budget,
                              {"symbol": "diamond-x", "size": 11, "color": "#7c3aed"}, "a job ran out of memory"))
    layout = {
        "margin": {"l": 70, "r": 20, "t": 10, "b": 50},
        "xaxis": {"title": {"text": "micro-batch m (samples)"}, "rangemode": "tozero", "zeroline": False},
        "yaxis": {"title": {"text": f"peak memory ({unit.name})"}, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": -0.2},
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}


_POLICY_STYLE: dict[str, dict[str, Any]] = {
    "none": {"color": "#1f6fb2", "symbol": "circle"},
    "every-2": {"color": "#b45309", "symbol": "diamond"},
    "full": {"color": "#15803d", "symbol": "square"},
    "op": {"color": "#7c3aed", "symbol": "triangle-up"},
}


def _throughput_figure(profiles: Sequence[Profile]) -> dict[str, Any] | None:
    # Measured by timed runs after the search (autotune/measure/throughput.py), never the trials' seconds:
    # a trial's first micro-batches pay warm-up, and fake trials' seconds are the host's.
    traces: list[dict[str, Any]] = []
    for profile in profiles:
        timings = sorted(profile.throughput or [], key=lambda t: t.micro_batch)
        if not timings:
            continue
        policy = profile.activation_checkpointing
        updates = [" + ".join(f"{count}×{size}" for size, count in t.micro_batches) for t in timings]
        # An emulated estimate's are predicted from its recorded fake step (autotune/core/step_time.py), and say so.
        said = " (predicted)" if any(t.predicted for t in timings) else ""
        traces.append(
            {
                "type": "scatter",
                "mode": "markers",
                "meta": f"throughput-{policy}",
                "name": f"checkpointing {policy}{said}" + ("" if profile is profiles[0] else " (another profile)"),
                "x": [t.micro_batch for t in timings],
                "y": [t.samples_per_second for t in timings],
                "customdata": [
                    [f"{t.samples_per_second:,.1f}", update, _seconds(t.seconds_per_update)]
                    for t, update in zip(timings, updates, strict=True)
                ],
                "hovertemplate": f"{policy}: m = %{{x}}<br>%{{customdata[0]}} samples/s<br>update "
                "%{customdata[1]} in %{customdata[2]}<extra></extra>",
                "marker": {**_POLICY_STYLE.get(policy, {}), "size": 10},
            }
        )
    if not traces:
        return None
    predicted = " or predicted" if any(t.predicted for p in profiles for t in p.throughput or []) else ""
    layout = {
        "margin": {"l": 70, "r": 20, "t": 10, "b": 50},
        "xaxis": {"title": {"text": "largest micro-batch of the timed update (samples)"}, "rangemode": "tozero"},
        "yaxis": {"title": {"text": f"samples per second (timed run{predicted})"}, "rangemode": "tozero"},
        "legend": {"orientation": "h", "y": -0.2},
        "hovermode": "closest",
    }
    return {"data": traces, "layout": layout}


def chart_figures(
    profile: Profile, observations: list[ObservationRow], siblings: Sequence[Profile] = ()
) -> dict[str, dict[str, Any]]:
    """The Plotly figures of a datasheet, keyed by the id of the element each is drawn into.

    ``chart-memory``: peak memory against m -- trials that fit, trials over the limit, OOMs and
    fake-tensor trials as separate point traces, the fitted line, the budget and budget x
    (1 - headroom) lines, the chosen m as a vertical line, and the jobs' observations. ``chart-time``
    (only where a timed run was recorded): measured samples per second at the timed micro-batches,
    one trace per memory policy (this profile's and ``siblings``', the same setup's other policies).
    Each trace names itself in ``meta``.
    """
    config = {"responsive": True, "displaylogo": False}
    figures = {"chart-memory": {**_memory_figure(profile, observations), "config": config}}
    timing = _throughput_figure([profile, *siblings])
    if timing is not None:
        figures["chart-time"] = {**timing, "config": config}
    return figures


def trial_counts(profile: Profile) -> str:
    """Real trials apart from fake ones, as the CLI's datasheet says it: '3 real (1 OOM), 12 fake'."""
    real = [t for t in profile.trials if not t.fake]
    fake = len(profile.trials) - len(real)
    text = f"{len(real)} real" + (f" ({sum(t.oom for t in real)} OOM)" if real else "")
    return text + (f", {fake} fake" if fake else "")


def _single_step_plan(profile: Profile) -> bool:
    """Whether the stored plan is one step from the single-step figure (autotune.core.plan.is_single_step)."""
    plan, single = profile.plan, profile.single_step
    return plan is not None and single is not None and is_single_step(plan, profile.max_micro_batch)


def _predicted_peak(profile: Profile, micro_batch: int) -> tuple[float | None, str]:
    if _single_step_plan(profile) and profile.single_step is not None:  # measured by the single-step trials
        single = next((t for t in profile.single_step.trials if t.micro_batch == micro_batch and t.fits), None)
        if single is not None:
            return float(single.peak_bytes), "measured without accumulation"
    measured = profile.peak_at(micro_batch)
    if measured is not None:
        return float(measured), "estimated by a fake trial" if profile.source == "estimate" else "measured"
    predicted = profile.predicted_peak(micro_batch)
    if predicted is not None:
        return predicted, "by the fit"
    return None, ""


# ---------------------------------------------------------------------------------------------------
# Routes

router = APIRouter(include_in_schema=False)


async def _page_reader(settings: SettingsDep, request: Request) -> str | None:
    # The API's read check, answered as a page: a browser user gets a sentence, not a JSON body.
    try:
        return await require_read(settings, request)
    except (AuthenticationRequired, PermissionDenied) as exc:
        title = "Sign-in required" if exc.status_code == 401 else "Not allowed"
        raise PageError(exc.status_code, title, exc.message, headers=exc.headers) from None


PageReader = Annotated[str | None, Depends(_page_reader)]


async def _through_gate(gate: DatabaseGate, work: Callable[[Session], HTMLResponse]) -> HTMLResponse:
    # The page is built and rendered in the gate's thread, while its rows are loaded; a full queue
    # is a page that says so (503 with Retry-After), as the API's server_busy is.
    try:
        return await gate.run(work)
    except ServerBusy as exc:
        message = "The profile store is busy with other requests right now: reload in a few seconds."
        raise PageError(503, "Store busy", message, headers=exc.headers) from None


@router.get("/", response_class=HTMLResponse)
async def index(request: Request, gate: GateDep, _reader: PageReader) -> HTMLResponse:
    """The table of stored profiles, filtered, sorted and paginated by GET parameters."""
    return await _through_gate(gate, lambda session: _index(request, session))


def _index(request: Request, session: Session) -> HTMLResponse:
    query = parse_table_query(dict(request.query_params))
    page = profile_table(session, query)
    root = _root(request)
    context = {
        "page": page,
        "query": page.query,
        "devices": device_names(session),
        "precisions": PRECISIONS,
        "strategies": STRATEGIES,
        "sources": SOURCES,
        "policies": ACTIVATION_CHECKPOINTING,
        "default_sort": DEFAULT_SORT,
        "default_per_page": DEFAULT_PER_PAGE,
        "url": lambda **changes: table_url(root, page.query, **changes),
        "now": datetime.now(timezone.utc),
        "server_url": str(request.base_url).rstrip("/"),
    }
    return _render(request, "index.html", context)


@router.get("/profiles/{profile_id}", response_class=HTMLResponse)
async def profile_page(profile_id: str, request: Request, gate: GateDep, _reader: PageReader) -> HTMLResponse:
    """One profile's datasheet: plan, budget, fit, trials, warnings, observations and two charts."""
    return await _through_gate(gate, lambda session: _profile_page(profile_id, request, session))


def _profile_page(profile_id: str, request: Request, session: Session) -> HTMLResponse:
    # The id is read here, not by FastAPI, so that "/profiles/abc" is this 404 page, not a JSON 422.
    number = int(profile_id) if profile_id.isascii() and profile_id.isdigit() else 0
    if not 1 <= number <= MAX_ID:
        raise PageError(404, "No such profile", f"There is no profile with id {profile_id}.")
    try:
        row = get_profile(session, number)
    except ProfileNotFound:
        raise PageError(404, "No such profile", f"There is no profile with id {number}.") from None
    profile = to_profile(row)
    observations = list_observations(session, number)
    chosen = _chosen_micro_batch(profile)
    peak, peak_source = _predicted_peak(profile, chosen)
    # A sequence-aware profile: its sibling lengths and the m_max / tokens chart (surface_chart.py).
    lengths = length_view(session, row, profile)
    context = {
        "row": row,
        "profile": profile,
        # What the figures were measured under (autotune/core/setup.py): the strategy, mesh, stages and host lines.
        "setup": JobSetup.of_profile(profile),
        "observations": observations,
        "drift": profile_drift(profile, observations),
        "chosen": chosen,
        "chosen_peak": peak,
        "chosen_peak_source": peak_source,
        "single_step_plan": _single_step_plan(profile),
        "figures": {
            **chart_figures(profile, observations, [to_profile(r) for r in policy_siblings(session, row)]),
            **(lengths.figures if lengths is not None else {}),
        },
        "lengths": lengths,
        "trial_micro_batches": TRIAL_MICRO_BATCHES,
        "trial_counts": trial_counts(profile),
        # A stored profile that contradicts its own trials (stored before the checks): shown, never used.
        "inconsistencies": stored_problems(row),
        "api_url": f"{API_PREFIX}/profiles/{number}",
        # Where the memory goes (breakdown_chart.py): SVG drawn here, escaped where it holds the profile's text.
        "breakdown_bars": Markup(breakdown_bars(profile)),
        "timelines": [Markup(timeline_svg(b)) for b in profile.breakdown or []],
        "breakdown_rows": breakdown_rows(profile),
        "host_rows": host_rows(profile),
        "breakdown_labels": [size_label(b) for b in profile.breakdown or []],
        "now": datetime.now(timezone.utc),
        "uploaded_at": to_utc(row.uploaded_at),
    }
    return _render(request, "profile.html", context)


def plotly_js_path() -> Path | None:
    """Where the installed ``plotly`` package keeps plotly.min.js (None when it is not installed).

    Located without importing plotly: the service only needs the file, and training clusters are
    often offline, so the chart library comes from what is installed, never from a CDN.
    """
    spec = importlib.util.find_spec("plotly")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


@router.get(PLOTLY_URL)
def plotly_js() -> Response:
    """plotly.js as shipped inside the installed plotly package."""
    path = plotly_js_path()
    if path is None:
        raise StarletteHTTPException(404, "plotly.min.js is not installed: install the server extra")
    # The file changes only with the plotly package; a day's caching spares 4.6 MB per page view.
    return FileResponse(path, media_type="text/javascript", headers={"Cache-Control": "public, max-age=86400"})


# ---------------------------------------------------------------------------------------------------
# Installation: static files and HTML error pages


def _wants_html(request: Request) -> bool:
    # Browsers ask for text/html; API clients, curl and TestClient send */* or JSON and keep JSON errors.
    return "text/html" in request.headers.get("accept", "") and not request.url.path.startswith(API_PREFIX)


def install(app: FastAPI) -> None:
    """Serve the dashboard's static files and answer its errors (and a browser's 404s) as HTML pages.

    ``create_app`` calls this after including :data:`router`, so the plotly route is matched before
    the ``/static`` mount.
    """
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="dashboard-static")

    async def page_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, PageError)
        context = {"status_code": exc.status_code, "title": exc.title, "message": exc.message}
        return _render(request, "error.html", context, status_code=exc.status_code, headers=exc.headers)

    previous = app.exception_handlers.get(StarletteHTTPException)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if _wants_html(request) or previous is None:
            title = "Not found" if exc.status_code == 404 else f"Error {exc.status_code}"
            message = "Nothing lives at this address." if exc.status_code == 404 else str(exc.detail)
            context = {"status_code": exc.status_code, "title": title, "message": message}
            headers = dict(exc.headers) if exc.headers else None
            return _render(request, "error.html", context, status_code=exc.status_code, headers=headers)
        answer = previous(request, exc)
        return await answer if inspect.isawaitable(answer) else answer

    app.add_exception_handler(PageError, page_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    for database_error in DATABASE_ERRORS:
        app.add_exception_handler(database_error, _outage_page)


def _outage_page(request: Request, exc: Exception) -> Response:
    # The JSON handler classifies and counts the failure (503/507, or a 500 for a real error); a
    # browser gets the same answer as a page that says the store is unreachable.
    answer = database_error_response(request, exc)
    if not _wants_html(request) or answer.status_code not in (503, 507):
        return answer
    since = request.app.state.outage.since() if hasattr(request.app.state, "outage") else None
    when = f" since {since:%H:%M:%S} UTC" if since is not None else ""
    if answer.status_code == 507:
        title, message = "Store full", f"The profile store's disk is full{when}: nothing more can be stored."
    else:
        title = "Store unreachable"
        message = (
            f"The profile store's database is unavailable{when}. The dashboard works again as soon as "
            f"it is back: reload in a few seconds."
        )
    context = {"status_code": answer.status_code, "title": title, "message": message}
    headers = {"Retry-After": answer.headers["retry-after"]} if "retry-after" in answer.headers else None
    return _render(request, "error.html", context, status_code=answer.status_code, headers=headers)
