"""The card catalog: names, figures and what is known of the memory outside the allocator; `autotune gpus`."""

from __future__ import annotations

import doctest
import json

import pytest

from autotune.cli import gpus
from autotune.cli.common import CliError, Parser
from autotune.core import cards
from autotune.core.cards import (
    ALIASES,
    ARCHITECTURES,
    CARDS,
    OUTSIDE_ALLOCATOR,
    closest_card,
    known_names,
    lookup,
    outside_allocator,
    outside_allocator_stand_in,
    resolve_card,
    unlisted_card,
)

MiB = 1 << 20
GiB = 1 << 30
REQUIRED = (
    "v100-16gb", "v100-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "a100-40gb", "a100-80gb", "a100-pcie-40gb",
    "a100-pcie-80gb", "a10g", "l4", "l40s", "rtx-3090", "rtx-4090", "h100", "h100-pcie", "h100-nvl", "h100-96gb",
    "h200", "gh200", "b200",
)  # fmt: skip

# Each card's figures as written from its data sheet and the public nvidia-smi listings, by hand: (NVML name,
# NVML MiB, compute capability, SMs). A change to an entry fails here, where the source line can be re-read.
EXPECTED = {
    "v100-16gb": ("Tesla V100-SXM2-16GB", 16384, (7, 0), 80),
    "v100-32gb": ("Tesla V100-SXM2-32GB", 32768, (7, 0), 80),
    "v100-pcie-16gb": ("Tesla V100-PCIE-16GB", 16384, (7, 0), 80),
    "v100-pcie-32gb": ("Tesla V100-PCIE-32GB", 32768, (7, 0), 80),
    "t4": ("Tesla T4", 15360, (7, 5), 40),
    "a100-40gb": ("NVIDIA A100-SXM4-40GB", 40960, (8, 0), 108),
    "a100-80gb": ("NVIDIA A100-SXM4-80GB", 81920, (8, 0), 108),
    "a100-pcie-40gb": ("NVIDIA A100-PCIE-40GB", 40960, (8, 0), 108),
    "a100-pcie-80gb": ("NVIDIA A100 80GB PCIe", 81920, (8, 0), 108),
    "a10g": ("NVIDIA A10G", 23028, (8, 6), 80),
    "rtx-3090": ("NVIDIA GeForce RTX 3090", 24576, (8, 6), 82),
    "l4": ("NVIDIA L4", 23034, (8, 9), 58),
    "l40s": ("NVIDIA L40S", 46068, (8, 9), 142),
    "rtx-4090": ("NVIDIA GeForce RTX 4090", 24564, (8, 9), 128),
    "h100": ("NVIDIA H100 80GB HBM3", 81559, (9, 0), 132),
    "h100-pcie": ("NVIDIA H100 PCIe", 81559, (9, 0), 114),
    "h100-nvl": ("NVIDIA H100 NVL", 95830, (9, 0), 132),
    "h100-96gb": ("NVIDIA H100 96GB", 97871, (9, 0), 132),
    "gh200": ("NVIDIA GH200 480GB", 97871, (9, 0), 132),
    "h200": ("NVIDIA H200", 143771, (9, 0), 132),
    "b200": ("NVIDIA B200", 183359, (10, 0), 148),
}


def test_the_catalog_holds_the_cards_the_issue_names() -> None:
    assert set(REQUIRED) <= set(known_names())
    assert len(set(known_names())) == len(CARDS)
    assert len({card.nvml_name.lower() for card in CARDS}) == len(CARDS)


@pytest.mark.parametrize("short", sorted(EXPECTED))
def test_each_cards_figures(short: str) -> None:
    card = lookup(short)
    assert (card.nvml_name, card.memory_bytes // MiB, card.compute_capability, card.sm_count) == EXPECTED[short]
    assert card.memory_bytes % MiB == 0  # NVML lists whole MiB, never the marketing GB
    assert card.assumed_from is None


def test_short_names_nvml_names_and_aliases_never_collide() -> None:
    names = [card.short_name for card in CARDS] + [card.nvml_name.lower() for card in CARDS]
    assert len(names) == len(set(names))
    for alias, short in ALIASES.items():
        assert alias not in names and lookup(alias).short_name == short


def test_an_assumed_figure_is_said_where_it_is() -> None:
    """The 96 GB H100 has no NVIDIA data sheet: its entry says which one gives 96 GB and what it assumes."""
    h100_96 = lookup("h100-96gb")
    assert "GH200 Grace Hopper Superchip data sheet" in h100_96.source and "torchtitan" in h100_96.source
    assert h100_96.assumed is not None and "97871 MiB" in h100_96.assumed
    assert lookup("h100").assumed is None and lookup("h200").assumed is None


def test_every_card_is_described_whole() -> None:
    for card in CARDS:
        assert card.compute_capability in ARCHITECTURES, card.short_name
        assert card.architecture.compute_capability == card.compute_capability
        assert card.sm_count > 0 and card.l2_cache_bytes > 0 and card.memory_bus_width_bits > 0
        assert card.source and "\n" not in card.source
        # The driver keeps a reservation: what CUDA reports is never above what NVML does.
        if card.cuda_total_bytes is not None:
            assert 0.97 * card.memory_bytes < card.cuda_total_bytes <= card.memory_bytes, card.short_name
        assert card.device_total_bytes == (card.cuda_total_bytes or card.memory_bytes)


def test_the_measured_h200() -> None:
    h200 = lookup("h200")
    assert (h200.nvml_name, h200.memory_bytes, h200.compute_capability) == ("NVIDIA H200", 143771 * MiB, (9, 0))
    known = outside_allocator(h200, "2.11.0+cu130", "13.0")
    assert known is not None and known.measured
    assert known.low_bytes <= known.bytes <= known.high_bytes
    # The card's first trial (m = 1) read 810 MiB: the context then, two 32 MiB cuBLAS workspaces and the
    # trial's own small segments; later trials read more outside the allocator (modules load lazily).
    assert known.low_bytes + 64 * MiB < 810 * MiB < known.bytes + 64 * MiB


def test_what_is_not_known_is_none() -> None:
    assert outside_allocator("h200", "2.13.0", "13.0") is None
    assert outside_allocator("a10g", "2.11.0", "13.0") is None
    assert all(entry.bytes > 0 and entry.source for entry in OUTSIDE_ALLOCATOR.values())


def test_every_other_card_takes_the_h200s_outside_figure_and_says_so() -> None:
    measured = OUTSIDE_ALLOCATOR[("h200", "2.11", "13.0")]
    assert outside_allocator_stand_in(lookup("h200")) is measured
    for card in CARDS:
        if card.short_name == "h200":
            continue
        stand_in = outside_allocator_stand_in(card)
        assert stand_in.bytes == measured.bytes and not stand_in.measured
        assert stand_in.source.startswith("assumed: the H200's figure") and card.short_name in stand_in.source
        # The part that scales with the card: 80 SMs x 2048 threads on a V100, 148 x 2048 on a B200; compared with
        # the H200's only where it differs (issue 62: "compute capability 9.0 against the H200's 9.0" on an H100).
        threads = card.sm_count * card.architecture.max_threads_per_sm
        h200 = lookup("h200")
        if threads != h200.resident_threads:
            assert f"{threads} resident threads against the H200's {h200.resident_threads}" in stand_in.source
        else:
            assert f"resident threads ({threads}) are the H200's" in stand_in.source
        if card.capability != h200.capability:
            assert f"compute capability {card.capability} against the H200's 9.0" in stand_in.source
        else:
            assert "compute capability 9.0 against" not in stand_in.source


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("H100", "h100"),
        ("nvidia h100 80gb hbm3", "h100"),
        ("  NVIDIA   H100 PCIe ", "h100-pcie"),
        ("A100-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("nvidia geforce rtx 4090", "rtx-4090"),
        ("Tesla V100-SXM2-32GB", "v100-32gb"),
        ("h100-sxm", "h100"),
        ("4090", "rtx-4090"),
        ("NVIDIA GH200 480GB", "gh200"),
        ("b200", "b200"),
    ],
)
def test_lookup_takes_short_and_nvml_names_in_any_case(name: str, short: str) -> None:
    assert lookup(name).short_name == short


def test_an_unknown_card_is_one_line_listing_the_known_ones() -> None:
    with pytest.raises(ValueError) as caught:
        lookup("v100")  # two memories, two forms: ambiguous, so no alias
    message = str(caught.value)
    assert "\n" not in message and "'v100'" in message
    assert all(name in message for name in known_names())


@pytest.mark.parametrize(
    ("name", "memory_bytes", "like"),
    [
        ("H100 96GB", 96 * GiB, "h100-96gb"),
        ("NVIDIA H100 PCIe 94GB", 94 * GiB, "h100-pcie"),  # the form before the memory: PCIe has 114 SMs
        ("Tesla V100S-PCIE-32GB", 32 * GiB, "v100-pcie-32gb"),
        ("NVIDIA A100-SXM4-80GB MIG 3g.40gb", 40 * GiB, "a100-40gb"),
        ("NVIDIA GeForce RTX 4090 D", 24 * GiB, "rtx-4090"),
        ("NVIDIA L40", 48 * GiB, "l40s"),
        ("NVIDIA B200", 192 * GiB, "b200"),
    ],
)
def test_an_unlisted_card_takes_its_closest_cards_architecture(name: str, memory_bytes: int, like: str) -> None:
    card = unlisted_card(name, memory_bytes)
    catalog = lookup(like)
    assert closest_card(name, memory_bytes) is catalog
    assert card.assumed_from == like and card.memory_bytes == memory_bytes and card.device_total_bytes == memory_bytes
    assert (card.compute_capability, card.sm_count, card.l2_cache_bytes) == (
        catalog.compute_capability, catalog.sm_count, catalog.l2_cache_bytes,
    )  # fmt: skip
    assert card.nvml_name == name and card.short_name not in known_names()
    assert card.assumed is not None and catalog.nvml_name in card.assumed and catalog.capability in card.assumed


def test_an_unlisted_card_of_no_family_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"card 'Radeon MI300X': no catalog family in its name") as caught:
        unlisted_card("Radeon MI300X", 192 * GiB)
    assert "\n" not in str(caught.value) and "h100" in str(caught.value)
    with pytest.raises(ValueError, match="memory must be positive"):
        unlisted_card("H100", 0)


def test_resolve_card_is_what_gpu_and_gpu_memory_name() -> None:
    assert resolve_card("h200") is lookup("h200")
    assert resolve_card("NVIDIA H100 NVL", 95830 * MiB) is lookup("h100-nvl")  # its own memory: the catalog's
    other = resolve_card("h100", 64 * GiB)
    assert other.assumed_from == "h100" and other.memory_bytes == 64 * GiB and other.short_name != "h100"
    assert resolve_card("H100 96GB HBM2e", 96 * GiB).assumed_from == "h100-96gb"
    with pytest.raises(ValueError, match="unknown card 'h300'"):
        resolve_card("h300")


def test_the_doctests_hold() -> None:
    failures, tried = doctest.testmod(cards)
    assert tried > 0 and failures == 0


def _run(argv: list[str]) -> int:
    parser = Parser(prog="autotune")
    gpus.add_parsers(parser.add_subparsers(dest="command", required=True, parser_class=Parser))
    args = parser.parse_args(argv)
    return int(args.run(args))


def test_autotune_gpus_lists_the_catalog(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["gpus"]) == 0
    out = capsys.readouterr().out
    for card in CARDS:
        assert card.short_name in out and card.nvml_name in out
    assert "876.00 MiB (torch 2.11, CUDA 13.0, measured)" in out
    assert "not known" in out


def test_autotune_gpus_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["gpus", "h200", "l4", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["short_name"] for row in rows] == ["h200", "l4"]
    assert rows[0]["total_bytes"] == 143771 * MiB and rows[0]["compute_capability"] == "9.0"
    assert rows[0]["outside_allocator"][0]["measured"] is True
    assert rows[1]["outside_allocator"] == [] and rows[1]["cuda_total_bytes"] is None
    # The figures a predicted step time needs, from the data sheets (the L4: BF16 242 TFLOPS with sparsity, 300 GB/s).
    figures = rows[1]["performance"]
    assert figures["dense_tflops"]["bf16"] == 121.0
    assert figures["memory_tbytes_per_s"] == 0.3 and figures["nvlink_gbytes_per_s"] is None


def test_autotune_gpus_refuses_an_unknown_card() -> None:
    with pytest.raises(CliError, match="unknown card 'p100': known cards are h100, h100-pcie, h200"):
        _run(["gpus", "p100"])


def test_all_names_exist() -> None:
    assert all(hasattr(cards, name) for name in cards.__all__)
    assert all(hasattr(gpus, name) for name in gpus.__all__)
