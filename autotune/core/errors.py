"""The probe's errors. Each carries a one-line message meant for the user as it is."""

from __future__ import annotations

__all__ = ["AutotuneError", "BudgetError", "CannotFitError", "DeviceError", "TaskError", "TrialError"]


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
    exits with its own status for it (``autotune.cli.common.EXIT_NO_FIT``)."""

    def __init__(self, message: str, diagnosis: object = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


class TrialError(AutotuneError):
    """A trial failed with an error that is not out-of-memory: the probe stops rather than guess."""
