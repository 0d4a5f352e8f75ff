"""`autotune probe | verify | serve | db | suggest | profiles`.

Every failure a user can cause ends in one line on stderr and a non-zero exit, never a traceback
(AUTOTUNE_DEBUG=1 shows it). Torch, the server and the client are imported only by the commands
that need them, so `autotune serve` runs in the service image without torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.units import parse_bytes

__all__ = ["build_parser", "main"]

EXIT_USAGE = 2
EXIT_FAILED = 1


class CliError(Exception):
    """A user mistake caught by the CLI itself (bad flag values)."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def _size(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _headroom(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"headroom must be in [0, 1), got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:  # one line, exit 2, like every other usage error
        self.exit(EXIT_USAGE, f"autotune: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="autotune", description="Memory-budget tuner for PyTorch training.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("probe", help="measure the largest micro-batch that fits and plan the target batch")
    p.add_argument("task", help="path/to/file.py:name or package.module:name (a ProbeTask)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | all | auto (default)")
    p.add_argument("--budget", type=_size, help="bytes or 800MiB / 24GiB (required on cpu)")
    p.add_argument("--headroom", type=_headroom, default=0.10, help="fraction kept free (default 0.10)")
    p.add_argument("--target-batch", type=_positive_int, help="effective batch T to plan for")
    p.add_argument("--world-size", type=_positive_int, default=1, help="data-parallel replicas D")
    p.add_argument("--max-micro-batch", type=_positive_int, default=4096)
    p.add_argument("--multiple-of", type=_positive_int, default=1)
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="override the task's precision")
    p.add_argument("--output", type=Path, help="also write the profile JSON to this file")
    p.add_argument("--json", action="store_true", help="print the profile as JSON on stdout")
    p.add_argument("--server", help="upload the profile to this autotune server (token: AUTOTUNE_TOKEN)")

    v = sub.add_parser("verify", help="prove that accumulation reproduces the big-batch gradient")
    v.add_argument("task")
    v.add_argument("--target-batch", type=_positive_int)
    v.add_argument("--micro-batch", type=_positive_int)
    v.add_argument("--tolerance", type=float)

    s = sub.add_parser("serve", help="run the profile store and REST API")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--workers", type=_positive_int, default=1)
    s.add_argument("--database-url", help="default: AUTOTUNE_DATABASE_URL or a SQLite file")

    d = sub.add_parser("db", help="database maintenance")
    d.add_argument("action", choices=["upgrade"])
    d.add_argument("--database-url")

    g = sub.add_parser("suggest", help="ask the server for a plan (for launch scripts)")
    g.add_argument("--server")
    g.add_argument("--fingerprint", required=True)
    g.add_argument("--target-batch", type=_positive_int, required=True)
    g.add_argument("--world-size", type=_positive_int, default=1)
    g.add_argument("--device-name", required=True)
    g.add_argument("--budget", type=_size)
    g.add_argument("--headroom", type=_headroom)
    g.add_argument("--json", action="store_true")

    r = sub.add_parser("profiles", help="list, show or remove stored profiles")
    r.add_argument("action", choices=["ls", "show", "rm"])
    r.add_argument("profile_id", nargs="?", type=int)
    r.add_argument("--server")
    r.add_argument("--json", action="store_true")
    r.add_argument("--fingerprint")
    r.add_argument("--task")
    r.add_argument("--device-name")
    r.add_argument("--precision")
    return parser


def _probe(args: argparse.Namespace) -> int:
    from autotune.probe import ProbeConfig, probe
    from autotune.report import datasheet, trial_line
    from autotune.task import load_task

    task = load_task(args.task)
    config = ProbeConfig(
        device=args.device,
        budget_bytes=args.budget,
        headroom=args.headroom,
        target_batch=args.target_batch,
        world_size=args.world_size,
        max_micro_batch=args.max_micro_batch,
        multiple_of=args.multiple_of,
        precision=args.precision,
    )
    limit = int(args.budget * (1 - args.headroom)) if args.budget else None
    print(f"probing {task.name} on {args.device} ...", file=sys.stderr)
    if args.device.strip().lower() == "all":
        from autotune.multi import probe_all_devices

        profile = probe_all_devices(args.task, config)
    else:
        profile = probe(task, config, on_trial=lambda t: print(trial_line(t, limit), file=sys.stderr, flush=True))
    text = profile.model_dump_json(indent=2)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.output.with_name(args.output.name + ".tmp")
        tmp.write_text(text + "\n")
        tmp.replace(args.output)  # never a half-written profile on disk
    if args.json:
        print(text)
        print(datasheet(profile), file=sys.stderr)
    else:
        print(datasheet(profile))
    if args.server:
        from autotune_client.cli import upload_profile

        profile_id = upload_profile(profile, server=args.server, token=os.environ.get("AUTOTUNE_TOKEN"))
        print(f"uploaded as profile {profile_id} to {args.server}", file=sys.stderr)
    return 0


def _verify(args: argparse.Namespace) -> int:
    from autotune.task import load_task
    from autotune.verify import verify_cli

    ok, message = verify_cli(load_task(args.task), args.target_batch, args.micro_batch, args.tolerance)
    print(message, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else EXIT_FAILED


def _serve(args: argparse.Namespace) -> int:
    from autotune_server.runner import serve

    serve(host=args.host, port=args.port, workers=args.workers, database_url=args.database_url)
    return 0


def _db(args: argparse.Namespace) -> int:
    from autotune_server.migrate import upgrade_head

    url = args.database_url or os.environ.get("AUTOTUNE_DATABASE_URL")
    if url is None:
        from autotune_server.settings import Settings

        url = Settings().database_url
    upgrade_head(url)
    print(f"database at head: {url.split('@')[-1]}", file=sys.stderr)
    return 0


def _suggest(args: argparse.Namespace) -> int:
    from autotune_client.cli import suggest_command

    return suggest_command(
        server=args.server,
        fingerprint=args.fingerprint,
        target_batch=args.target_batch,
        world_size=args.world_size,
        device_name=args.device_name,
        budget_bytes=args.budget,
        headroom=args.headroom,
        as_json=args.json,
    )


def _profiles(args: argparse.Namespace) -> int:
    from autotune_client.cli import profiles_command

    if args.action in ("show", "rm") and args.profile_id is None:
        raise CliError(f"profiles {args.action} needs a profile id")
    filters = {
        key: value
        for key, value in {
            "fingerprint": args.fingerprint,
            "task": args.task,
            "device_name": args.device_name,
            "precision": args.precision,
        }.items()
        if value is not None
    }
    return profiles_command(
        server=args.server, action=args.action, profile_id=args.profile_id, as_json=args.json, filters=filters
    )


_COMMANDS = {
    "probe": _probe,
    "verify": _verify,
    "serve": _serve,
    "db": _db,
    "suggest": _suggest,
    "profiles": _profiles,
}


def _user_error_types() -> tuple[type[BaseException], ...]:
    from autotune.errors import AutotuneError

    types: list[type[BaseException]] = [AutotuneError, CliError]
    try:
        from autotune_client.errors import AutotuneClientError

        types.append(AutotuneClientError)
    except ImportError:
        pass
    return tuple(types)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autotune` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("AUTOTUNE_DEBUG"):
            traceback.print_exc()
        if isinstance(exc, _user_error_types()):
            print(f"autotune: error: {exc}", file=sys.stderr)
            return EXIT_USAGE
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(
            f"autotune: error: {type(exc).__name__}: {first_line} (AUTOTUNE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
