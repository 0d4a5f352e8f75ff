"""The probe's errors, and the exit status every ``autotune`` command ends with. Each error carries a one-line
message meant for the user as it is.

The exit status (one table for every command, the client's ``suggest`` and ``profiles`` included, so that a
launch script branches on it the same way after any of them)::

    0  OK                  done
    1  FAILED              not the user's input: an internal error (the line names the exception;
                           AUTOTUNE_DEBUG=1 shows the traceback), a verify that found a mismatch, a fleet pair
                           that failed, the server answering 5xx
    2  USAGE               a usage or input error the user must fix, refused before any work starts (a bad
                           flag or value, a task that does not load, a device that does not exist, a token the
                           server refuses, a request field it rejects)
    3  SERVER_UNREACHABLE  the server could not be reached (refused, timed out, DNS) or is not serving (503)
    4  NO_FIT              not even the smallest micro-batch fits the budget (CannotFitError; /suggest's
                           budget_too_small)
    5  NOT_FOUND           nothing stored answers: /suggest has no profile for the setup, no profile has the id
  141  PIPE_CLOSED         the reader of stdout closed it early (`autotune profiles ls | head -1`): the command
                           stops quietly, as a Unix tool killed by SIGPIPE does (128 + 13)
"""

from __future__ import annotations

import enum

__all__ = [
    "AutotuneError",
    "BudgetError",
    "CannotFitError",
    "DeviceError",
    "ExitCode",
    "TaskError",
    "TrialError",
    "exit_code_for",
]


class ExitCode(enum.IntEnum):
    """The exit status of every ``autotune`` command (the table in this module's docstring, docs/probing.md)."""

    OK = 0
    FAILED = 1
    USAGE = 2
    SERVER_UNREACHABLE = 3
    NO_FIT = 4
    NOT_FOUND = 5
    PIPE_CLOSED = 141


class AutotuneError(Exception):
    """Base of every error the CLI turns into one line and a non-zero exit."""


class TaskError(AutotuneError):
    """The task does not load or does not behave (batch without tensors, non-scalar loss, ...)."""


class DeviceError(AutotuneError):
    """The device asked for does not exist or cannot be used."""


class BudgetError(AutotuneError):
    """The budget is missing, malformed, or too small for even one sample."""


class CannotFitError(BudgetError):
    """Even the smallest micro-batch does not fit. The message is one line with what the job needs
    and what would fit it; ``diagnosis`` is the :class:`autotune.search.diagnose.NoFit` behind it. The CLI
    exits with its own status for it (:attr:`ExitCode.NO_FIT`)."""

    def __init__(self, message: str, diagnosis: object = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


class TrialError(AutotuneError):
    """A trial failed with an error that is not out-of-memory: the probe stops rather than guess."""


def exit_code_for(exc: BaseException) -> ExitCode:
    """The exit status of an error of the probe's: NO_FIT for CannotFitError, USAGE for another
    AutotuneError (the user's to fix), FAILED for anything else. The client's errors have their own
    rule (``autotune.cli.client_commands.exit_code_for``), which the CLI applies first."""
    if isinstance(exc, CannotFitError):
        return ExitCode.NO_FIT
    if isinstance(exc, AutotuneError):
        return ExitCode.USAGE
    return ExitCode.FAILED
