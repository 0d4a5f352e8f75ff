"""`--estimate-bound safe|tight`: the stated bound of what an emulated card's figure does not model (NCCL's own
buffers), from NCCL's constants written out by hand here, and what it does to an estimate: every trial's
figure exactly the bound above the tight one, the answer never larger, and the datasheet naming both.

The emulated estimates need a CUDA build of torch (``make .venv-cuda``, which ``make test`` builds); without
one they skip, saying so, except under CI=true.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.cli import main
from autotune.core.cards import lookup
from autotune.core.mesh import Mesh
from autotune.core.schemas import Profile
from autotune.core.unmodelled import unmodelled_bound

MiB = 1 << 20
# One connection's FIFOs at NCCL's defaults (src/init.cc, src/include/device.h): LL is 8 lines per thread x 512
# threads x 8 steps x a 16-byte line; LL128 120 elements x 640 threads x 8 steps x 8 bytes; Simple 4 MiB.
LL, LL128, SIMPLE = 8 * 512 * 8 * 16, 120 * 640 * 8 * 8, 4 * MiB
CONNECTION = 524_288 + 4_915_200 + 4_194_304
# 64 channels (MAXCHANNELS), two connections each.
COMMUNICATOR = 64 * 2 * CONNECTION
# NVLS on sm_90: 16 channels x 2 x (128 KiB chunks x 8 steps) x 8 heads, unicast and multicast.
NVLS_8 = 16 * 2 * 128 * 1024 * 8 * 8 * 2


def test_one_communicator_is_nccls_fifos_over_every_channel() -> None:
    assert (LL, LL128, SIMPLE) == (524_288, 4_915_200, 4_194_304)
    assert unmodelled_bound(lookup("a100-80gb"), 8, Mesh(), {}).bytes == COMMUNICATOR == 1_233_125_376
    # NVLink SHARP behind an NVSwitch, on sm_90 and up: 512 MiB more over eight H100s.
    h100 = unmodelled_bound(lookup("h100"), 8, Mesh(), {})
    assert [p.bytes for p in h100.parts] == [COMMUNICATOR, NVLS_8] and NVLS_8 == 512 * MiB
    # Heads are the communicator's ranks on a node, at most 8: two ranks, two heads.
    assert unmodelled_bound(lookup("h100"), 2, Mesh(), {}).parts[1].bytes == NVLS_8 // 4


def test_one_rank_has_nothing_to_bound() -> None:
    assert unmodelled_bound(lookup("h100"), 1, Mesh(), {}).parts == ()


@pytest.mark.parametrize("card", ["h100-pcie", "h100-nvl", "a100-80gb", "l4", "t4"])
def test_no_nvls_without_a_switch_or_before_sm_90(card: str) -> None:
    assert [p.name for p in unmodelled_bound(lookup(card), 4, Mesh(), {}).parts] == ["NCCL buffers"]


def test_the_jobs_nccl_settings_move_the_bound() -> None:
    h100 = lookup("h100")
    env = {"NCCL_BUFFSIZE": str(1 * MiB), "NCCL_MAX_NCHANNELS": "16", "NCCL_NVLS_ENABLE": "0"}
    assert unmodelled_bound(h100, 8, Mesh(), env).bytes == 16 * 2 * (LL + LL128 + MiB)
    # NCCL's older name for the channel cap; a value it cannot parse leaves its default.
    assert unmodelled_bound(h100, 8, Mesh(), {"NCCL_MAX_NRINGS": "4", "NCCL_NVLS_ENABLE": "0"}).bytes == (
        4 * 2 * CONNECTION
    )
    assert unmodelled_bound(h100, 8, Mesh(), {"NCCL_BUFFSIZE": "lots"}).bytes == COMMUNICATOR + NVLS_8
    # More channels than MAXCHANNELS are not made.
    assert unmodelled_bound(lookup("a100-80gb"), 8, Mesh(), {"NCCL_MAX_NCHANNELS": "256"}).bytes == COMMUNICATOR


def test_each_parallel_dimension_is_a_communicator_and_a_pipeline_talks_to_its_neighbours() -> None:
    a100 = lookup("a100-80gb")
    # 16 ranks, tp 2: data parallel over 8 and tensor parallel over 2, two communicators.
    assert unmodelled_bound(a100, 16, Mesh(tp=2), {}).bytes == 2 * COMMUNICATOR
    # tp 2 over 2 ranks: no data parallelism, one communicator.
    assert unmodelled_bound(a100, 2, Mesh(tp=2), {}).bytes == COMMUNICATOR
    # pp 2 over 2 ranks: one send/receive pair; pp 4: a pair with each neighbour.
    assert unmodelled_bound(a100, 2, Mesh(pp=2), {}).bytes == COMMUNICATOR
    assert unmodelled_bound(a100, 4, Mesh(pp=4), {}).bytes == 2 * COMMUNICATOR
    assert unmodelled_bound(a100, 8, Mesh(pp=2, cp=2), {}).bytes == 3 * COMMUNICATOR


@pytest.fixture(scope="module")
def bounded(cuda_python: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Profile]:
    """The tiny Llama, FSDP over 8 on an emulated H100 at 3 GiB: the same sizes under each bound."""
    folder = tmp_path_factory.mktemp("bound")
    profiles = {}
    for bound in ("safe", "tight"):
        out = folder / f"{bound}.json"
        argv = ["estimate", "hf:examples/configs/tiny-llama.json", "--gpu", "h100", "--budget", "3GiB"]
        argv += ["--strategy", "fsdp", "--world-size", "8", "--precision", "bf16", "--seq-len", "32"]
        argv += ["--max-micro-batch", "4", "--micro-batches", "1,2,4", "--estimate-bound", bound, "--output", str(out)]
        assert main(argv) == 0
        raw = json.loads(Path(out).read_text())
        profiles[bound] = Profile.model_validate(raw[0] if isinstance(raw, list) else raw)
    return profiles


def test_the_safe_figure_is_the_tight_one_plus_the_bound(bounded: dict[str, Profile]) -> None:
    bound = COMMUNICATOR + NVLS_8
    safe = {t.micro_batch: t for t in bounded["safe"].trials}
    tight = {t.micro_batch: t for t in bounded["tight"].trials}
    assert set(safe) == set(tight) >= {1, 2, 4}
    for m, trial in tight.items():
        assert safe[m].peak_bytes - trial.peak_bytes == bound, m
        assert safe[m].allocated_bytes == trial.allocated_bytes
        assert safe[m].outside_allocator_bytes == (trial.outside_allocator_bytes or 0) + bound
    assert bounded["safe"].max_micro_batch <= bounded["tight"].max_micro_batch


def test_the_datasheet_says_which_bound_it_took(bounded: dict[str, Profile]) -> None:
    safe = [w for w in bounded["safe"].warnings if w.startswith("safe bound:")]
    assert len(safe) == 1 and "NCCL buffers 1.15 GiB" in safe[0] and "NCCL NVLS buffers 512.00 MiB" in safe[0]
    tight = [w for w in bounded["tight"].warnings if w.startswith("tight")]
    assert len(tight) == 1 and "1.65 GiB" in tight[0]


def test_a_bound_that_leaves_nothing_is_one_line(cuda_python: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "hf:examples/configs/tiny-llama.json", "--gpu", "h100", "--budget", "2GiB", "--seq-len"]
    argv += ["32", "--strategy", "fsdp", "--world-size", "8", "--max-micro-batch", "2"]
    assert main(argv) != 0
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("autotune: error: ") and "safe bound's 1.65 GiB for NCCL's buffers" in lines[-1]
    with pytest.raises(SystemExit) as exited:  # argparse's refusal: one line, exit 2
        main([*argv, "--estimate-bound", "loose"])
    assert exited.value.code == 2
    refused = capsys.readouterr().err.strip().splitlines()
    assert len(refused) == 1 and "--estimate-bound: invalid choice: 'loose'" in refused[0]


def test_a_cards_figure_is_broken_down_to_the_byte(bounded: dict[str, Profile]) -> None:
    """The breakdown on a card: the live tensors' parts, the allocator's reserve beyond them and the memory outside
    the allocator sum to the trial's figure; the safe bound is in the part outside the allocator, nothing else
    moves; under fsdp the gathered parameters are the mesh's part."""
    safe, tight = bounded["safe"], bounded["tight"]
    assert safe.breakdown is not None and tight.breakdown is not None
    for profile in (safe, tight):
        trials = {t.micro_batch: t for t in profile.trials}
        assert profile.breakdown is not None
        for breakdown in profile.breakdown:
            trial = trials[breakdown.micro_batch]
            assert breakdown.peak_bytes == trial.peak_bytes == sum(breakdown.parts.values())
            assert breakdown.parts["outside_allocator"] == trial.outside_allocator_bytes
            assert breakdown.parts["allocator_reserve"] > 0 and breakdown.parts["collectives"] > 0
    by_size = {b.micro_batch: b for b in tight.breakdown}
    for breakdown in safe.breakdown:
        other = by_size[breakdown.micro_batch]
        moved = {p for p in breakdown.parts if breakdown.parts[p] != other.parts.get(p)}
        assert moved == {"outside_allocator"}
        assert breakdown.parts["outside_allocator"] - other.parts["outside_allocator"] == COMMUNICATOR + NVLS_8
