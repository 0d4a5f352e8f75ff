"""docs/fine-tuning.md's blocks, run as written (each in a fresh process, in an empty folder, as a user would; the
scripts' `autotune` commands and the Python example forked warm by tests/warm_cli.py):
the LoRA run on a Llama config (probe and estimate agree), the classifier (probe and verify), the Python
example; and the datasheet lines the page shows are the ones the LoRA run prints."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import warm_cli
from tests.e2e.test_docs import DOCS, blocks, section

PAGE = DOCS / "fine-tuning.md"
TIMEOUT_SECONDS = 600

pytest.importorskip("peft", reason="the hf extra (peft) is not installed")


def run(command: list[str], cwd: Path) -> str:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("AUTOTUNE_URL", None)
    done = warm_cli.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_SECONDS)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


def test_lora_on_a_llama_config(tmp_path: Path) -> None:
    text = section(PAGE, "## LoRA on a Llama config")
    (script,) = blocks(text, "bash")
    (shown,) = blocks(text, "")
    (tmp_path / "run.sh").write_text(script)
    out = run(["bash", "-e", "run.sh"], tmp_path)
    sheets = re.findall(r"autotune datasheet: (llama-\S+-lora8-bf16) over sequence lengths", out)
    assert len(sheets) == 2, out[-2000:]
    rows = re.findall(r"^\s+64\s+(\d+)\s", out, re.MULTILINE)
    assert len(rows) == 2 and rows[0] == rows[1], out[-2000:]  # the estimate's m_max is the probe's
    for line in shown.strip("\n").splitlines():
        assert line in out.splitlines()


def test_a_classifier(tmp_path: Path) -> None:
    (script,) = blocks(section(PAGE, "## A classifier"), "bash")
    (tmp_path / "run.sh").write_text(script)
    out = run(["bash", "-e", "run.sh"], tmp_path)
    assert "  model            BertForSequenceClassification (sequence-classification)" in out
    assert re.search(r"bert-seq-cls-\S+: ok: accumulation reproduces the full-batch gradient", out), out[-2000:]


def test_from_python(tmp_path: Path) -> None:
    (script,) = blocks(section(PAGE, "## From Python"), "python")
    (tmp_path / "example.py").write_text(script)
    out = run([sys.executable, "example.py"], tmp_path)
    printed = r"^hf:t5\?lora_rank=4&weights_dtype=bf16 (t5-seq2seq-\S+-lora4-bf16) q,v (\d+)$"
    found = re.search(printed, out, re.MULTILINE)
    assert found, out[-2000:]
    assert int(found.group(2)) >= 1


def test_a_mixture_of_experts(tmp_path: Path) -> None:
    import json

    (script,) = blocks(section(PAGE, "## A mixture of experts"), "bash")
    (tmp_path / "run.sh").write_text(script)
    out = run(["bash", "-e", "run.sh"], tmp_path)
    assert "autotune datasheet: mixtral-" in out
    profiles = json.loads((tmp_path / "moe.json").read_text())
    assert [p["seq_len"] for p in profiles] == [64, 128]
    assert all(p["moe_load_factor"] == 1.5 and p["source"] == "estimate" for p in profiles)
    assert profiles[0]["max_micro_batch"] >= profiles[1]["max_micro_batch"] >= 1
    assert "Traceback" not in out


def test_the_loss_as_the_job_computes_it(tmp_path: Path) -> None:
    text = section(PAGE, "## The loss as the job computes it")
    (script,) = blocks(text, "bash")
    (shown,) = blocks(text, "")
    (tmp_path / "run.sh").write_text(script)
    out = run(["bash", "-e", "run.sh"], tmp_path)
    rows = [int(m) for m in re.findall(r"^\s+32\s+(\d+)\s", out, re.MULTILINE)]
    # The page's words: the plain loss fits 3, the fused one 10.
    assert rows == [3, 10], out[-3000:]
    assert "peak of m=3 at _log_softmax_backward_data.default in LlamaForCausalLM backward" in out
    assert "peak of m=10 at mm.default in LlamaForCausalLM forward" in out
    for line in shown.strip("\n").splitlines():
        assert line in out.splitlines()
