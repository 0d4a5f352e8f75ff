"""The commands that talk to the profile store through ``autotune_client``; ``autotune.cli.store`` and
``autotune.cli.probe`` wire these to the parser. They live in the CLI, not in the client package, so that
the client imports nothing of the CLI (the datasheet and the trial lines are ``autotune.cli.report``'s).

    autotune suggest --server URL --fingerprint F --target-batch T --world-size D --device-name N
                     [--strategy ddp|fsdp] [--json]
    autotune profiles ls|show|rm [ID] --server URL [--json] [--fingerprint F --task NAME --strategy fsdp ...]
    autotune profiles upload DIR --server URL          (the JSON profiles a fleet run kept there)

Results go to stdout (JSON with ``--json``, one readable line otherwise) and every failure is one
line on stderr with the exit status of every ``autotune`` command (``autotune.core.errors.ExitCode``), so that
launch scripts can branch on it:

    0  success
    1  the server failed (5xx after the retries)
    2  usage or input: no server given, a URL that is not one, a field the server rejects (422), a token it
       refuses (401/403)
    3  the server cannot be reached (refused, timed out) or is not serving (503 after the retries)
    4  nothing fits: the budget holds not even one micro-batch (``suggest``'s budget_too_small)
    5  not found: nothing stored for this setup (``suggest``) or no such profile id
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from pydantic import TypeAdapter, ValidationError

from autotune.cli.report import datasheet, trial_line
from autotune.core.errors import ExitCode
from autotune.core.plan import micro_batches_text
from autotune.core.schemas import Profile, Suggestion, shown_fingerprint
from autotune.core.units import format_bytes
from autotune_client._client import TunerClient
from autotune_client._models import ProfileSummary, StoredProfile
from autotune_client.errors import (
    APIConnectionError,
    APIStatusError,
    AutotuneClientError,
    InternalServerError,
    NotFoundError,
)

__all__ = [
    "EXIT_NOT_FOUND",
    "EXIT_OK",
    "exit_code_for",
    "format_suggestion",
    "profiles_command",
    "suggest_command",
    "upload_directory",
    "upload_profile",
]

# Names kept from before the one table of exit codes (autotune.core.errors.ExitCode).
EXIT_OK = ExitCode.OK
EXIT_NOT_FOUND = ExitCode.NOT_FOUND

# /suggest's code for "not even one micro-batch fits the budget" (autotune_server.errors.BudgetTooSmall).
_NO_FIT_CODES = frozenset({"budget_too_small"})


def exit_code_for(exc: AutotuneClientError) -> ExitCode:
    """The exit status of a client error, by the table of every command (``autotune.core.errors.ExitCode``).

    >>> from autotune_client.errors import APIConnectionError
    >>> int(exit_code_for(APIConnectionError("cannot reach the tuner")))
    3
    """
    if isinstance(exc, APIConnectionError):  # timeouts included
        return ExitCode.SERVER_UNREACHABLE
    if isinstance(exc, NotFoundError):
        return ExitCode.NOT_FOUND
    if isinstance(exc, InternalServerError):  # still failing after the retries
        return ExitCode.SERVER_UNREACHABLE if exc.status_code == 503 else ExitCode.FAILED
    if isinstance(exc, APIStatusError) and exc.code in _NO_FIT_CODES:
        return ExitCode.NO_FIT
    return ExitCode.USAGE  # no server given, a bad URL, a rejected field or token: the user's to fix


def _fail(exc: AutotuneClientError, err: TextIO) -> int:
    print(f"autotune: error: {exc}", file=err)
    return exit_code_for(exc)


def format_suggestion(s: Suggestion) -> str:
    """One line a person reads: the plan, where it came from, and any deviation from the target."""
    exact = "exact" if s.exact else f"target {s.target_batch}, {s.effective_batch - s.target_batch:+d}"
    where = s.source + (f", profile {s.profile_id}" if s.profile_id is not None else "")
    if s.strategy != "ddp":
        where = f"{s.strategy}, {where}"
    if s.mesh:  # world_size above is then the replicas D, not the ranks
        where = f"mesh {s.mesh}, {where}"
    if s.host_budget_bytes is not None:
        where += f", within a host budget of {s.host_budget_bytes} bytes"
    if s.activation_checkpointing != "none":  # the job must run under it for the plan to fit
        where = f"activation checkpointing {s.activation_checkpointing}, {where}"
    if s.samples_per_second is not None:
        where += f", {s.samples_per_second:.4g} samples/s timed"
    # A one-step plan (A = 1) is above max_micro_batch, the accumulating job's: say which case applied.
    bound = f"max micro-batch {s.max_micro_batch}" + (
        " accumulating; one step per update (A = 1) measured without accumulation" if s.single_step else ""
    )
    line = (
        f"micro_batch={s.micro_batch} accumulation_steps={s.accumulation_steps} world_size={s.world_size} "
        f"effective_batch={s.effective_batch} ({exact}; {where}; {bound})"
    )
    if s.seq_len is not None and s.tokens_per_update is not None:
        line += (
            f"\ntokens: {s.tokens_per_micro_batch} per micro-batch, {s.tokens_per_update} per update (L={s.seq_len})"
        )
    if s.uneven:  # micro_batch is the largest size: say what the steps really are
        line += f"\nmicro_batches: {micro_batches_text(s.micro_batches, s.world_size)}"
    return "\n".join([line, *(f"warning: {w}" for w in s.warnings)])


def suggest_command(
    *,
    server: str | None,
    fingerprint: str,
    target_batch: int | None,
    world_size: int,
    device_name: str,
    budget_bytes: int | None,
    headroom: float | None,
    as_json: bool,
    strategy: str = "ddp",
    plan: str = "balanced",
    seq_len: int | None = None,
    target_tokens: int | None = None,
    activation_checkpointing: str = "none",
    objective: str = "memory",
    mesh: str = "",
    host_budget_bytes: int | None = None,
    offload: str | None = None,
    compile: str | None = None,
    lm_loss: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``autotune suggest``: print the stored plan for a setup; returns the exit code.

    ``server`` None falls back to ``$AUTOTUNE_URL``. A miss exits 3 with the server's explanation
    (what was looked for, how to probe it) on stderr.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    try:
        with TunerClient(base_url=server) as client:
            suggestion = client.suggest(
                fingerprint=fingerprint,
                target_batch=target_batch,
                world_size=world_size,
                device_name=device_name,
                budget_bytes=budget_bytes,
                headroom=headroom,
                strategy=strategy,
                plan=plan,
                seq_len=seq_len,
                target_tokens=target_tokens,
                activation_checkpointing=activation_checkpointing,
                mesh=mesh,
                objective=objective,
                host_budget_bytes=host_budget_bytes,
                offload=offload,
                compile=compile,
                lm_loss=lm_loss,
            )
    except AutotuneClientError as exc:
        return _fail(exc, err)
    print(suggestion.model_dump_json() if as_json else format_suggestion(suggestion), file=out)
    return ExitCode.OK


def _row(summary: ProfileSummary) -> str:
    created = summary.created_at.strftime("%Y-%m-%d %H:%M")
    # fsdp x 8: one rank's figures of 8; ddp x 4: measured with DDP over 4 replicas.
    kind = f"{summary.strategy} x{summary.world_size}"
    # The setup beyond strategy and ranks, where it has more: the mesh (the figures are one rank's of it) and the
    # host budget an offloading probe was measured within.
    host = f"host budget {format_bytes(summary.host_budget_bytes)}" if summary.host_budget_bytes else ""
    setup = ", ".join(filter(None, [summary.mesh, host]))
    return (
        f"{summary.id:>6}  {shown_fingerprint(summary.fingerprint):<16}  {summary.task[:20]:<20}  "
        f"{summary.device_name[:28]:<28}  {summary.precision:<5}  {kind[:10]:<10}  {summary.source[:8]:<8}  "
        f"{summary.max_micro_batch:>7}  {created}" + (f"  {setup}" if setup else "")
    )


def _describe(stored: StoredProfile) -> str:
    """The probe's own datasheet (one text for both), headed by the stored id, with every trial."""
    p = stored.profile
    memory = "the card" if p.source == "estimate" and p.device.kind == "cuda" else "the budget"
    trials = "\n".join(f"    {trial_line(t, p.limit_bytes, memory=memory)}" for t in p.trials)
    # The store's own warnings first: a profile that contradicts its trials is never used by /suggest.
    store = "".join(f"  store warning: {w}\n" for w in stored.warnings)
    return (
        f"profile {stored.id}: {p.task} on {p.device.name} ({p.precision})\n{store}"
        f"  fingerprint {p.fingerprint}\n  budget {p.budget_bytes} bytes, headroom {p.headroom}\n"
        f"{datasheet(p)}\n  trials, in the order they ran:\n{trials}"
    )


def profiles_command(
    *,
    server: str | None,
    action: str,
    profile_id: int | None,
    as_json: bool,
    filters: dict[str, Any],
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``autotune profiles ls|show|rm``; returns the exit code.

    Args:
        action: "ls" (filters apply: fingerprint, task, device_name, precision, strategy,
            world_size, source, limit), "show" or
            "rm" (both need ``profile_id``; rm needs a write token in ``$AUTOTUNE_TOKEN``).
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if action not in ("ls", "show", "rm"):
        print(f"autotune: error: unknown profiles action {action!r}: use ls, show or rm", file=err)
        return ExitCode.USAGE
    if action != "ls" and profile_id is None:
        print(f"autotune: error: profiles {action} needs a profile id", file=err)
        return ExitCode.USAGE
    try:
        with TunerClient(base_url=server) as client:
            if action == "ls":
                stored = client.profiles(**{k: v for k, v in filters.items() if v is not None})
                if as_json:
                    print(json.dumps([s.model_dump(mode="json") for s in stored]), file=out)
                else:
                    header = (
                        f"{'id':>6}  {'fingerprint':<16}  {'task':<20}  {'device':<28}  "
                        f"{'prec':<5}  {'strategy':<10}  {'source':<8}  {'m_max':>7}  created"
                    )
                    print("\n".join([header, *(_row(s) for s in stored)]), file=out)
            elif action == "show":
                assert profile_id is not None
                one = client.profile(profile_id)
                print(one.model_dump_json() if as_json else _describe(one), file=out)
            else:
                assert profile_id is not None
                client.delete(profile_id)
                done = json.dumps({"deleted": profile_id}) if as_json else f"deleted profile {profile_id}"
                print(done, file=out)
    except AutotuneClientError as exc:
        return _fail(exc, err)
    return ExitCode.OK


def upload_profile(profile: Profile, *, server: str, token: str | None) -> int:
    """Store a measured profile (``autotune probe ... --server URL``) and return its id.

    ``token`` None falls back to ``$AUTOTUNE_TOKEN``. Uploading the same profile again returns the
    same id.

    Raises:
        AutotuneClientError: with a one-line message (unreachable, 401/403, rejected field, ...).
    """
    with TunerClient(base_url=server, token=token) as client:
        return client.upload(profile)


def _profiles_in(path: Path) -> list[Profile]:
    """The profiles of a file: one profile, or the JSON array a run over lengths writes (``--seq-len A,B --output``).

    Raises:
        ValueError: the file is neither (pydantic's ValidationError for a profile that does not validate).
    """
    text = path.read_text()
    if text.lstrip().startswith("["):
        entries = TypeAdapter(list[Profile]).validate_json(text)
        if not entries:
            raise ValueError("an empty array")
        return entries
    return [Profile.model_validate_json(text)]


def upload_directory(
    directory: Path,
    *,
    server: str | None,
    token: str | None = None,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """``autotune profiles upload DIR``: store every ``*.json`` profile in DIR; returns the exit code.

    What ``autotune fleet`` (or ``autotune probe --output``) kept while the server was down. Each
    file prints ``FILE: profile ID`` on stdout; uploading a directory again stores nothing twice
    (the server keys profiles by content) and prints the same ids. A file that is not a profile, or
    that the server rejects, is one line on stderr and the others still go; an unreachable server
    stops the upload. ``server`` None falls back to ``$AUTOTUNE_URL``, ``token`` to ``$AUTOTUNE_TOKEN``.
    """
    out = out or sys.stdout
    err = err or sys.stderr
    if not directory.is_dir():
        print(f"autotune: error: {str(directory)!r} is not a directory", file=err)
        return ExitCode.USAGE
    files = sorted(directory.glob("*.json"))
    if not files:
        print(f"autotune: error: no *.json profiles in {directory}", file=err)
        return ExitCode.USAGE
    failed = 0
    try:
        with TunerClient(base_url=server, token=token) as client:
            for path in files:
                try:
                    profiles = _profiles_in(path)
                except (OSError, ValueError, ValidationError) as exc:
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                    print(f"autotune: error: {path} is not a profile: {first}", file=err)
                    failed += 1
                    continue
                for index, profile in enumerate(profiles):
                    # A file of one profile is named as it is; a run over lengths' array, entry by entry.
                    where = f"{path}[{index}]" if len(profiles) > 1 else str(path)
                    try:
                        print(f"{where}: profile {client.upload(profile)}", file=out, flush=True)
                    except APIConnectionError:
                        raise
                    except AutotuneClientError as exc:
                        print(f"autotune: error: {where}: {exc}", file=err)
                        failed += 1
    except AutotuneClientError as exc:
        return _fail(exc, err)
    if failed:
        print(f"autotune: error: {failed} of {len(files)} files not uploaded", file=err)
    return ExitCode.USAGE if failed else ExitCode.OK
