"""The CLI functions autotune.cli wires: output, exit codes, one-line errors, against the real app."""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from autotune.cli.client_commands import (
    EXIT_NOT_FOUND,
    EXIT_OK,
    format_suggestion,
    profiles_command,
    suggest_command,
    upload_profile,
)
from autotune.core.errors import ExitCode
from autotune.core.schemas import Suggestion
from autotune_client import AuthenticationError, PermissionDeniedError
from tests.client._factories import FINGERPRINT, make_profile, make_suggestion
from tests.client.conftest import IN_PROCESS_URL, WRITE_TOKEN


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AUTOTUNE_URL", raising=False)
    monkeypatch.delenv("AUTOTUNE_TOKEN", raising=False)


def run_suggest(**overrides: Any) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    args: dict[str, Any] = {
        "server": IN_PROCESS_URL,
        "fingerprint": FINGERPRINT,
        "target_batch": 64,
        "world_size": 2,
        "device_name": "cpu",
        "budget_bytes": None,
        "headroom": None,
        "as_json": False,
    }
    args.update(overrides)
    code = suggest_command(**args, out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def run_profiles(
    action: str, profile_id: int | None = None, *, as_json: bool = False, **filters: Any
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = profiles_command(
        server=IN_PROCESS_URL,
        action=action,
        profile_id=profile_id,
        as_json=as_json,
        filters=filters,
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_suggest_before_and_after_an_upload(in_process_server: Callable[..., Any]) -> None:
    code, out, err = run_suggest()
    assert code == EXIT_NOT_FOUND
    assert out == ""
    assert err.startswith("autotune: error: GET /api/v1/suggest: 404 ") and err.count("\n") == 1

    profile_id = upload_profile(make_profile(max_micro_batch=20), server=IN_PROCESS_URL, token=WRITE_TOKEN)
    code, out, err = run_suggest(as_json=True)
    assert (code, err) == (EXIT_OK, "")
    got = Suggestion.model_validate_json(out)
    assert (got.source, got.profile_id, got.max_micro_batch) == ("measured", profile_id, 20)
    assert got.micro_batch * got.accumulation_steps * 2 == got.effective_batch == 64

    code, out, _ = run_suggest()
    assert code == EXIT_OK
    assert out.startswith(
        f"micro_batch={got.micro_batch} accumulation_steps={got.accumulation_steps} world_size=2"
    )
    assert f"profile {profile_id}" in out


def test_suggest_prints_a_balanced_plan_and_asks_for_a_divisor_one(in_process_server: Callable[..., Any]) -> None:
    upload_profile(make_profile(max_micro_batch=20), server=IN_PROCESS_URL, token=WRITE_TOKEN)
    code, out, _ = run_suggest(target_batch=50, world_size=1)
    assert code == EXIT_OK
    assert out.startswith("micro_batch=17 accumulation_steps=3 world_size=1 effective_batch=50 (exact;")
    assert "micro_batches: 2×17 + 1×16 = 50 (3 steps)" in out
    code, out, _ = run_suggest(target_batch=50, world_size=1, plan="divisor", as_json=True)
    got = Suggestion.model_validate_json(out)
    assert (got.micro_batch, got.accumulation_steps, got.micro_batches) == (10, 5, [(10, 5)])


def test_suggest_with_no_server_anywhere_is_a_one_line_error() -> None:
    code, out, err = run_suggest(server=None)
    assert code == ExitCode.USAGE and out == ""
    assert "AUTOTUNE_URL" in err and err.count("\n") == 1


def test_suggest_against_a_dead_server_fails_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, _, err = run_suggest(server=f"http://127.0.0.1:{port}")
    assert code == ExitCode.SERVER_UNREACHABLE == 3
    assert "cannot reach the tuner" in err


def test_upload_is_idempotent_and_needs_a_good_token(in_process_server: Callable[..., Any]) -> None:
    profile = make_profile()
    with pytest.raises(AuthenticationError) as info:
        upload_profile(profile, server=IN_PROCESS_URL, token=None)
    assert "\n" not in str(info.value)
    with pytest.raises(PermissionDeniedError):
        upload_profile(profile, server=IN_PROCESS_URL, token="wrong")
    first = upload_profile(profile, server=IN_PROCESS_URL, token=WRITE_TOKEN)
    again = upload_profile(profile, server=IN_PROCESS_URL, token=WRITE_TOKEN)
    assert first == again
    other = upload_profile(make_profile(max_micro_batch=9), server=IN_PROCESS_URL, token=WRITE_TOKEN)
    assert other != first


def test_profiles_ls_show_rm(in_process_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    small = upload_profile(make_profile(max_micro_batch=9), server=IN_PROCESS_URL, token=WRITE_TOKEN)
    large = upload_profile(make_profile(max_micro_batch=30), server=IN_PROCESS_URL, token=WRITE_TOKEN)

    code, out, _ = run_profiles("ls", as_json=True)
    assert code == EXIT_OK
    assert sorted(row["id"] for row in json.loads(out)) == sorted([small, large])

    code, out, _ = run_profiles("ls")
    lines = out.splitlines()
    assert code == EXIT_OK and lines[0].split()[:2] == ["id", "fingerprint"] and len(lines) == 3

    code, out, _ = run_profiles("ls", as_json=True, fingerprint="f" * 64)
    assert (code, json.loads(out)) == (EXIT_OK, [])

    code, out, _ = run_profiles("show", large)
    assert code == EXIT_OK
    assert f"profile {large}:" in out and "max micro-batch  30" in out

    code, out, _ = run_profiles("show", large, as_json=True)
    assert json.loads(out)["profile"]["max_micro_batch"] == 30

    code, _, err = run_profiles("rm", large)
    assert code == ExitCode.USAGE and "401" in err  # deleting needs the write token
    monkeypatch.setenv("AUTOTUNE_TOKEN", WRITE_TOKEN)
    code, out, _ = run_profiles("rm", large)
    assert (code, out.strip()) == (EXIT_OK, f"deleted profile {large}")
    code, _, err = run_profiles("show", large)
    assert code == EXIT_NOT_FOUND and "404" in err


@pytest.mark.parametrize(
    ("action", "profile_id", "match"), [("show", None, "needs a profile id"), ("cp", 1, "unknown")]
)
def test_profiles_bad_usage(action: str, profile_id: int | None, match: str) -> None:
    code, _, err = run_profiles(action, profile_id)
    assert code == ExitCode.USAGE and match in err


def test_format_suggestion_says_when_the_target_is_missed() -> None:
    s = make_suggestion(
        micro_batch=7,
        accumulation_steps=3,
        world_size=2,
        effective_batch=42,
        target_batch=40,
        exact=False,
        warnings=["nearest plan"],
    )
    text = format_suggestion(s)
    assert "target 40, +2" in text
    assert text.splitlines()[1] == "warning: nearest plan"


def test_observer_posts_what_the_accumulator_reports(in_process_server: Callable[..., Any]) -> None:
    import warnings

    from autotune.core.schemas import Observation

    client = in_process_server(token=WRITE_TOKEN)
    profile_id = client.upload(make_profile())
    observe = client.observer(profile_id)
    observe(Observation(micro_batch=8, oom=True, note="OOM fallback halved m"))
    stored = client._request("GET", f"/profiles/{profile_id}/observations").json()
    items = stored["items"] if isinstance(stored, dict) else stored
    assert [(o["micro_batch"], o["oom"]) for o in items] == [(8, True)]
    # A refused post (no token) warns instead of stopping the training job.
    silent = in_process_server(token=None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        silent.observer(profile_id)(Observation(micro_batch=4, oom=True))
    assert any("could not report" in str(w.message) for w in caught)


def test_profiles_ls_shows_strategy_world_size_and_source(in_process_server: Callable[..., Any]) -> None:
    from tests.factories import make_profile as shared_make_profile

    def upload(**kwargs: Any) -> int:
        # 1 MiB + 1 MiB x m within 64 MiB x 0.9: 56 is the largest that fits.
        profile = shared_make_profile(
            fingerprint=FINGERPRINT,
            device_kind="cpu",
            device_name="cpu",
            precision="fp32",
            budget_bytes=64 << 20,
            fixed_bytes=1 << 20,
            bytes_per_sample=1 << 20,
            max_micro_batch=56,
            **kwargs,
        )
        return upload_profile(profile, server=IN_PROCESS_URL, token=WRITE_TOKEN)

    ddp = upload(seed=1)
    fsdp = upload(seed=2, strategy="fsdp", world_size=4)
    estimate = upload(seed=3, source="estimate")
    code, out, _ = run_profiles("ls")
    header, *rows = out.splitlines()
    assert code == EXIT_OK and "strategy" in header.split() and "source" in header.split()
    by_id = {int(row.split()[0]): row for row in rows}
    assert "fsdp x4" in by_id[fsdp] and "measured" in by_id[fsdp]
    assert "ddp x1" in by_id[ddp] and "estimate" in by_id[estimate]

    code, out, _ = run_profiles("ls", as_json=True, strategy="fsdp", world_size=4)
    assert [row["id"] for row in json.loads(out)] == [fsdp]
    code, out, _ = run_profiles("ls", as_json=True, source="estimate")
    assert [(row["id"], row["source"]) for row in json.loads(out)] == [(estimate, "estimate")]

    code, out, _ = run_suggest(strategy="fsdp", world_size=4, target_batch=224, as_json=True)
    got = Suggestion.model_validate_json(out)
    assert (code, got.source, got.profile_id, got.strategy) == (EXIT_OK, "measured", fsdp, "fsdp")
    code, out, _ = run_suggest(strategy="fsdp", world_size=4, target_batch=224)
    assert "fsdp, measured, profile" in out


def test_profiles_show_puts_the_stores_warnings_first() -> None:
    from autotune.cli.client_commands import _describe
    from autotune_client._models import StoredProfile

    stored = StoredProfile(id=7, profile=make_profile(), warnings=["this stored profile contradicts itself"])
    text = _describe(stored)
    assert text.splitlines()[1] == "  store warning: this stored profile contradicts itself"
    assert "store warning" not in _describe(StoredProfile(id=8, profile=make_profile()))


def test_upload_directory_takes_a_run_over_lengths_array_and_ls_shows_the_mesh(
    in_process_server: Callable[..., Any], tmp_path: Path
) -> None:
    # Issue 40: `profiles upload DIR` refused the arrays `--seq-len A,B --output` writes; `ls` never said the mesh.
    from autotune.cli.client_commands import upload_directory
    from tests.factories import surface_gpt_payloads

    lengths = surface_gpt_payloads()
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    meshed = make_profile(max_micro_batch=7).model_copy(update={"mesh": {"tp": 2}, "world_size": 4})
    (tmp_path / "meshed.json").write_text(meshed.model_dump_json())
    out, err = io.StringIO(), io.StringIO()
    code = upload_directory(tmp_path, server=IN_PROCESS_URL, token=WRITE_TOKEN, out=out, err=err)
    assert code == EXIT_OK, err.getvalue()
    lines = out.getvalue().splitlines()
    assert [line.split(": profile ")[0].rsplit("/", 1)[-1] for line in lines] == [
        *(f"lengths.json[{i}]" for i in range(len(lengths))),
        "meshed.json",
    ]
    code, listed, _ = run_profiles("ls")
    meshed_rows = [row for row in listed.splitlines() if row.rstrip().endswith("tp=2")]
    assert code == EXIT_OK and len(meshed_rows) == 1


def test_suggest_asks_for_the_jobs_loss(in_process_server: Callable[..., Any]) -> None:
    # --loss: the client sends lm_loss, and a profile of another loss answers with the server's 422 naming it.
    tagged = make_profile(max_micro_batch=20).model_copy(update={"tags": {"lm_loss": "fused-linear"}})
    upload_profile(tagged, server=IN_PROCESS_URL, token=WRITE_TOKEN)
    code, out, err = run_suggest(lm_loss="fused-linear", as_json=True)
    assert (code, err) == (EXIT_OK, "") and Suggestion.model_validate_json(out).max_micro_batch == 20
    code, out, err = run_suggest(lm_loss="plain")
    assert code == ExitCode.USAGE and out == "" and err.count("\n") == 1 and "lm_loss" in err


def test_the_fingerprint_every_listing_shows_is_the_one_suggest_takes(in_process_server: Callable[..., Any]) -> None:
    """Issue 62, item 3: the datasheet showed 16 digits, `profiles ls` 12, and `suggest --fingerprint` took
    neither (404). Both now show the same 16 digits, and suggest answers them with the stored profile."""
    from autotune.cli.report import datasheet

    profile = make_profile(max_micro_batch=20)
    profile_id = upload_profile(profile, server=IN_PROCESS_URL, token=WRITE_TOKEN)
    (sheet_line,) = [line for line in datasheet(profile).splitlines() if line.strip().startswith("fingerprint")]
    from_sheet = sheet_line.split()[1]
    code, out, _ = run_profiles("ls")
    assert code == EXIT_OK
    header, row = out.splitlines()
    assert header.split()[:2] == ["id", "fingerprint"]
    from_list = row.split()[1]
    assert from_sheet == from_list == FINGERPRINT[:16]
    code, out, err = run_suggest(fingerprint=from_list, as_json=True)
    assert (code, err) == (EXIT_OK, "")
    got = Suggestion.model_validate_json(out)
    assert (got.profile_id, got.fingerprint) == (profile_id, FINGERPRINT)
