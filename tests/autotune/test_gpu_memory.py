"""`autotune estimate --gpu NAME --gpu-memory BYTES` (issue 33, item 6): a card the catalog lacks, or a catalog
card with other memory, takes the closest catalog card's architecture and the memory given; the datasheet
says which card it assumed; a budget above the memory is refused; bad input is one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.errors import AutotuneError
from autotune.core.schemas import Profile
from autotune.orchestrate.config import EstimateConfig

GiB = 1 << 30
MiB = 1 << 20
GPT = "examples/gpt.py:task"


def test_an_unlisted_card_takes_the_closest_architecture_and_the_memory_given() -> None:
    config = EstimateConfig.of(gpu="NVIDIA H100 NVL 96GB", gpu_memory=96 * GiB)
    card = config.card
    assert card is not None
    assert card.memory_bytes == 96 * GiB and card.device_total_bytes == 96 * GiB
    assert card.compute_capability == (9, 0) and card.assumed_from in ("h100-nvl", "h100-96gb")
    # The card fills the budget and the name, as a catalog card does.
    assert config.probe.budget_bytes == 96 * GiB
    assert config.device_name == "NVIDIA H100 NVL 96GB"


def test_a_catalog_cards_own_memory_names_the_catalog_card() -> None:
    config = EstimateConfig.of(gpu="h100", gpu_memory=81559 * MiB)
    assert config.card is not None and config.card.short_name == "h100" and config.card.assumed_from is None


def test_a_catalog_card_with_other_memory_is_not_the_catalog_card() -> None:
    config = EstimateConfig.of(gpu="h100", gpu_memory=96 * GiB)
    assert config.card is not None
    # The H100 family's member nearest in memory lends the architecture.
    assert config.card.assumed_from == "h100-96gb" and config.card.device_total_bytes == 96 * GiB
    assert config.card.nvml_name == "NVIDIA H100 80GB HBM3 with 96 GiB"


def test_gpu_memory_without_gpu_is_refused_in_the_config() -> None:
    with pytest.raises(AutotuneError, match="--gpu-memory is the memory of the card --gpu names"):
        EstimateConfig.of(gpu_memory=96 * GiB, budget_bytes=GiB)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        # A budget above the card's memory (what the job may hold of it) is refused before any work.
        (
            ["--gpu", "H100 96GB", "--gpu-memory", "96GiB", "--budget", "97GiB"],
            "--budget 97.00 GiB (104152956928 bytes) is above the h100-96gb-98304mib's memory, 96.00 GiB",
        ),
        (["--gpu-memory", "96GiB", "--budget", "8GiB"], "--gpu-memory 96.00 GiB is the memory of the card --gpu"),
        (["--gpu", "Radeon MI300X", "--gpu-memory", "192GiB"], "no catalog family in its name"),
        (["--gpu", "h100", "--gpu-memory", "lots"], "--gpu-memory: "),
        # More than any card of the architecture ships (issue 40): no card to emulate, and no name to store under.
        (["--gpu", "h100", "--gpu-memory", "1TiB"], "no card of its architecture (compute capability 9.0"),
        (["--gpu", "h100", "--gpu-memory", "1PiB"], "with 1.00 PiB: no card of its architecture"),
        # Less than any device of the architecture presents (issue 62: 1KiB ran 9 s before "nothing fits"); the
        # smallest Hopper device is a MIG slice of an H100.
        (
            ["--gpu", "h100", "--gpu-memory", "1KiB"],
            "--gpu 'h100' --gpu-memory 1.00 KiB: card 'h100' with 1.00 KiB: no device of its architecture (compute "
            "capability 9.0, like the h100) has less than 9 GiB (the smallest: H100 MIG 1g.10gb, 10 GB)",
        ),
        (["--gpu", "l4", "--gpu-memory", "4GiB"], "has less than 5 GiB (the smallest: GeForce RTX 4050 Laptop"),
        # --estimate-bound bounds an estimate for a card: without one it is refused as --gpu-memory is.
        (
            ["--estimate-bound", "tight", "--device-kind", "cpu", "--budget", "8GiB"],
            "--estimate-bound tight bounds what an estimate for a card does not model: give --gpu NAME",
        ),
    ],
)
def test_bad_gpu_memory_input_is_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out = tmp_path / "p.json"
    try:
        code = main(["estimate", GPT, *args, "--output", str(out)])
    except SystemExit as exc:  # argparse's own refusals (a size that is none)
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_a_mig_slice_is_a_card_of_its_architecture() -> None:
    """The least memory a device of an architecture presents is its smallest MIG instance where it has MIG: an
    H100's 1g.10gb slice (9.75 GiB as NVML lists it) is a card an estimate can be for, as is an A100's 1g.5gb."""
    config = EstimateConfig.of(gpu="h100", gpu_memory=9984 * MiB)
    assert config.card is not None and config.card.compute_capability == (9, 0)
    config = EstimateConfig.of(gpu="a100-40gb", gpu_memory=4864 * MiB)
    assert config.card is not None and config.card.compute_capability == (8, 0)


def test_an_estimate_for_an_unlisted_card_says_what_it_assumed(cuda_python: str, tmp_path: Path) -> None:
    """On an emulated card of the memory given, the datasheet names the card as given and the catalog card
    whose architecture it took."""
    out = tmp_path / "p.json"
    code = main(
        ["estimate", GPT, "--gpu", "RTX 4090 D", "--gpu-memory", "24GiB", "--budget", "2GiB",
         "--max-micro-batch", "8", "--output", str(out)]
    )  # fmt: skip
    assert code == 0
    profile = Profile.model_validate(json.loads(out.read_text()))
    assert profile.device.name == "RTX 4090 D" and profile.device.compute_capability == "8.9"
    (said,) = [w for w in profile.warnings if w.startswith("RTX 4090 D is not in the catalog")]
    # The step time says what it lacks of such a card, in one line of its own (issue 65).
    (no_time,) = [w for w in profile.warnings if w.startswith("no predicted step time:")]
    assert "--peak-tflops" in no_time
    assert "the catalog's rtx-4090" in said and "24576 MiB as given" in said
