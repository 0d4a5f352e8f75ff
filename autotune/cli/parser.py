"""The argument parser: one sub-parser group per command module."""

from __future__ import annotations

import argparse

from autotune.cli import estimate, fleet, gpus, probe, recommend, service, store
from autotune.cli.common import Parser

__all__ = ["build_parser"]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="autotune", description="Memory-budget tuner for PyTorch training.")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="let the libraries' own log lines (torch, Kineto, torchao, transformers) through to the terminal",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for module in (probe, estimate, gpus, fleet, recommend, service, store):
        module.add_parsers(sub)
    return parser
