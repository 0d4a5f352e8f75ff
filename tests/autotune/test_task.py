"""Loading tasks from files and modules, with one-line errors that say what was looked for."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autotune.core.errors import TaskError
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask, default_loss

TASK_FILE = """
import torch
from autotune.tasks.task import ProbeTask

def make():
    return ProbeTask(name="from-callable", model=lambda: torch.nn.Linear(4, 2), batch=lambda m: torch.zeros(m, 4))

task = make()
not_a_task = 42
def broken():
    raise RuntimeError("boom")
"""


@pytest.fixture
def task_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.py"
    path.write_text(TASK_FILE)
    return path


def test_file_and_module_specs(task_file: Path) -> None:
    assert load_task(f"{task_file}:task").name == "from-callable"
    assert load_task(f"{task_file}:make").name == "from-callable"  # a zero-argument callable
    assert load_task(str(task_file)).name == "from-callable"  # ":task" is the default
    assert load_task("examples.gpt:task").name == "gpt-small"


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        (":missing", "has no attribute 'missing'"),
        (":not_a_task", "is a int, not a ProbeTask"),
        (":broken", "failed: RuntimeError: boom"),
    ],
)
def test_bad_attributes(task_file: Path, suffix: str, message: str) -> None:
    with pytest.raises(TaskError, match=message):
        load_task(f"{task_file}{suffix}")


MODEL_FILE = """
import torch

WIDTH = {width}

class GPT(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(4, WIDTH)

    def forward(self, x):
        return self.head(x)
"""

TRAIN_FILE = """
import torch
from model import GPT  # the sibling file, as `python train.py` finds it
from autotune import ProbeTask

task = ProbeTask(name="two-files", model=GPT, batch=lambda m: torch.zeros(m, 4))
"""


def _two_file_task(folder: Path, width: int) -> Path:
    folder.mkdir()
    (folder / "model.py").write_text(MODEL_FILE.format(width=width))
    (folder / "train.py").write_text(TRAIN_FILE)
    return folder / "train.py"


def test_a_task_file_imports_its_siblings(tmp_path: Path) -> None:
    import sys

    path_before = list(sys.path)
    first = load_task(f"{_two_file_task(tmp_path / 'a', 3)}:task")
    # A second folder with its own model.py gets its own, not the first one's cached module.
    second = load_task(f"{_two_file_task(tmp_path / 'b', 5)}:task")
    for task, width in ((first, 3), (second, 5)):
        model = task.model()
        loss = task.compute_loss(model, task.batch(2))
        loss.backward()
        assert model.head.weight.grad is not None and model.head.out_features == width
    assert sys.path == path_before  # the folder was on the path for the import only
    assert "model" not in sys.modules


NEEDS_TARGETS = """
import torch
from autotune import ProbeTask

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, targets):
        return torch.nn.functional.cross_entropy(self.head(x), targets)

task = ProbeTask(name="needs-targets", model=Net, batch=lambda m: (torch.randn(m, 8), torch.randint(0, 4, (m,))))
"""


def test_default_loss_on_a_model_that_needs_targets_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    path = tmp_path / "job.py"
    path.write_text(NEEDS_TARGETS)
    code = main(["probe", f"{path}:task", "--device", "cpu", "--budget", "64MiB"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1].startswith("autotune: error: task 'needs-targets': Net.forward needs targets")
    assert "loss=lambda model, batch: model(*batch)" in err[-1]
    assert "BatchNorm" not in err[-1]
    # The loss it names trains the model.
    task = load_task(f"{path}:task")
    named = ProbeTask(name="x", model=task.model, batch=task.batch, loss=lambda model, batch: model(*batch))
    assert named.compute_loss(named.model(), named.batch(2)).dim() == 0


def test_missing_file_and_module() -> None:
    with pytest.raises(TaskError, match="task file 'nowhere/job.py' not found"):
        load_task("nowhere/job.py:task")
    with pytest.raises(TaskError, match="module 'no_such_module_xyz' not found"):
        load_task("no_such_module_xyz:task")


def test_import_error_in_the_users_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(TaskError, match="importing .*bad.py.* failed: ModuleNotFoundError"):
        load_task(f"{path}:task")


def test_precision_is_checked() -> None:
    with pytest.raises(TaskError, match="precision must be one of"):
        ProbeTask(name="x", model=lambda: torch.nn.Linear(1, 1), batch=lambda m: torch.zeros(m, 1), precision="fp8")


def test_default_loss_follows_the_output() -> None:
    model = torch.nn.Linear(4, 3)
    classes = (torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1]))
    regression = (torch.randn(5, 4), torch.randn(5, 3))
    expected_ce = torch.nn.functional.cross_entropy(model(classes[0]), classes[1])
    assert torch.allclose(default_loss(model, classes), expected_ce)
    assert torch.allclose(
        default_loss(model, regression), torch.nn.functional.mse_loss(model(regression[0]), regression[1])
    )
    x = torch.randn(5, 4)
    assert torch.allclose(default_loss(model, x), model(x).mean())
