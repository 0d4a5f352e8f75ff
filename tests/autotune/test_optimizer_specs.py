"""Optimizer specs (autotune/tasks/optimizers.py) and ``zero_grad`` "keep": the parser's one-line refusals, the
fingerprint (the default's unchanged, every option its own), a factory that takes the model, and each option's
m_max exact against the CPU allocator's own count (tests/autotune/_allocator_truth.py) of the model built and
stepped the ordinary way: the optimizer there is written out with torch's, bitsandbytes' or transformers' own
constructor, not the project's spec."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from autotune.cli import main
from autotune.core.errors import TaskError
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.fingerprint import task_fingerprint
from autotune.tasks.optimizers import optimizer_factory, parse_optimizer_spec
from examples.gpt import GPT, GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._hf_configs import write_config
from tests.autotune._ordinary_optimizers import ORDINARY

MiB = 1 << 20
TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=1)  # one block: a trial costs its ops


def test_the_parser_types_values_and_keeps_the_order() -> None:
    spec = parse_optimizer_spec("torch.optim.AdamW:fused=true,eps=1e-6,block_size=64,maximize=FALSE,x=none")
    assert spec.name == "torch.optim.AdamW"
    assert spec.options == (("fused", True), ("eps", 1e-6), ("block_size", 64), ("maximize", False), ("x", None))
    assert spec.text == "torch.optim.AdamW:fused=true,eps=1e-06,block_size=64,maximize=false,x=none"
    assert parse_optimizer_spec("SGD").bare_class and not parse_optimizer_spec("adamw8bit").bare_class


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--optimizer '': NAME"),
        ("AdamW:fused", "--optimizer 'AdamW:fused': option 'fused' is not key=value"),
        ("AdamW:fused=yes", "--optimizer: fused='yes': a value is true, false, none, an integer or a finite number"),
        ("AdamW:fused=true,fused=false", "option fused is given twice"),
        ("AdamW:eps=nan", "eps='nan': a value is"),
        ("Adam W", "NAME[:key=value,...]"),
    ],
)
def test_bad_specs_are_one_line_naming_the_flag_the_key_and_the_rule(text: str, message: str) -> None:
    with pytest.raises(TaskError) as caught:
        parse_optimizer_spec(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("AdamW:fusd=true", "--optimizer AdamW:fusd=true: AdamW takes no option 'fusd' (it takes lr, betas"),
        ("adamw8bit:block_size=64", "AdamW8bit takes no option 'block_size'"),
        ("NoSuchThing", "is not a torch.optim.Optimizer class"),
        ("no_such_module.Opt", "cannot import no_such_module"),
        ("SGD:momentum=-1", "SGD cannot be built with momentum=-1"),
        ("adamw4bit:block_sise=64", "AdamW4bit takes no option 'block_sise'"),
    ],
)
def test_unknown_keys_and_classes_are_refused_before_any_work(text: str, message: str) -> None:
    with pytest.raises(TaskError) as caught:
        optimizer_factory(text)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_recipes_build_what_they_say() -> None:
    from transformers.optimization import Adafactor

    params = [nn.Parameter(torch.zeros(4))]
    adafactor = optimizer_factory("adafactor")(params)
    # The HF Trainer's optim="adafactor" (transformers' trainer_optimizer._get_adafactor).
    assert type(adafactor) is Adafactor
    assert (adafactor.defaults["scale_parameter"], adafactor.defaults["relative_step"]) == (False, False)
    assert type(optimizer_factory("adamw8bit")(params)).__module__.startswith("bitsandbytes")
    assert optimizer_factory("AdamW:foreach=false", lr=0.5)(params).defaults["lr"] == 0.5


def _fingerprint(optimizer: Any = None, **changes: Any) -> str:
    return task_fingerprint(dataclasses.replace(make_task(TINY), optimizer=optimizer, **changes))


def test_the_default_keeps_its_fingerprint_and_each_option_has_its_own() -> None:
    default = _fingerprint()
    # AdamW spelled out, by spec or by a factory of the user's, is the default: the same profiles answer.
    assert _fingerprint("AdamW") == _fingerprint(lambda ps: torch.optim.AdamW(ps)) == default
    assert _fingerprint(zero_grad="none") == default
    others = [
        _fingerprint(spec)
        for spec in ("AdamW:fused=true", "AdamW:foreach=false", "adafactor", "adamw8bit", "adamw8bit:min_8bit_size=1")
    ]
    others += [
        _fingerprint("torch.optim.Adafactor"),
        _fingerprint(zero_grad="keep"),
    ]
    assert len({default, *others}) == 1 + len(others)
    task = dataclasses.replace(make_task(TINY), optimizer="adamw8bit", zero_grad="keep")
    assert (task.tags["optimizer_spec"], task.tags["zero_grad"]) == ("adamw8bit", "keep")
    # A plain factory given later drops the spec's tag.
    assert "optimizer_spec" not in dataclasses.replace(task, optimizer=None).tags


def configure_optimizers(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's way: weight decay on matrices, none on biases and norms, groups by the parameters' names."""
    decay = [p for name, p in model.named_parameters() if p.dim() >= 2 and not name.endswith("bias")]
    no_decay = [p for name, p in model.named_parameters() if p.dim() < 2 or name.endswith("bias")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}])


def test_a_factory_named_model_gets_the_model_and_one_of_params_its_parameters() -> None:
    task = dataclasses.replace(make_task(TINY), optimizer=configure_optimizers)
    model = GPT(TINY)
    optimizer = task.make_optimizer(model)
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
    with pytest.raises(TaskError, match="takes the model; it was given parameters"):
        task.make_optimizer(model.parameters())
    # A lambda of the parameters still gets them, whatever its argument is called.
    plain = dataclasses.replace(task, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert len(plain.make_optimizer(model).param_groups) == 1
    # The digest builds it on the model: the same class and options as plain AdamW.
    assert task_fingerprint(task) == _fingerprint()
    measured = probe(task, ProbeConfig(device="cpu", budget_bytes=2 * MiB, target_batch=8, presearch=False))
    assert measured.max_micro_batch >= 1


# zero_grad "keep" under one optimizer: it changes the loop, not the step.
CASES = [(spec, "none") for spec in sorted(ORDINARY)] + [("torch.optim.AdamW:foreach=false", "keep")]


@pytest.mark.parametrize(("spec", "zero_grad"), CASES)
def test_each_option_is_exact_against_the_allocator_at_m_max_and_past_it(spec: str, zero_grad: str) -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), optimizer=spec, zero_grad=zero_grad)
    budget = 2 * MiB
    config = ProbeConfig(device="cpu", budget_bytes=budget, target_batch=64)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert 2 <= m_max < 64
    limit = int(budget * (1 - config.headroom))
    ordinary = SimpleNamespace(
        model=lambda: GPT(TINY),
        batch=task.batch,
        compute_loss=task.compute_loss,
        shard_classes=None,
        make_optimizer=ORDINARY[spec],
    )
    keep = zero_grad == "keep"
    at_max, past_max = (allocator_peak_bytes(ordinary, m, set_to_none=not keep) for m in (m_max, m_max + 1))
    assert at_max <= limit < past_max
    peaks = {t.micro_batch: t.peak_bytes for t in measured.trials if not t.fake}
    assert (peaks[m_max], peaks[m_max + 1]) == (at_max, past_max)


def test_cli_writes_the_spec_and_zero_grad_into_the_hf_spec_and_refuses_bad_ones_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = f"hf:{write_config(tmp_path, 'llama')}"
    # No pre-search: the test is about the spec, the tags and the fingerprint; the pre-search's longest-length
    # search and surface took 15 s a probe here.
    common = ["--device", "cpu", "--no-throughput", "--no-presearch", "--seq-len", "16", "--budget", "4MiB"]
    common += ["--target-batch", "8"]
    assert main(["probe", spec, *common, "--json"]) == 0
    (plain,) = json.loads(capsys.readouterr().out)
    assert main(["probe", spec, *common, "--json", "--optimizer", "adamw8bit", "--zero-grad", "keep"]) == 0
    (low_bit,) = json.loads(capsys.readouterr().out)
    assert (low_bit["tags"]["optimizer_spec"], low_bit["tags"]["zero_grad"]) == ("adamw8bit", "keep")
    assert "optimizer_spec" not in plain["tags"] and low_bit["fingerprint"] != plain["fingerprint"]
    refusals = {
        "--optimizer AdamW:fusd=true": "AdamW takes no option 'fusd'",
        "--optimizer AdamW:fused": "option 'fused' is not key=value",
        "--zero-grad sometimes": "invalid choice: 'sometimes'",
    }
    for flags, message in refusals.items():
        try:
            code = main(["probe", spec, *common, *flags.split()])
        except SystemExit as exc:  # argparse's own refusal (a choice)
            code = exc.code  # type: ignore[assignment]
        assert code == 2
        err = capsys.readouterr().err
        # One line, no traceback (torch's import-time log lines may come before it).
        assert "Traceback" not in err and any(message in line for line in err.splitlines())
    assert main(["probe", "examples/mlp.py:task", "--device", "cpu", "--budget", "8MiB", "--zero-grad", "keep"]) == 2
    assert "a ProbeTask sets zero_grad= itself" in capsys.readouterr().err
