"""`autotune gpus`: the card catalog, the cards an estimate can be for (no torch imported)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from autotune.cli.common import CliError

__all__ = ["add_parsers", "run_gpus"]


def add_parsers(sub: Any) -> None:
    g = sub.add_parser("gpus", help="list the cards the project can emulate, with what their driver reports")
    g.add_argument("names", nargs="*", metavar="NAME", help="only these cards (short names or NVML names)")
    g.add_argument("--json", action="store_true", help="print the catalog as JSON on stdout")
    g.add_argument(
        "--check",
        action="store_true",
        help="also start a CUDA build of torch under each card's emulation and show what it reads",
    )
    g.set_defaults(run=run_gpus)


def run_gpus(args: argparse.Namespace) -> int:
    from autotune.core.cards import CARDS, OUTSIDE_ALLOCATOR, lookup

    try:
        cards = [lookup(name) for name in args.names] if args.names else list(CARDS)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    checks = {card.short_name: _check(card) for card in cards} if args.check else {}
    if args.json:
        rows = []
        for card in cards:
            outside = [
                {"torch": torch, "cuda": cuda, "bytes": known.bytes, "measured": known.measured, "source": known.source}
                for (short, torch, cuda), known in OUTSIDE_ALLOCATOR.items()
                if short == card.short_name
            ]
            rows.append(
                {
                    "short_name": card.short_name,
                    "name": card.nvml_name,
                    "total_bytes": card.memory_bytes,
                    "cuda_total_bytes": card.cuda_total_bytes,
                    "compute_capability": card.capability,
                    "sm_count": card.sm_count,
                    "l2_cache_bytes": card.l2_cache_bytes,
                    "memory_bus_width_bits": card.memory_bus_width_bits,
                    "outside_allocator": outside,
                    # What a predicted step time needs of the card (autotune/core/cards.py, Performance), or None.
                    "performance": None if card.performance is None else dataclasses.asdict(card.performance),
                    "source": card.source,
                    **({"emulation": checks[card.short_name]} if checks else {}),
                }
            )
        print(json.dumps(rows, indent=2))
        return 0
    print(_table(cards, checks))
    return 0


def _check(card: Any) -> str:
    from autotune.core.units import format_bytes
    from autotune.emulation import check_emulation

    print(f"checking the emulation of {card.short_name} ...", file=sys.stderr, flush=True)
    device = check_emulation(card)  # an EmulationError is one line, which main prints as such
    return (
        f"torch {device.torch_version} reads {device.name}, {device.capability[0]}.{device.capability[1]}, "
        f"{format_bytes(device.total_bytes)}"
    )


def _table(cards: list[Any], checks: dict[str, str]) -> str:
    from autotune.core.cards import OUTSIDE_ALLOCATOR
    from autotune.core.units import format_bytes

    header = ["card", "name (NVML)", "memory", "cc", "SMs", "L2", "outside the allocator"]
    rows = []
    for card in cards:
        known = [
            f"{format_bytes(entry.bytes)} (torch {torch}, CUDA {cuda}, {'measured' if entry.measured else 'reported'})"
            for (short, torch, cuda), entry in OUTSIDE_ALLOCATOR.items()
            if short == card.short_name
        ]
        rows.append(
            [
                card.short_name,
                card.nvml_name,
                format_bytes(card.memory_bytes),
                card.capability,
                str(card.sm_count),
                format_bytes(card.l2_cache_bytes),
                "; ".join(known) or "not known",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
    for card in cards:
        if card.short_name in checks:
            lines.append(f"{card.short_name}: emulation ok: {checks[card.short_name]}")
    return "\n".join(lines)
