"""`autotune probe` of the tiny Llama of tests/autotune/_pipeline_worker.py as a task file, for the pipelines' bad
input (test_pipeline.py, test_pipeline_fsdp.py): one line naming the flag and the cause, exit 2, nothing written."""

from __future__ import annotations

from pathlib import Path

import pytest

TASK_FILE = """
from autotune import ProbeTask
from tests.autotune import _pipeline_worker as w

task = ProbeTask(name="tiny-llama", model=w.TinyLlama, batch=w.make_batch,
                 loss=lambda model, batch: w.lm_loss(model(batch[0]), batch[1]))
"""


def refused_line(
    flags: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    """The error line of `autotune probe` of the task file with ``flags``, after checking it exited 2 with
    that one line last and wrote no profile."""
    from autotune.cli import main
    from autotune.core.errors import ExitCode

    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    (tmp_path / "llama_task.py").write_text(TASK_FILE)
    output = tmp_path / "profile.json"
    argv = ["probe", f"{tmp_path / 'llama_task.py'}:task", "--device", "cpu", "--budget", "1000000"]
    code = main([*argv, *flags, "--output", str(output)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE
    assert lines[-1].startswith("autotune: error: ")
    assert not output.exists()
    return lines[-1]
