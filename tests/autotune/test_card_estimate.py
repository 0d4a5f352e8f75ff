"""`autotune estimate --gpu`: the GPT example on an emulated H200 against the real H200's figures
(../shared/gpu-runs/2026-11-30-h200-gpu_check.log: `autotune probe examples/gpt.py:task --budget 2GiB`,
torch 2.11 + CUDA 13.0), the allocator's staircase, and the one-line refusals.

The emulated runs need a CUDA build of torch (``make .venv-cuda``, which ``make test`` builds); without one
they skip, saying so, except under CI=true, where the suite installs it and a skip would hide a failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.schemas import Profile
from autotune.emulation import CudaTorchMissing, find_cuda_python

MiB = 1 << 20
GiB = 1 << 30
GPT = "examples/gpt.py:task"
# The real H200 (2026-11-30), budget 2 GiB, headroom 10 % (limit 1.80 GiB): reserved + outside per size, as
# the log prints them in percent of the limit (0.1 % = 1.8 MiB, finer than its GiB column), in the order the
# card's search ran them; m = 1 and 2 as its MiB column prints them.
LIMIT_BYTES = int(2 * GiB * 0.9)
CARD_PERCENT_OF_LIMIT = {
    1: 43.9, 2: 44.1, 414: 63.4, 1195: 99.6, 1203: 99.6, 1926: 122.2, 1564: 113.7, 1383: 107.5, 1293: 103.6,
    1248: 100.6, 1225: 101.5, 1214: 100.7, 1208: 99.6, 1211: 99.6, 1212: 99.6, 1213: 100.7,
}
CARD_M_MAX = 1212
# The card's process had loaded fewer kernel modules at its first trials (m = 1, 2, 414) than from m = 1195
# on (autotune/core/cards.py: 742 MiB outside the allocator at m = 1, 876 from 1195): those sizes are compared
# by verdict only. At 1926 the card's allocator ran into the probe's memory cap and freed its cache: left out.
STEADY = [m for m in CARD_PERCENT_OF_LIMIT if 1195 <= m <= 1564]
SIZES = ",".join(str(m) for m in sorted(CARD_PERCENT_OF_LIMIT) if m != 1926)


@pytest.fixture(scope="module")
def h200_estimate(cuda_python: str, tmp_path_factory: pytest.TempPathFactory) -> Profile:
    out = tmp_path_factory.mktemp("card") / "h200.json"
    code = main(
        ["estimate", GPT, "--gpu", "h200", "--budget", "2GiB", "--target-batch", "512", "--micro-batches", SIZES,
         "--output", str(out)]
    )
    assert code == 0
    return Profile.model_validate(json.loads(out.read_text()))


def test_the_estimate_is_labelled_as_the_emulated_card(h200_estimate: Profile) -> None:
    profile = h200_estimate
    assert profile.source == "estimate"
    assert profile.device.kind == "cuda" and profile.device.name == "NVIDIA H200"
    assert profile.device.compute_capability == "9.0"
    assert profile.device.torch_version and "+cu" in profile.device.torch_version
    assert any("emulated NVIDIA H200 (compute capability 9.0) with CUDA semantics" in w for w in profile.warnings)
    # Every trial is fake, and says how its figure splits: allocated (under reserved) and outside.
    assert all(t.fake for t in profile.trials)
    for trial in profile.trials:
        if not trial.oom:
            assert trial.allocated_bytes is not None and trial.outside_allocator_bytes is not None
            assert trial.allocated_bytes + trial.outside_allocator_bytes <= trial.peak_bytes


def test_the_figures_against_the_real_h200(h200_estimate: Profile) -> None:
    """Every size the card measured gets the card's verdict (fits or over the limit), and from m = 1195 on
    the card's figure within 0.2 % of the limit, except m = 1248: there the grad-Q accumulator of the
    mem-efficient attention's backward (81,868,800 bytes; kernel_backward.h) is 78 KiB larger than the
    largest cached block (78 MiB, the logits' size) and the model adds an 80 MiB segment the card did not show
    (+4.3 %; both over the limit)."""
    figures = {t.micro_batch: t for t in h200_estimate.trials}
    errors = {}
    for m, percent in CARD_PERCENT_OF_LIMIT.items():
        if m == 1926:
            continue
        card_fits = percent <= 100.0
        assert figures[m].fits == card_fits, (m, figures[m].peak_bytes / LIMIT_BYTES)
        errors[m] = 100 * figures[m].peak_bytes / LIMIT_BYTES - percent
    print({m: f"{e:+.1f} % of the limit" for m, e in errors.items()}, "m_max", h200_estimate.max_micro_batch)
    for m in STEADY:
        if m != 1248:
            assert abs(errors[m]) <= 0.2, (m, errors[m])
    assert 0 < errors[1248] <= 4.5


def test_the_card_boundary_and_the_first_step_over_the_limit(h200_estimate: Profile) -> None:
    """The card's search stopped at 1212 (fits) and 1213 (over): the estimate agrees at both. Its own search
    met the staircase lower (a size between 1129 and 1194 over the limit, which the card never tried), so
    it answers the largest size below that one and says the figure is not monotone."""
    figures = {t.micro_batch: t for t in h200_estimate.trials}
    assert figures[CARD_M_MAX].fits and not figures[CARD_M_MAX + 1].fits
    assert h200_estimate.non_monotone
    failed = min(t.micro_batch for t in h200_estimate.trials if not t.fits)
    assert h200_estimate.max_micro_batch == failed - 1
    assert 0.9 * CARD_M_MAX <= h200_estimate.max_micro_batch <= CARD_M_MAX
    assert any("not monotone in m" in w for w in h200_estimate.warnings)


def test_the_caching_allocators_staircase_is_in_the_figure(h200_estimate: Profile) -> None:
    """On the card, m = 1195 ... 1212 all read 1.79 GiB (one segment count), and 1213 needs one 20 MiB
    segment more: the replay shows the same step at the same place."""
    figures = {t.micro_batch: t.peak_bytes for t in h200_estimate.trials}
    assert figures[1195] == figures[1212]
    assert figures[1213] - figures[1212] == 20 * MiB
    # m = 1 and 2 share one figure too (the first segments hold both), as on the card (810 and 812 MiB).
    assert abs(figures[2] - figures[1]) <= 2 * MiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpu", "v100"], "--gpu: unknown card 'v100': known cards are h100, h100-pcie, h200"),
        (["--gpu", "h100", "--device-kind", "cpu"], "--gpu h100 names a CUDA card: it cannot go with --device-kind"),
        (["--gpu", "l4", "--context-bytes", "30GiB"], "--context-bytes must be at least 0 and below the l4's memory"),
        (["--context-bytes", "1GiB", "--budget", "8GiB"], "--context-bytes applies to an estimate for a card"),
        (["--gpu", "h100", "--micro-batches", "1,0"], "micro-batch size '0' must be a positive integer"),
    ],
)
def test_bad_card_options_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["estimate", GPT, *args])
    except SystemExit as exc:  # argparse's own refusals (a size that is no positive integer)
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_mixture_of_experts_estimates_on_an_emulated_card(
    cuda_python: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Routing runs on CUDA's paths too (Mixtral counts its experts with an int32 histc there, a kernel the
    CPU lacks, and its fp32 experts take _grouped_mm's fallback), under the run's load factor."""
    config = {
        "model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": 256, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 128,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(
        ["estimate", f"hf:{tmp_path}", "--gpu", "h100", "--seq-len", "64", "--max-seq-len", "64",
         "--max-micro-batch", "8", "--moe-load-factor", "1.5", "--json"]
    )
    assert code == 0, capsys.readouterr().err[-2000:]
    (profile,) = json.loads(capsys.readouterr().out)
    assert profile["moe_load_factor"] == 1.5 and profile["device"]["name"] == "NVIDIA H100 80GB HBM3"
    assert profile["max_micro_batch"] == 8  # the cap: a tiny model fits the card many times over


def test_lengths_on_an_emulated_card_run_in_one_child(
    cuda_python: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--gpu with --seq-len: every length's search in one child process, each starting from the last
    one's answer scaled by the lengths."""
    import autotune.emulation.runner as runner

    children: list[str] = []
    real_run_child = runner._run_child

    def counted(*args: object, **kwargs: object) -> object:
        children.append(str(kwargs.get("what")))
        return real_run_child(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(runner, "_run_child", counted)
    code = main(
        ["estimate", "examples/gpt.py:task_seq", "--gpu", "h200", "--budget", "2GiB", "--seq-len", "256,512",
         "--max-seq-len", "512", "--precision", "bf16", "--json"]
    )
    assert code == 0
    profiles = [Profile.model_validate(p) for p in json.loads(capsys.readouterr().out)]
    assert [p.seq_len for p in profiles] == [256, 512]
    assert len(children) == 1
    assert profiles[0].max_micro_batch > profiles[1].max_micro_batch >= 1
    assert all(p.device.name == "NVIDIA H200" and p.source == "estimate" for p in profiles)
    # The child ran the precision asked for, not the task's own (fp32).
    assert all(p.precision == "bf16" for p in profiles)


@pytest.mark.parametrize("cause", ["no CUDA build", "uncovered entry point"])
def test_a_card_that_cannot_be_emulated_falls_back_to_cpu_semantics_and_says_why(
    cause: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import autotune.emulation.runner as runner
    from autotune.emulation import EmulationError

    if cause == "no CUDA build":
        def missing() -> str:
            raise CudaTorchMissing("no Python with a CUDA build of torch here: make .venv-cuda")

        monkeypatch.setattr(runner, "find_cuda_python", missing)
        said = "no Python with a CUDA build of torch here"
    else:
        try:
            find_cuda_python()
        except CudaTorchMissing as exc:
            if os.environ.get("CI") == "true":
                raise AssertionError(f"CI builds .venv-cuda (make test): {exc}") from None
            pytest.skip(str(exc))

        def uncovered(*args: object, **kwargs: object) -> object:
            raise EmulationError("the search on an emulated h200 failed (fakecuda: cudaGraphLaunch is not emulated)")

        monkeypatch.setattr(runner, "_run_child", uncovered)
        said = "cudaGraphLaunch is not emulated"
    out = tmp_path / "p.json"
    code = main(["estimate", GPT, "--gpu", "h200", "--budget", "2GiB", "--max-micro-batch", "8", "--output", str(out)])
    assert code == 0, capsys.readouterr().err[-2000:]
    profile = Profile.model_validate(json.loads(out.read_text()))
    assert profile.device.name == "NVIDIA H200" and profile.source == "estimate"
    (warning,) = [w for w in profile.warnings if "could not be emulated here" in w]
    assert said in warning and "estimated with CPU semantics" in warning
    assert "Traceback" not in capsys.readouterr().err


def test_what_no_rule_gives_is_said(h200_estimate: Profile, cuda_python: str, tmp_path: Path) -> None:
    """Convolutions take cuDNN workspaces that cuDNN's heuristics size per shape: the figure gives them a stated
    bound, and an estimate that ran one says so (the GPT example runs none)."""
    assert not any("cuDNN convolution workspaces" in w for w in h200_estimate.warnings)
    out = tmp_path / "cnn.json"
    code = main(["estimate", "examples/cnn.py:task", "--gpu", "h200", "--budget", "2GiB", "--max-micro-batch", "8",
                 "--output", str(out)])  # fmt: skip
    assert code == 0
    profile = Profile.model_validate(json.loads(out.read_text()))
    (warning,) = [w for w in profile.warnings if "cuDNN convolution workspaces" in w]
    assert "a stated bound" in warning
