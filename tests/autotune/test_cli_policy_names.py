"""`--ac` with every-K and op as users type them: one profile each under its canonical name, the
``recommended:`` line among them, and a bad name refused in one line before any trial."""

from __future__ import annotations

import json
from pathlib import Path

from tests.autotune.test_cli_policies import TINY_GPT, autotune


def test_estimate_takes_every_k_and_op_lists_and_recommends_among_them(tmp_path: Path) -> None:
    (tmp_path / "tiny.py").write_text(TINY_GPT)
    done = autotune(
        "estimate", f"{tmp_path}/tiny.py:task", "--device-kind", "cpu", "--budget", "3MiB",
        "--ac", "every-3,op:aten.mm/addmm", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    profiles = json.loads(done.stdout)
    assert [p["activation_checkpointing"] for p in profiles] == ["every-3", "op:addmm/mm"]
    assert len({p["fingerprint"] for p in profiles}) == 1  # one setup, two policies
    [line] = [line for line in done.stderr.splitlines() if line.startswith("recommended:")]
    assert all(f"--ac {name}:" in line for name in ("every-3", "op:addmm/mm"))


def test_a_bad_name_in_the_list_is_one_line_and_stores_nothing(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    done = autotune(
        "probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "2MiB", "--ac", "none,every-1",
        "--output", str(out),
    )  # fmt: skip
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.strip().splitlines() == [
        "autotune: error: argument --ac: 'every-1' checkpoints every block: that is full (every-K needs K >= 2); "
        "a comma list probes several: none,every-2,op"
    ]
