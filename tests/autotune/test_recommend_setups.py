"""The recommendation over setups (issue 33, item 10): every memory policy, optimizer option, offload and
quantization that holds the target, read from the profiles as data; measured throughput decides where the
profiles were timed, the stated ordering where they were not; `autotune recommend` over --output files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.plan import plan
from autotune.core.recommend import DIMENSIONS, options_for, recommend, setup_of
from autotune.core.schemas import Profile
from autotune.orchestrate.probe import ProbeConfig, probe
from examples.gpt import GPTConfig, make_task
from tests.factories import make_profile

TARGET = 96


def _profile(m_max: int, *, policy: str = "none", seed: int = 0, **tags: str) -> Profile:
    return make_profile(max_micro_batch=m_max, seed=seed, tags=dict(tags), bytes_per_sample=2**30).model_copy(
        update={"plan": plan(m_max, TARGET), "activation_checkpointing": policy}
    )


def test_every_dimension_is_read_from_the_profile_and_a_new_tag_is_one_too() -> None:
    profile = _profile(8, policy="op", offload="activations", optimizer_spec="adamw8bit", quantize="nf4", mine="x")
    setup = dict(setup_of(profile))
    assert setup == {
        "offload": "activations", "ac": "op", "loss": "plain", "quantize": "nf4", "optimizer": "adamw8bit",
        "zero_grad": "none", "precision": "bf16", "strategy": "ddp x1", "mesh": "none", "mine": "x",
    }  # fmt: skip
    assert [d.name for d in DIMENSIONS][:5] == ["offload", "ac", "loss", "quantize", "optimizer"]


def test_the_loss_is_a_setup_and_a_chunked_loss_recomputes() -> None:
    # --loss: the plain loss's m_max 12 takes 8 steps for T = 96, the fused one's 32 three; as many steps, TRL's
    # chunks (made again in the backward) come after Liger's fused form.
    plain = _profile(12, seed=1)
    fused = _profile(32, seed=2, lm_loss="fused-linear")
    chunked = _profile(32, seed=3, lm_loss="chunked:256")
    options = options_for([plain, chunked, fused])
    assert [o.label for o in options] == ["loss plain", "loss chunked:256", "loss fused-linear"]
    assert recommend(options, "throughput").label == "loss fused-linear"
    assert recommend(options_for([plain, chunked]), "memory").label == "loss chunked:256"


def test_without_timings_the_stated_ordering_decides() -> None:
    # The fewest steps first: 8-bit Adam's m_max 32 holds T = 96 in 3 steps, the default's 12 in 8.
    default = _profile(12, seed=1)
    eight_bit = _profile(32, seed=2, optimizer_spec="adamw8bit")
    options = options_for([default, eight_bit])
    assert [o.label for o in options] == ["optimizer default", "optimizer adamw8bit"]
    assert recommend(options, "throughput").label == "optimizer adamw8bit"
    # As many steps: the least extra work, offload before recomputation before the optimizer.
    offloaded = _profile(32, seed=3, offload="activations")
    recomputed = _profile(32, seed=4, policy="every-2")
    options = options_for([offloaded, recomputed, eight_bit])
    best = recommend(options, "throughput")
    assert best.label is not None and "optimizer adamw8bit" in best.label
    assert recommend(options_for([offloaded, recomputed]), "throughput").policy == "every-2"
    # Only the policy differs: labelled by it, as the probe's --ac line always was.
    assert [o.label for o in options_for([default, _profile(12, seed=5, policy="full")])] == [None, None]


def test_the_compilers_memory_budget_is_chosen_among_like_any_policy() -> None:
    """issue 35, item 4: one profile per --ac budget:R of a compiled job; the recommendation chooses R by the
    same rules, the fewest steps first, then the least recomputation (a larger R recomputes less)."""
    # budget:1 (the min-cut's default) holds 12 per micro-batch (8 steps for T = 96), budget:0.5 32 (3 steps),
    # budget:0 48 (2 steps): the fewest steps.
    keep_all = _profile(12, seed=1, policy="budget:1")
    half = _profile(32, seed=2, policy="budget:0.5")
    assert recommend(options_for([keep_all, half, _profile(48, seed=3, policy="budget:0")])).policy == "budget:0"
    # budget:0 at 40 needs 3 steps too (32 x 3): then the least recomputation, R = 0.5.
    assert recommend(options_for([keep_all, half, _profile(40, seed=3, policy="budget:0")])).policy == "budget:0.5"
    # As many steps: the larger R wins, it recomputes less.
    also_half = _profile(32, seed=4, policy="budget:0.75")
    assert recommend(options_for([half, also_half]), "throughput").policy == "budget:0.75"
    # Against block-level policies: a ratio sorts by how much it may recompute.
    assert recommend(options_for([_profile(32, seed=5, policy="full"), half]), "throughput").policy == "budget:0.5"


def test_an_option_that_misses_the_target_is_passed_over() -> None:
    held = _profile(12, seed=1)
    # m_max 40 with multiple_of 40 reaches 80 or 120, never 96.
    missed = make_profile(
        max_micro_batch=40, seed=2, multiple_of=40, tags={"offload": "activations"}, bytes_per_sample=2**30
    )
    missed = missed.model_copy(update={"plan": plan(40, TARGET, multiple_of=40)})
    assert missed.plan is not None and not missed.plan.exact
    options = options_for([held, missed])
    assert recommend(options, "memory").label == "offload none"
    assert "does not reach the target" in options[1].text()


def test_measured_throughput_decides_between_optimizer_options_on_the_device(tmp_path: Path) -> None:
    """Two optimizer options of one job probed and timed on this machine's CPU: the recommendation is the one
    whose plan was timed fastest."""
    task = make_task(GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2), name="gpt-tiny")
    config = ProbeConfig(device="cpu", budget_bytes=8 << 20, target_batch=64, max_micro_batch=64, throughput=True)
    profiles = [
        probe(dataclasses.replace(task, optimizer=spec), config)
        for spec in ("torch.optim.AdamW", "torch.optim.AdamW:foreach=false")
    ]
    options = options_for(profiles)
    assert all(o.samples_per_second is not None for o in options)
    best = recommend(options, "throughput")
    assert best.samples_per_second == max(o.samples_per_second or 0 for o in options)
    assert {o.label for o in options} == {"optimizer default", "optimizer torch.optim.AdamW:foreach=false"}
    # The same through the CLI, from the probes' files.
    paths = []
    for index, profile in enumerate(profiles):
        paths.append(tmp_path / f"{index}.json")
        paths[-1].write_text(profile.model_dump_json())
    assert main(["recommend", *map(str, paths)]) == 0


def test_the_command_prints_the_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(_profile(12, seed=1).model_dump_json())
    b.write_text(json.dumps([json.loads(_profile(32, seed=2, optimizer_spec="adamw8bit").model_dump_json())]))
    assert main(["recommend", str(a), str(b), "--objective", "memory"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recommended: optimizer adamw8bit: m_max 32, update 3x32 (3 steps), not timed")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read it"),
        ("{", "not JSON"),
        ('{"task": "x"}', "not a profile"),
    ],
)
def test_bad_files_are_one_line_and_exit_2(
    content: str | None, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    assert main(["recommend", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_profiles_of_different_devices_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(_profile(12, seed=1).model_dump_json())
    other = _profile(12, seed=2).model_copy(
        update={"device": _profile(12).device.model_copy(update={"name": "NVIDIA H100 80GB HBM3"})}
    )
    b.write_text(other.model_dump_json())
    assert main(["recommend", str(a), str(b)]) == 2
    assert "different devices" in capsys.readouterr().err


def test_profiles_of_two_meshes_or_strategies_are_two_setups() -> None:
    # Issue 40: recommend told neither the mesh nor the strategy apart.
    plain = _profile(12, seed=1)
    meshed = _profile(24, seed=2).model_copy(update={"mesh": {"tp": 2}, "world_size": 2})
    sharded = _profile(16, seed=3).model_copy(update={"strategy": "fsdp", "world_size": 2})
    labels = [o.label for o in options_for([plain, meshed, sharded])]
    assert labels == ["strategy ddp x1, mesh none", "strategy ddp x2, mesh tp=2", "strategy fsdp x2, mesh none"]
