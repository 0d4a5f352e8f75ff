"""The fingerprint: stable across processes, sensitive to what decides memory, blind to the rest."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import torch

from autotune.tasks.fingerprint import fingerprint_model, task_fingerprint
from autotune.tasks.load import load_task
from examples import gpt


def test_same_setup_in_two_processes() -> None:
    code = (
        "from autotune.tasks.load import load_task; from autotune.tasks.fingerprint import task_fingerprint; "
        "print(task_fingerprint(load_task('examples/gpt.py:task')))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {task_fingerprint(load_task("examples/gpt.py:task"))}
    assert len(outs.pop()) == 64


def test_file_and_module_loading_agree() -> None:
    assert task_fingerprint(load_task("examples/gpt.py:task")) == task_fingerprint(load_task("examples.gpt:task"))


def test_what_changes_it() -> None:
    task = load_task("examples/gpt.py:task")
    base = task_fingerprint(task)
    changed = {
        "shape": dataclasses.replace(task, model=lambda: gpt.GPT(gpt.GPTConfig(d_model=128))),
        "dtype": dataclasses.replace(task, model=lambda: gpt.GPT().to(torch.bfloat16)),
        "optimizer": dataclasses.replace(task, optimizer=lambda p: torch.optim.SGD(p, lr=0.1)),
        "optimizer option": dataclasses.replace(task, optimizer=lambda p: torch.optim.AdamW(p, amsgrad=True)),
        "tag": dataclasses.replace(task, tags={**task.tags, "checkpointing": True}),
        "precision": dataclasses.replace(task, precision="bf16"),
        "input": dataclasses.replace(task, batch=lambda m: gpt.make_batch(m, gpt.GPTConfig(seq_len=32))),
    }
    digests = {name: task_fingerprint(t) for name, t in changed.items()}
    assert base not in digests.values()
    assert len(set(digests.values())) == len(digests)


def test_what_does_not_change_it() -> None:
    model = gpt.GPT()
    example = gpt.make_batch(1)
    base = fingerprint_model(model, example)
    with torch.no_grad():
        model.head.weight.add_(1.0)  # values do not decide memory
    assert fingerprint_model(model, example) == base
    assert fingerprint_model(model, gpt.make_batch(3, seed=9)) == base  # nor the batch size or content
    assert fingerprint_model(model, example, optimizer=lambda p: torch.optim.AdamW(p, lr=0.5)) == base  # nor lr
