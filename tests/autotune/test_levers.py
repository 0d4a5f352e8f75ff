"""The levers (autotune/orchestrate/levers.py): what each change of a job's setup would free at its peak and the m_max
it gives, by fake trials; the no-fit line names the cheapest change that makes the smallest micro-batch fit.

The truth for a lever's m_max is a probe of the changed setup (real trials on the CPU meter, the change made the
way a user makes it: the flag's config field, the optimizer asked for by name)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from autotune.cli import main
from autotune.cli.report import lever_lines
from autotune.core.schemas import Profile
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.estimate import estimate
from autotune.orchestrate.levers import _changes, _fake_peak, pull_levers
from autotune.orchestrate.probe import probe
from autotune.tasks.hf import hf_task
from tests.autotune._hf_configs import write_config
from tests.autotune._tasks import linear_task
from tests.factories import profile_payload

pytest.importorskip("transformers")

SEQ_LEN = 16
BUDGET = 1_000_000


@dataclasses.dataclass(frozen=True)
class Estimated:
    """What one `autotune estimate --levers` printed and stored, and the config file of its model."""

    where: Path
    code: int
    stdout: str
    stderr: str
    stored: dict[str, Any]


@pytest.fixture(scope="module")
def estimated(tmp_path_factory: pytest.TempPathFactory) -> Estimated:
    """One `autotune estimate --levers` (in this process, no lanes) at the probe's setup: both the CLI test and
    the m_max test read its levers."""
    tmp = tmp_path_factory.mktemp("levers")
    where = write_config(tmp, "llama")
    output = tmp / "estimate.json"
    argv = ["estimate", f"hf:{where}", "--device-kind", "cpu", "--budget", str(BUDGET), "--headroom", "0"]
    argv += ["--seq-len", str(SEQ_LEN), "--max-seq-len", str(SEQ_LEN), "--workers", "0", "--levers"]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([*argv, "--output", str(output)])
    stored = json.loads(output.read_text())[0] if code == 0 else {}
    return Estimated(where, code, out.getvalue(), err.getvalue(), stored)


def test_a_levers_m_max_is_a_probe_of_the_changed_setup(estimated: Estimated) -> None:
    assert estimated.code == 0, estimated.stderr[-2000:]
    task = hf_task(estimated.where).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0)
    m_max = probe(task, config).max_micro_batch
    pulled = estimated.stored["levers"]
    levers = {lever["flags"]: lever for lever in pulled}
    print(
        {flags: (lever["max_micro_batch"], lever["freed_bytes"], lever["note"][:60]) for flags, lever in levers.items()}
    )
    # The levers are pulled at the job's m_max, a probe's.
    assert {lever["at_micro_batch"] for lever in pulled} == {m_max}
    assert (
        levers["--ac full"]["max_micro_batch"]
        == probe(task, config.with_setup(activation_checkpointing="full")).max_micro_batch
    )
    eight_bit = dataclasses.replace(task, optimizer="adamw8bit")
    assert levers["--optimizer adamw8bit"]["max_micro_batch"] == probe(eight_bit, config).max_micro_batch
    # The logits hold this model's peak (a vocabulary 8 x its hidden size): the fused loss is named.
    fused = config.with_setup(lm_loss="fused-linear", presearch=False)
    assert levers["--loss fused-linear"]["max_micro_batch"] == probe(task, fused).max_micro_batch
    # A lever's peak at m_max is read off its estimate's own fake trial there: the whole peak, as a fake trial of the
    # changed setup without a budget gives it.
    full = config.with_setup(activation_checkpointing="full")
    assert levers["--ac full"]["peak_bytes"] == _fake_peak(full.applied_to(task), full, m_max, "cpu")
    # Every lever that ran frees something at m_max and so fits at least m_max; best first.
    ran = [lever for lever in pulled if lever["peak_bytes"] is not None]
    assert all(lever["freed_bytes"] is not None and lever["freed_bytes"] > 0 for lever in ran)
    assert all((lever["max_micro_batch"] or 0) >= m_max for lever in ran)
    order = [lever["max_micro_batch"] or 0 for lever in ran]
    assert order == sorted(order, reverse=True)
    assert "fake trials run the eager model" in levers["--compile"]["note"]


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_a_lever_that_cannot_compose_with_the_job_is_left_out_with_the_reason(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(8)
    config = ProbeConfig(device="cpu", budget_bytes=BUDGET, headroom=0.0, strategy="fsdp", world_size=2)
    asked = ("--optimizer adamw8bit", "--tp 2", "--ac full", "--strategy fsdp --world-size 2")
    levers = {
        lever.flags: lever for lever in pull_levers(task, config, at_micro_batch=4, only=asked, estimator=estimate)
    }
    eight_bit = levers["--optimizer adamw8bit"]
    assert eight_bit.peak_bytes is None and "bitsandbytes" in eight_bit.note and "--strategy fsdp" in eight_bit.note
    assert levers["--tp 2"].peak_bytes is None and "leaves 1" in levers["--tp 2"].note  # fsdp needs 2 shards
    assert "--strategy fsdp --world-size 2" not in levers  # already applied
    assert levers["--ac full"].max_micro_batch is not None and levers["--ac full"].max_micro_batch > 4


def test_with_nothing_to_change_the_datasheet_says_so_in_one_line() -> None:
    done = linear_task(activation_checkpointing="full", optimizer="adamw8bit", offload="activations")
    done = dataclasses.replace(done, weights_dtype="bf16", compile="default")
    assert list(_changes(done, ProbeConfig(budget_bytes=BUDGET))) == []
    profile = Profile.model_validate({**profile_payload(), "levers": []})
    (line,) = lever_lines(profile)
    assert "none: every change autotune knows is already applied" in line


def test_the_no_fit_line_names_the_cheapest_change_and_that_change_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = write_config(tmp_path, "llama")
    argv = ["probe", f"hf:{where}", "--device", "cpu", "--seq-len", str(SEQ_LEN), "--budget", "560000"]
    code = main(argv)
    stderr = capsys.readouterr().err
    errors = [line for line in stderr.splitlines() if line.startswith("autotune: error:")]
    assert code == 4 and len(errors) == 1, stderr[-2000:]
    assert "the cheapest change that fits micro-batch 1: " in errors[0]
    flags = errors[0].split("the cheapest change that fits micro-batch 1: ")[1].split(" (peak")[0].split()
    # The longest-length search capped at the length asked for: whether m = 1 fits is all this run says.
    fits = main([*argv, *flags, "--max-seq-len", str(SEQ_LEN)])
    assert fits == 0, capsys.readouterr().err[-2000:]


def test_the_cli_prints_every_lever_and_the_profile_carries_them(estimated: Estimated) -> None:
    assert estimated.code == 0, estimated.stderr[-2000:]
    stored = estimated.stored
    flags = [lever["flags"] for lever in stored["levers"]]
    for expected in (
        "--loss fused-linear",
        "--ac every-2",
        "--ac op",
        "--ac full",
        "--optimizer adamw8bit",
        "--offload activations",
    ):
        assert expected in flags and expected in estimated.stdout
    assert f"--seq-len {SEQ_LEN // 2}" in flags and "left out: a compiled step is measured" in estimated.stdout
    ran = [lever for lever in stored["levers"] if lever["peak_bytes"] is not None]
    assert [lever["max_micro_batch"] for lever in ran] == sorted(
        (lever["max_micro_batch"] for lever in ran), reverse=True
    )


def test_a_pipelines_levers_are_tried_on_its_stages_and_a_levers_m_max_is_a_probe_of_it() -> None:
    """pp 2 of the GPT example: each change's peak and m_max are its most loaded stage's (every stage's fake trials
    replaying 1F1B); --ac full's m_max against a probe of the pipeline with --ac full (real trials, every stage); the
    changes a pipeline of two ranks cannot take are left out with why."""
    from autotune.core.mesh import Mesh
    from autotune.orchestrate.config import EstimateConfig
    from examples import gpt

    mesh = Mesh(pp=2, pp_schedule="1f1b", pp_microbatches=2)
    setup = ProbeConfig(budget_bytes=4_000_000, headroom=0.0, world_size=2, mesh=mesh, levers=True)
    profile = estimate(gpt.task, EstimateConfig(probe=setup, device_kind="cpu"))
    assert profile.levers is not None and profile.pipeline is not None
    by_flags = {lever.flags: lever for lever in profile.levers}
    print({flags: (lever.max_micro_batch, lever.freed_bytes, lever.note) for flags, lever in by_flags.items()})
    full = by_flags["--ac full"]
    assert full.at_micro_batch == profile.max_micro_batch and (full.freed_bytes or 0) > 0
    probed = probe(gpt.task, ProbeConfig(**{**vars_of(setup), "activation_checkpointing": "full"}))
    assert full.max_micro_batch == probed.max_micro_batch > profile.max_micro_batch
    assert "--tp 2" not in by_flags  # two ranks hold the two stages: none left for a tp pair
    assert by_flags["--strategy fsdp --world-size 2"].note.startswith("--strategy fsdp with --world-size 2 over pp 2")
    # Each stage's blocks offload (tests/autotune/test_pipeline.py measures it against real ranks).
    offload = by_flags["--offload activations"]
    assert not offload.note and (offload.freed_bytes or 0) > 0
    assert (offload.max_micro_batch or 0) > profile.max_micro_batch


def vars_of(config: ProbeConfig) -> dict[str, Any]:
    """The fields a ProbeConfig was made with (the levers off: the probe is the truth, not another estimate)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {**fields, "levers": False, "device": "cpu"}
