"""`autotune probe | verify | estimate | fleet | serve | db | suggest | profiles`.

One module per command group (probe, estimate, fleet, service, store) adds its sub-parsers and runs them; this
module holds only ``main``. Every failure a user can cause ends in one line on stderr and a
non-zero exit, never a traceback (AUTOTUNE_DEBUG=1 shows it). Torch, the server and the client are
imported only by the commands that need them, so `autotune serve` runs in the service image
without torch.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Sequence

from autotune.cli.common import EXIT_FAILED, EXIT_NO_FIT, EXIT_USAGE, CliError
from autotune.cli.parser import build_parser

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


def _cannot_fit(exc: BaseException) -> bool:
    from autotune.core.errors import CannotFitError

    return isinstance(exc, CannotFitError)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `autotune` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if os.environ.get("AUTOTUNE_DEBUG"):
            traceback.print_exc()
        if isinstance(exc, _user_error_types()):
            print(f"autotune: error: {exc}", file=sys.stderr)
            return EXIT_NO_FIT if _cannot_fit(exc) else EXIT_USAGE
        first_line = (str(exc).strip().splitlines() or [""])[0]
        print(
            f"autotune: error: {type(exc).__name__}: {first_line} (AUTOTUNE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILED
