"""`autotune probe | verify | estimate | fleet | serve | db | suggest | profiles`.

One module per command group (probe, estimate, fleet, service, store) adds its sub-parsers and runs them; this
module holds only ``main``. Every input is checked before any work starts (``autotune.cli.inputs``), and every
failure a user can cause ends in one line on stderr and the exit status of one table for every command
(``autotune.core.errors.ExitCode``: 0 ok, 1 failed, 2 usage or input, 3 server unreachable, 4 nothing fits,
5 nothing stored, 141 the reader closed the output early), never a traceback (AUTOTUNE_DEBUG=1 shows it). Torch,
the server and the client are imported only by the commands that need them, so `autotune serve` runs in the service
image without torch.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from autotune.cli.common import CliError, ExitCode, exit_code_of
from autotune.cli.inputs import check_inputs
from autotune.cli.parser import build_parser
from autotune.cli.recipes.apply import apply_recipe

__all__ = ["build_parser", "main"]


def _user_error_types() -> tuple[type[BaseException], ...]:
    from autotune.core.errors import AutotuneError

    types: list[type[BaseException]] = [AutotuneError, CliError]
    try:
        from autotune_client.errors import AutotuneClientError

        types.append(AutotuneClientError)
    except ImportError:
        pass
    return tuple(types)


def _pipe_closed() -> int:
    """The reader of the output went away (``autotune profiles ls | head -1``): stop without a word, as a Unix tool
    ended by SIGPIPE does. What is still buffered for the closed pipe goes to /dev/null, so that the interpreter's
    own flush at exit does not fail on it (Python's docs, "Note on SIGPIPE")."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):
            try:
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
            except (OSError, ValueError):  # a stream without a descriptor (a test's capture): nothing left to flush
                pass
    return ExitCode.PIPE_CLOSED


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autotune` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    if argv is None and not args.verbose:
        # From a terminal: the libraries' own log lines stay off it (autotune -v keeps them). Not when called in
        # a process with argv (a test, a script), whose loggers and environment are its own.
        from autotune.core.library_logs import quiet_library_logs

        quiet_library_logs()
    try:
        apply_recipe(args, argv)  # --recipe FILE: its job's flags, before they are checked as typed ones are
        check_inputs(args)
        code = int(args.run(args))
        sys.stdout.flush()  # a closed pipe is found here for what is still buffered, not at the interpreter's exit
        return code
    except BrokenPipeError:
        return _pipe_closed()
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except SystemExit as exc:  # the parser's own exits happened above; this one is a task's or a library's
        if exc.code not in (0, None):
            raise
        print(
            f"autotune: error: something autotune ran called sys.exit({exc.code!r}) before {args.command} finished "
            "(a task's code, or a library it calls): nothing was done",
            file=sys.stderr,
        )
        return ExitCode.FAILED
    except Exception as exc:
        if os.environ.get("AUTOTUNE_DEBUG"):
            traceback.print_exc()
        if isinstance(exc, _user_error_types()):
            print(f"autotune: error: {exc}", file=sys.stderr)
            return exit_code_of(exc)
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(
            f"autotune: error: {type(exc).__name__}: {first_line} (AUTOTUNE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return ExitCode.FAILED
