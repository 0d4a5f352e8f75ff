"""The card catalog: names, figures and what is known of the memory outside the allocator; `autotune gpus`."""

from __future__ import annotations

import doctest
import json

import pytest

from autotune.cli import gpus
from autotune.cli.common import CliError, Parser
from autotune.core import cards
from autotune.core.cards import ARCHITECTURES, CARDS, OUTSIDE_ALLOCATOR, known_names, lookup, outside_allocator

MiB = 1 << 20
REQUIRED = ("h100", "h100-pcie", "h200", "a100-80gb", "a100-40gb", "l40s", "l4", "a10g", "rtx-4090")


def test_the_catalog_holds_the_cards_the_issue_names() -> None:
    assert set(REQUIRED) <= set(known_names())
    assert len(set(known_names())) == len(CARDS)
    assert len({card.nvml_name.lower() for card in CARDS}) == len(CARDS)


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


@pytest.mark.parametrize(
    ("name", "short"),
    [
        ("H100", "h100"),
        ("nvidia h100 80gb hbm3", "h100"),
        ("  NVIDIA   H100 PCIe ", "h100-pcie"),
        ("A100-80GB", "a100-80gb"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("nvidia geforce rtx 4090", "rtx-4090"),
    ],
)
def test_lookup_takes_short_and_nvml_names_in_any_case(name: str, short: str) -> None:
    assert lookup(name).short_name == short


def test_an_unknown_card_is_one_line_listing_the_known_ones() -> None:
    with pytest.raises(ValueError) as caught:
        lookup("v100")
    message = str(caught.value)
    assert "\n" not in message and "'v100'" in message
    assert all(name in message for name in known_names())


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


def test_autotune_gpus_refuses_an_unknown_card() -> None:
    with pytest.raises(CliError, match="unknown card 'b200': known cards are h100"):
        _run(["gpus", "b200"])


def test_all_names_exist() -> None:
    assert all(hasattr(cards, name) for name in cards.__all__)
    assert all(hasattr(gpus, name) for name in gpus.__all__)
