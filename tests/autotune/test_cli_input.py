"""Every input honoured or refused before any work starts (issue 31, part 3), and the one table of exit codes.

Each refusal: one line naming the flag, the value and the rule; exit 2; no trial line, nothing stored in a real
store (an ``autotune serve`` process), no output file. The exit codes: the table of autotune.core.errors.ExitCode,
the same from every command (estimate and suggest against an unreachable server both 3), and as documented.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from autotune.cli import main
from autotune.core.errors import ExitCode
from tests.e2e.conftest import LiveServer, free_port, start_server

REPO = Path(__file__).resolve().parents[2]
MLP = "examples/mlp.py:task"

# A task file whose import ends the process (a script without an ``if __name__ == "__main__":`` guard).
EXITS_AT_IMPORT = "import sys\nsys.exit(0)\n"
# A task that trains at every size but one: the emulated search is asked for that one (--micro-batches 5).
FAILS_AT_FIVE = """
import torch
from autotune.tasks.task import ProbeTask


def batch(m):
    if m == 5:
        raise ValueError("this task refuses micro-batch 5")
    return torch.randn(m, 8), torch.randn(m, 2)


task = ProbeTask(name="fails-at-five", model=lambda: torch.nn.Linear(8, 2), batch=batch)
"""


def _hf_config(path: Path, **changes: object) -> str:
    """A two-layer llama config (as tests/autotune/_hf_configs.py writes them) with changes, written as JSON."""
    import json

    values: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "vocab_size": 128,
        "max_position_embeddings": 64,
        **changes,
    }
    path.write_text(json.dumps(values))
    return f"hf:{path}"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A real store: refusals must leave it empty."""
    server = start_server(tmp_path_factory.mktemp("input-store"))
    yield server
    server.stop()


def _stored(server: LiveServer) -> int:
    answer = httpx.get(f"{server.url}/api/v1/profiles", timeout=10.0)
    answer.raise_for_status()
    return len(answer.json()["items"])


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) in this process: the exit code (the parser's own included), stdout, stderr."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse refuses a value by its type
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _refusals(tmp: Path, url: str) -> list[tuple[list[str], str]]:
    """(argv, what the one line must say) for each bad input: every one refused before any work."""
    folder = tmp / "a-folder"
    folder.mkdir()
    a_file = tmp / "a-file"
    a_file.write_text("{}")
    exits = tmp / "exits.py"
    exits.write_text(EXITS_AT_IMPORT)
    estimate = ["estimate", MLP]
    on_cpu = [*estimate, "--device-kind", "cpu", "--budget", "2MiB"]
    probe = ["probe", MLP, "--device", "cpu", "--budget", "2MiB"]
    dense = _hf_config(tmp / "dense.json")
    moe = _hf_config(tmp / "moe.json", model_type="mixtral", num_local_experts=8, num_experts_per_tok=2)

    def ep_on(model: str) -> list[str]:
        return ["probe", model, "--device", "cpu", "--budget", "8MiB", "--seq-len", "16", "--strategy", "fsdp"]

    return [
        ([*estimate, "--gpu", "l4", "--budget", "1TiB", "--server", url], "above the l4's memory"),
        ([*estimate, "--device-name", "NVIDIA L4", "--budget", "1TiB", "--server", url], "NVIDIA L4's memory"),
        ([*on_cpu, "--micro-batches", "5"], "extra sizes are estimated for a card only"),
        ([*estimate, "--gpu", "h100", "--micro-batches", "1000000000000"], "above 16777216"),
        ([*estimate, "--gpu", "h100", "--micro-batches", "5000"], "--micro-batches 5000: above --max-micro-batch 4096"),
        ([*estimate, "--gpu", "h100", "--multiple-of", "4", "--micro-batches", "6"], "not a multiple of --multiple-of"),
        ([*estimate, "--device-kind", "cpu", "--budget", "99999999999999TiB"], "above 1 EiB"),
        ([*estimate, "--device-kind", "cpu", "--budget", "0.5"], "'0.5' is less than one byte"),
        ([*estimate, "--device-kind", "cpu", "--budget", "-5MiB"], "cannot read '-5MiB' as a size"),
        ([*probe, "--output", str(folder)], "is a folder: give a file name"),
        # A folder that does not exist yet, named by its separator (issue 62: a file "profiles" was written).
        ([*probe, "--output", "not-yet-there/"], "'not-yet-there/' names a folder: give a file name"),
        ([*estimate, "--device-kind", "cpu", "--budget", "8MiB", "--output", "out/"], "'out/' names a folder"),
        ([*probe, "--output", str(a_file / "p.json")], "is a file, not a folder"),
        ([*probe, "--server", "not-a-url"], "'not-a-url' is not a server URL"),
        ([*on_cpu, "--server", "ftp://host"], "'ftp://host' is not a server URL"),
        ([*on_cpu, "--server", "http://127.0.0.1:99999"], "is not a server URL"),
        ([*on_cpu, "--moe-load-factor", "inf"], "'inf' is not a finite number"),
        ([*on_cpu, "--moe-load-factor", "nan"], "'nan' is not a finite number"),
        ([*on_cpu, "--moe-load-factor", "0.5"], "0.5 is below 1"),
        ([*on_cpu, "--lr", "nan"], "--lr: 'nan' is not a finite number"),
        ([*on_cpu, "--lora-alpha", "inf"], "--lora-alpha: 'inf' is not a finite number"),
        ([*on_cpu, "--headroom", "nan"], "the headroom is a fraction in [0, 1)"),
        ([*on_cpu, "--max-micro-batch", "99999999999999999999"], "above 16777216"),
        ([*on_cpu, "--world-size", "99999999"], "above 1048576"),
        ([*on_cpu, "--world-size", "2", "--cp", "2", "--compile"], "--cp 2 with --compile default: torch.compile"),
        ([*on_cpu, "--strategy", "fsdp", "--world-size", "2", "--tp", "2"], "--strategy fsdp with --world-size 2 over"),
        (["probe", f"{exits}:task", "--device", "cpu", "--budget", "8MiB"], f"task '{exits}:task'"),
        (
            [
                "estimate",
                _hf_config(tmp / "heads.json", hidden_size=100, num_attention_heads=7),
                "--device-kind",
                "cpu",
                "--budget",
                "64MiB",
                "--seq-len",
                "16",
            ],
            "The hidden size (100) is not a multiple of the number of attention heads (7)",
        ),  # fmt: skip
        (
            [
                "estimate",
                _hf_config(tmp / "layers.json", num_hidden_layers=10**6),
                "--device-kind",
                "cpu",
                "--budget",
                "64MiB",
                "--seq-len",
                "16",
            ],
            "num_hidden_layers 1000000",
        ),  # fmt: skip
        (
            [
                "estimate",
                _hf_config(tmp / "vocab.json", vocab_size=10**30),
                "--device-kind",
                "cpu",
                "--budget",
                "64MiB",
                "--seq-len",
                "16",
            ],
            "vocab_size 1000000000000000000000000000000",
        ),  # fmt: skip
        # --ep (issue 63): a dense model, experts or ranks it does not divide, a strategy it is not measured under.
        ([*ep_on(dense), "--world-size", "2", "--ep", "2"], "which has no routed experts"),
        ([*ep_on(moe), "--world-size", "3", "--ep", "3"], "--ep 3 on the model's 8 experts"),
        ([*ep_on(moe), "--world-size", "3", "--ep", "2"], "--ep 2 does not divide the 3 ranks of a stage"),
        ([*ep_on(moe)[:-2], "--world-size", "2", "--ep", "2"], "--ep 2 with --strategy ddp"),
        ([*ep_on(moe), "--world-size", "4", "--ep", "2", "--tp", "2"], "--ep 2 with --tp 2"),
        ([*ep_on(moe), "--world-size", "2", "--ep", "2", "--moe-load-factor", "0.5"], "0.5 is below 1"),
        ([*ep_on(moe), "--world-size", "2", "--ep", "2", "--moe-load-factor", "9"], "--moe-load-factor 9: with 8"),
        (["fleet", MLP, "--device", "cpu", "--budget", "2MiB", "--output", str(a_file)], "is a file: fleet writes"),
        (["fleet", MLP, "--gpu", "l4", "--budget", "1TiB", "--output", str(folder)], "above the l4's memory"),
        (["verify", MLP, "--target-batch", "2", "--micro-batch", "8"], "--micro-batch 8 is larger than"),
        (["verify", MLP, "--target-batch", "1"], "nothing to accumulate"),
        (["verify", MLP, "--tolerance", "nan"], "--tolerance: 'nan' is not a finite number"),
        (["serve", "--port", "70000"], "70000 is above 65535"),
        (["db", "upgrade", "--database-url", "nope://"], "is not a database URL"),
        (["suggest", "--fingerprint", "a" * 64, "--target-batch", "8", "--device-name", "cpu"], "give --server URL"),
        (
            [
                "suggest",
                "--server",
                url,
                "--fingerprint",
                "a" * 64,
                "--target-batch",
                "8",
                "--device-name",
                "NVIDIA H100 80GB HBM3",
                "--budget",
                "1TiB",
            ],
            "above the NVIDIA H100 80GB HBM3's memory",
        ),  # fmt: skip
        (["profiles", "show", "abc", "--server", url], "'abc' is not a profile id"),
    ]


def test_every_bad_input_is_one_line_exit_2_before_any_work(
    store: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("AUTOTUNE_TOKEN", store.token)
    monkeypatch.delenv("AUTOTUNE_URL", raising=False)
    monkeypatch.delenv("AUTOTUNE_DATABASE_URL", raising=False)
    cases = _refusals(tmp_path, store.url)
    before = sorted(tmp_path.rglob("*"))
    problems = []
    for argv, said in cases:
        code, out, err = run_cli(argv, capsys)
        lines = err.strip().splitlines()
        ok = (
            code == ExitCode.USAGE
            and len(lines) == 1
            and lines[0].startswith("autotune: error: ")
            and said in lines[0]
            and out == ""
        )
        if not ok:
            problems.append(f"{' '.join(argv)}: exit {code}, stderr {err[-600:]!r}")
    assert not problems, "\n".join(problems)
    assert _stored(store) == 0
    # No profile, no half-written file (a-folder.tmp), no fleet folder: only the files the cases were given.
    assert sorted(tmp_path.rglob("*")) == before


def test_a_task_that_exits_at_import_is_an_error_naming_it(tmp_path: Path) -> None:
    """In a process of its own, as users run it: before, autotune itself exited 0 and said nothing."""
    import subprocess
    import sys

    exits = tmp_path / "exits.py"
    exits.write_text(EXITS_AT_IMPORT)
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "estimate", f"{exits}:task", "--device-kind", "cpu", "--budget", "8MiB"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == ExitCode.USAGE
    assert done.stderr.strip().splitlines() == [
        f"autotune: error: task '{exits}:task': importing '{exits}' called sys.exit(0): a task file must not exit "
        "when imported (put the script's part under if __name__ == '__main__':)"
    ]


def test_the_exit_codes_are_one_table() -> None:
    assert {code.name: int(code) for code in ExitCode} == {
        "OK": 0,
        "FAILED": 1,
        "USAGE": 2,
        "SERVER_UNREACHABLE": 3,
        "NO_FIT": 4,
        "NOT_FOUND": 5,
        "PIPE_CLOSED": 141,
    }


def test_the_docs_table_is_the_enum() -> None:
    """docs/probing.md's table of exit codes lists exactly ExitCode's, each by its number and name."""
    text = (REPO / "docs" / "probing.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", text, flags=re.M)
    assert [(int(number), name) for number, name in rows] == [(int(code), code.name) for code in ExitCode]


def test_unreachable_server_is_3_from_every_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("AUTOTUNE_TOKEN", "any")
    dead = f"http://127.0.0.1:{free_port()}"
    suggest = ["suggest", "--server", dead, "--fingerprint", "a" * 64, "--target-batch", "8", "--device-name", "cpu"]
    code, _, err = run_cli(suggest, capsys)
    assert code == ExitCode.SERVER_UNREACHABLE, err
    code, _, err = run_cli(["profiles", "ls", "--server", dead], capsys)
    assert code == ExitCode.SERVER_UNREACHABLE, err
    # estimate finds out when it uploads, after its work: the datasheet is printed, the exit says what failed.
    out_file = tmp_path / "kept.json"
    estimate = ["estimate", MLP, "--device-kind", "cpu", "--budget", "2MiB", "--server", dead, "--output"]
    estimate.append(str(out_file))
    code, out, err = run_cli(estimate, capsys)
    assert code == ExitCode.SERVER_UNREACHABLE, err
    assert "autotune datasheet: mlp" in out and out_file.is_file()
    assert err.strip().splitlines()[-1].startswith("autotune: error: cannot reach the tuner")


def test_the_store_answers_by_the_table(
    store: LiveServer, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """suggest: nothing stored 5, a fingerprint the server rejects 2 (a usage error, as the docs say)."""
    monkeypatch.delenv("AUTOTUNE_URL", raising=False)
    common = ["suggest", "--server", store.url, "--target-batch", "8", "--device-name", "cpu"]
    code, _, err = run_cli([*common, "--fingerprint", "a" * 64], capsys)
    assert code == ExitCode.NOT_FOUND and "404" in err
    code, _, err = run_cli([*common, "--fingerprint", "not-hex"], capsys)
    assert code == ExitCode.USAGE and "422 fingerprint" in err and err.count("\n") == 1


def test_an_emulated_child_that_fails_at_a_size_is_an_error_not_cpu_semantics(
    cuda_python: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The emulated search tries --micro-batches 5, where the task raises: an error for that size, exit 2,
    where the estimate used to fall back to CPU semantics (whose search never tries 5) and exit 0."""
    monkeypatch.chdir(REPO)
    task = tmp_path / "fails_at_five.py"
    task.write_text(FAILS_AT_FIVE)
    out_file = tmp_path / "p.json"
    argv = ["estimate", f"{task}:task", "--gpu", "h100", "--max-micro-batch", "8", "--micro-batches", "5",
            "--output", str(out_file)]  # fmt: skip
    code, out, err = run_cli(argv, capsys)
    assert code == ExitCode.USAGE, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("autotune: error: ") and "micro-batch 5" in last and "refuses micro-batch 5" in last
    assert "CPU semantics" not in err and not out_file.exists() and out == ""


def test_the_emulations_own_failures_still_fall_back() -> None:
    """Which child errors are the emulation's (CPU semantics then, saying why) and which the task's (an error)."""
    from autotune.emulation.runner import _emulation_at_fault

    uncovered = ["autotune-emulation: fakecuda: cudaGraphLaunch is not emulated"]
    assert _emulation_at_fault("RuntimeError: boom", uncovered)
    assert _emulation_at_fault("RuntimeError: CUDA error: invalid device ordinal", [])
    assert not _emulation_at_fault("trial at micro-batch 5 failed: ValueError: this task refuses micro-batch 5", [])


def test_sizes_and_the_schema_agree() -> None:
    from autotune.core.schemas import MAX_BYTES
    from autotune.core.units import MAX_SIZE_BYTES, parse_bytes

    assert MAX_SIZE_BYTES == MAX_BYTES
    assert parse_bytes("1024TiB") == 2**50 and parse_bytes(str(2**60)) == 2**60
    # Every unit up to the cap reads (issue 62: "1PiB cannot read as a size" where 1024TiB did).
    assert parse_bytes("1PiB") == 2**50 and parse_bytes("1EiB") == 2**60 and parse_bytes("2PB") == 2 * 10**15
    with pytest.raises(ValueError, match="above 1 EiB"):
        parse_bytes("2EiB")
    with pytest.raises(ValueError, match="above 1 EiB"):
        parse_bytes(str(2**60 + 1))
