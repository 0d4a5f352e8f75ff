"""What the libraries print on their own stays off the terminal of ``autotune`` run from one (issue 41): their Python
warnings about themselves among it, where a warning raised on a caller's behalf (attributed to the caller's module:
the task's code, autotune's) still reaches the user."""

from __future__ import annotations

import logging
import os
import warnings

import pytest

from autotune.core.library_logs import _LOGGERS, QUIET_VARIABLE, quiet_library_logs


def _shown(module: str) -> bool:
    """Whether a UserWarning attributed to module passes the filters in force."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("said", UserWarning, f"{module.replace('.', '/')}.py", 1, module=module)
    return bool(caught)


def test_a_librarys_own_warnings_are_quieted_and_the_callers_are_not(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "environ", dict(os.environ))  # what quiet_library_logs sets stays in this test
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            assert _shown("torch._functorch._aot_autograd.autograd_cache")
            quiet_library_logs()
            assert os.environ[QUIET_VARIABLE] == "quiet"
            for module in ("torch._functorch._aot_autograd.autograd_cache", "torchao.optim.adam", "peft", "torch"):
                assert not _shown(module), module
            for module in ("autotune.measure.trial", "__main__", "my_task", "torchvision_like_task"):
                assert _shown(module), module
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
