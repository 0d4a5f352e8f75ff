"""What `autotune fleet` runs, decided before Ray is touched: the pairs, their probe configs and Ray
options, the command line's checks, the progress table and where profiles go. No Ray here."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from autotune.cli import build_parser, main
from autotune.cli.common import EXIT_USAGE
from autotune.core.errors import AutotuneError, TaskError
from autotune.core.schemas import Profile
from autotune.fleet import Pair, ProfileSink, Progress, Stored, make_pairs, parse_accelerators
from autotune.fleet.pairs import worker_spec
from autotune.fleet.runner import _warn_unplaceable
from autotune.fleet.sink import profile_file_name
from autotune.orchestrate.probe import ProbeConfig
from tests.e2e.conftest import REPO, free_port
from tests.factories import make_profile

MiB = 1 << 20


def _config(device: str, budget: int | None) -> ProbeConfig:
    return ProbeConfig(device=device, budget_bytes=budget, target_batch=64)


def _pairs(specs: list[str], **kwargs: object) -> list[Pair]:
    options: dict[str, object] = {"accelerators": None, "device": "cpu", "budgets": [8 * MiB], **kwargs}
    return make_pairs(specs, config_for=_config, working_dir=REPO, **options)  # type: ignore[arg-type]


def test_pairs_are_tasks_times_accelerator_kinds_times_budgets_each_asking_one_gpu_of_its_kind() -> None:
    pairs = _pairs(
        ["examples/gpt.py:task", "examples/mlp.py:task"],
        accelerators=["H100", "A100"],
        device=None,
        budgets=[None, 24 * 2**30],
    )
    assert [(p.index, p.spec, p.on, p.budget_bytes) for p in pairs] == [
        (i, spec, kind, budget)
        for i, (spec, kind, budget) in enumerate(
            (spec, kind, budget)
            for spec in ("examples/gpt.py:task", "examples/mlp.py:task")
            for kind in ("H100", "A100")
            for budget in (None, 24 * 2**30)
        )
    ]
    assert {p.config.device for p in pairs} == {"cuda"}
    assert pairs[1].ray_options(3) == {"num_cpus": 1, "num_gpus": 1, "accelerator_type": "H100", "max_retries": 3}
    assert pairs[0].budget_label == "device" and pairs[1].budget_label == "24.00 GiB"


def test_cpu_pairs_ask_for_a_cpu_only_and_any_gpu_pairs_for_one_gpu() -> None:
    (cpu,) = _pairs(["examples/mlp.py:task"])
    assert cpu.ray_options(0) == {"num_cpus": 1, "max_retries": 0}
    assert cpu.config.device == "cpu" and cpu.config.budget_bytes == 8 * MiB and cpu.config.target_batch == 64
    (gpu,) = _pairs(["examples/mlp.py:task"], device="cuda", budgets=[None])
    assert gpu.ray_options(1) == {"num_cpus": 1, "num_gpus": 1, "max_retries": 1}


def test_task_files_are_shipped_relative_to_the_working_directory(tmp_path: Path) -> None:
    absolute = str(REPO / "examples" / "gpt.py") + ":task"
    assert worker_spec(absolute, REPO) == "examples/gpt.py:task"
    assert worker_spec("examples/gpt.py", REPO) == "examples/gpt.py"
    assert worker_spec("examples.gpt:task", REPO) == "examples.gpt:task"  # a module: found on the worker
    with pytest.raises(TaskError, match="outside the working directory"):
        worker_spec("examples/gpt.py:task", tmp_path)
    with pytest.raises(TaskError, match="not found"):
        worker_spec("examples/nope.py:task", REPO)


def test_an_hf_config_is_shipped_like_a_task_file_with_its_options(tmp_path: Path) -> None:
    config = tmp_path / "models" / "llama"
    config.mkdir(parents=True)
    (config / "config.json").write_text("{}")
    assert worker_spec(f"hf:{config}", tmp_path) == "hf:models/llama"
    assert worker_spec(f"hf:{config}?optimizer=SGD&lr=0.1", tmp_path) == "hf:models/llama?optimizer=SGD&lr=0.1"
    with pytest.raises(TaskError, match="outside the working directory"):
        worker_spec(f"hf:{config}", REPO)
    with pytest.raises(TaskError, match="not found"):
        worker_spec(f"hf:{tmp_path / 'nope'}", tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accelerators": ["H100"], "device": "cpu"}, "--accelerators H100,A100"),
        ({"accelerators": None, "device": None}, "--accelerators H100,A100"),
        ({"device": "cuda:1"}, "Ray assigns the GPU"),
        ({"device": "cpu", "budgets": [None]}, "--device cpu needs --budget"),
        ({"budgets": [8 * MiB, 8 * MiB]}, "repeats a value"),
    ],
)
def test_a_fleet_that_cannot_run_is_refused_before_any_cluster_time(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(AutotuneError, match=match):
        _pairs(["examples/mlp.py:task"], **kwargs)


def test_a_task_given_twice_or_none_is_refused() -> None:
    with pytest.raises(AutotuneError, match="given twice"):
        _pairs(["examples/mlp.py:task", "examples/mlp.py:task"])
    with pytest.raises(AutotuneError, match="at least one task"):
        _pairs([])


def test_accelerator_lists() -> None:
    assert parse_accelerators(" H100, A100,H100 ,L4") == ["H100", "A100", "L4"]
    for bad in ("", " , ", "H 100", "A100;rm"):
        with pytest.raises(AutotuneError):
            parse_accelerators(bad)


def test_the_command_line_takes_probe_options_and_a_budget_list() -> None:
    args = build_parser().parse_args(
        ["fleet", "examples/mlp.py:task", "examples/gpt.py:task", "--device", "cpu", "--budget", "8MiB, 16MiB",
         "--headroom", "0.2", "--target-batch", "256", "--server", "http://127.0.0.1:1"]
    )  # fmt: skip
    assert args.tasks == ["examples/mlp.py:task", "examples/gpt.py:task"]
    assert args.budget == [8 * MiB, 16 * MiB] and args.headroom == 0.2 and args.target_batch == 256
    assert args.ray_address is None and args.max_retries == 3 and args.working_dir == Path(".")


def test_offload_and_gpu_memory_reach_each_pairs_config_as_probe_and_estimate_take_them() -> None:
    """--offload on probe pairs and estimate pairs, --gpu-memory on an estimate pair for a card the catalog lacks:
    in the config each pair's worker runs (no Ray: the pairs are made on the driver)."""
    from autotune.cli.fleet import _estimate_pairs, _probe_pairs

    parse = build_parser().parse_args
    common = ["fleet", "examples/gpt.py:task", "--output", "x", "--strategy", "fsdp", "--world-size", "2"]
    probes = _probe_pairs(parse([*common, "--device", "cpu", "--budget", "8MiB", "--offload", "params"]))
    assert [pair.config.offload for pair in probes] == ["params"]
    card = parse([*common, "--gpu", "h100-nvl-96", "--gpu-memory", "96GiB", "--offload", "activations"])
    (estimate,) = _estimate_pairs(card)
    # The card described by name and memory (the closest catalog card's architecture), its memory the budget.
    assert estimate.config.card.memory_bytes == 96 << 30 and estimate.config.card.assumed_from.startswith("h100")
    assert estimate.budget_bytes == estimate.config.card.device_total_bytes
    assert estimate.setup.offload == "activations" and estimate.on.startswith("h100-nvl-96")
    (catalog,) = _estimate_pairs(parse([*common, "--gpu", "h100"]))
    assert catalog.config.card.assumed_from is None and catalog.setup.offload is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--device", "cpu", "--budget", "8MiB"], "nowhere to keep the profiles"),
        (["--device", "cpu", "--output", "x"], "--device cpu needs --budget"),
        (["--device", "cpu", "--budget", "8MiB,,9MiB", "--output", "x"], "empty budget"),
        (["--device", "cpu", "--accelerators", "H100", "--output", "x"], "not allowed with argument"),
        (["--output", "x"], "one of the arguments --accelerators --device --gpu is required"),
        (["--device", "cpu", "--budget", "8MiB", "--output", "x", "--headroom", "1.5"], "headroom"),
        (["--device", "cpu", "--budget", "8MiB", "--output", "x", "--gpu-memory", "96GiB"], "give --gpu NAME"),
        (["--gpu", "h100,l4", "--gpu-memory", "96GiB", "--output", "x"], "--gpu-memory is one card's memory"),
        (["--gpu", "h100-nvl-96", "--output", "x"], "--gpu: unknown card 'h100-nvl-96'"),
        (["--device", "cpu", "--budget", "8MiB", "--output", "x", "--offload", "params"], "with --strategy ddp"),
        # Issue 40: a probe pair had no way to carry it and dropped it.
        (["--device", "cpu", "--budget", "8MiB", "--output", "x", "--moe-load-factor", "2"], "applies to fleet"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["fleet", "examples/mlp.py:task", *argv])
    except SystemExit as exc:  # argparse's own errors (the parser prints one line and exits)
        code = exc.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert code == EXIT_USAGE and message in err and len(err.strip().splitlines()) == 1, err


def _row_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line[:1].isdigit()]


def test_progress_logs_each_change_and_ends_with_the_summary_table() -> None:
    pairs = _pairs(["examples/mlp.py:task", "examples/gpt.py:task"], budgets=[8 * MiB, 16 * MiB])
    stream = io.StringIO()
    progress = Progress(pairs, stream, live=False)
    progress.started(0, 1)
    progress.started(0, 1)  # the board repeats itself every poll: one line per change only
    progress.started(0, 2)  # the worker died and Ray started it again
    progress.done(0, attempt=2, max_micro_batch=26, plan="16×16 = 256 (16 steps)", stored=Stored(7, None, None),
                  seconds=1.5, host="node-a")  # fmt: skip
    progress.started(1, 1)
    progress.failed(1, "TrialError: trial at micro-batch 1 failed: ValueError: bad", attempt=1, seconds=0.5)
    log = stream.getvalue().splitlines()
    assert [line.rsplit("MiB: ", 1)[1] for line in log] == [
        "running",
        "running (attempt 2)",
        "done (profile 7)",
        "running",
        "failed (TrialError: trial at micro-batch 1 failed: ValueError: bad)",
    ]
    assert log[2].startswith("fleet: [1/4] #0 examples/mlp.py:task on cpu, budget 8.00 MiB")
    assert progress.counts() == {"pending": 2, "running": 0, "done": 1, "failed": 1}
    summary = progress.summary()
    assert summary.splitlines()[0].startswith("fleet: 4 pairs: 2 pending, 0 running, 1 done, 1 failed")
    rows = _row_lines(summary)
    assert rows[0].split()[:9] == ["0", "examples/mlp.py:task", "cpu", "8.00", "MiB", "done", "(attempt", "2)", "26"]
    assert rows[0].endswith("profile 7") and rows[1].endswith("ValueError: bad") and "failed" in rows[1]
    assert [state.ok for state in progress.rows.values()] == [True, False, False, False]
    assert json.loads(json.dumps(progress.rows[0].as_json()))["profile_id"] == 7


def test_the_live_table_is_redrawn_in_place() -> None:
    stream = io.StringIO()
    progress = Progress(_pairs(["examples/mlp.py:task"]), stream, live=True)
    progress.refresh()
    progress.started(0, 1)
    progress.refresh()
    progress.close()
    first, second, erased = stream.getvalue().split("\x1b[3F\x1b[J")  # up over the headline, the header and the row
    assert "pending" in first and "running" in second and "\x1b" not in first + second and erased == ""


def test_profiles_go_to_files_and_a_failed_upload_is_kept_for_later(tmp_path: Path) -> None:
    profile = make_profile(
        task="mlp", device_name="cpu", device_kind="cpu", budget_bytes=8 * MiB, fixed_bytes=2 * MiB,
        bytes_per_sample=100 * 1024,
    )  # fmt: skip
    name = profile_file_name(profile)
    assert name == f"mlp-cpu-{8 * MiB}-{profile.fingerprint[:12]}.json"
    # One run over lengths or policies makes profiles of one fingerprint: each keeps a file of its own.
    at_length = profile.model_copy(update={"seq_len": 512, "activation_checkpointing": "every-2"})
    assert profile_file_name(at_length) == f"mlp-cpu-{8 * MiB}-L512-every-2-{profile.fingerprint[:12]}.json"

    with ProfileSink(server=None, token=None, output_dir=tmp_path / "out") as sink:
        stored = sink.keep(profile)
    assert stored == Stored(None, tmp_path / "out" / name, None)
    assert Profile.model_validate_json(stored.path.read_text()) == profile  # type: ignore[union-attr]

    down = f"http://127.0.0.1:{free_port()}"
    with ProfileSink(server=down, token="t", output_dir=None, unsent_dir=tmp_path / "unsent") as sink:
        stored = sink.keep(profile)
    assert stored.profile_id is None and stored.path == tmp_path / "unsent" / name
    assert stored.upload_error and "\n" not in stored.upload_error
    assert [p.name for p in (tmp_path / "unsent").iterdir()] == [name]  # whole files only, no .tmp left


class _Cluster:
    """What ``_warn_unplaceable`` asks of Ray: the cluster's resources."""

    def __init__(self, resources: dict[str, float]) -> None:
        self.resources = resources

    def cluster_resources(self) -> dict[str, float]:
        return self.resources


def test_pairs_no_node_can_take_now_are_named_at_the_start() -> None:
    pairs = _pairs(["examples/mlp.py:task"], accelerators=["H100", "L4"], device=None, budgets=[None])
    log = io.StringIO()
    _warn_unplaceable(_Cluster({"CPU": 8, "GPU": 2, "accelerator_type:L4": 1}), pairs, log)
    assert log.getvalue().count("warning") == 1 and "kind H100" in log.getvalue()
    log = io.StringIO()
    _warn_unplaceable(_Cluster({"CPU": 8}), _pairs(["examples/mlp.py:task"], device="cuda", budgets=[None]), log)
    assert "no GPU now" in log.getvalue()
    log = io.StringIO()
    _warn_unplaceable(_Cluster({"CPU": 8}), _pairs(["examples/mlp.py:task"]), log)
    assert log.getvalue() == ""
