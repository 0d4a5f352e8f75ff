"""What a fleet run probes: one pair per task spec × accelerator kind (or device, or emulated card) × budget.

    pairs = make_pairs(["examples/gpt.py:task"], accelerators=["H100", "A100"], device=None,
                       budgets=[None], config_for=lambda device, budget: ProbeConfig(device=device),
                       working_dir=Path.cwd())

With ``cards`` (``--gpu h100,a100-80gb``) a pair is an *estimate* instead of a probe: emulated CUDA fake
trials for a catalog card (autotune/orchestrate/card_estimate.py), on any node's CPU.

Ray-free and torch-free: the driver builds the pairs before it connects to anything, so that a
mistake in the command line costs no cluster time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.core.errors import AutotuneError, TaskError
from autotune.core.units import format_bytes

__all__ = [
    "EMULATED",
    "FLEET_DEVICES",
    "EstimateOptions",
    "Pair",
    "make_pairs",
    "parse_accelerators",
    "parse_cards",
    "worker_spec",
]

FLEET_DEVICES = ("cpu", "cuda")
"""Devices a fleet pair may name without an accelerator kind: Ray, not the user, picks the GPU."""

_ACCELERATOR = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")

EMULATED = " (emulated)"
"""What an estimate pair's ``on`` adds to the card's short name: no node has the card, a child emulates it."""


@dataclass(frozen=True)
class EstimateOptions:
    """What an estimate pair runs with besides its ``EstimateConfig`` (which has no room for them).

    Attributes:
        seq_lens: ``--seq-len``: the lengths of a sequence-aware task, all in one emulated child.
        moe_load_factor: ``--moe-load-factor`` (None: balanced routing for a mixture of experts).
    """

    seq_lens: tuple[int, ...] = ()
    moe_load_factor: float | None = None


@dataclass(frozen=True)
class Pair:
    """One probe to run on the fleet.

    Attributes:
        index: its place in the run (the key of its Ray task and of its row in the table).
        spec: the task as given on the command line (``examples/gpt.py:task``).
        worker_spec: the task as the worker loads it, relative to the shipped working directory.
        on: the accelerator kind (``H100``) or the device (``cpu``, ``cuda``) it runs on.
        accelerator: the Ray accelerator type it asks for, None for any GPU or the CPU.
        config: the probe's config (a ``ProbeConfig``: device, budget and probe's other options), or an
            estimate pair's ``EstimateConfig`` (the card in ``card``, its memory as the default budget).
        estimate: set on an estimate pair (``--gpu``), None on a probe pair.
    """

    index: int
    spec: str
    worker_spec: str
    on: str
    accelerator: str | None
    config: Any
    estimate: EstimateOptions | None = None

    @property
    def needs_gpu(self) -> bool:
        """A probe on CUDA; never an estimate, whose card is emulated on a CPU."""
        return self.estimate is None and str(getattr(self.config, "device", "")).startswith("cuda")

    @property
    def setup(self) -> Any:
        """The job's setup: the probe's ProbeConfig, or an estimate's ``config.probe``."""
        return getattr(self.config, "probe", self.config)

    @property
    def budget_bytes(self) -> int | None:
        return getattr(self.setup, "budget_bytes", None)

    @property
    def budget_label(self) -> str:
        """The budget in binary units, or "device" when the device's own memory is the budget."""
        return "device" if self.budget_bytes is None else format_bytes(self.budget_bytes)

    @property
    def label(self) -> str:
        policy = getattr(self.setup, "activation_checkpointing", None)
        return f"{self.spec} on {self.on}, budget {self.budget_label}" + (f", ac {policy}" if policy else "")

    def ray_options(self, max_retries: int) -> dict[str, Any]:
        """The options of this pair's Ray task.

        One CPU always; a GPU on CUDA, of the pair's accelerator kind when it names one (Ray turns
        ``accelerator_type="H100"`` into a request for the node resource ``accelerator_type:H100``,
        which Ray's GPU detection sets on nodes with that card); an estimate, one CPU only. ``max_retries``
        re-runs a task whose worker process died (a node lost, the OOM killer); a probe that raises is
        not retried: its error is the answer.
        """
        options: dict[str, Any] = {"num_cpus": 1, "max_retries": max_retries}
        if self.needs_gpu:
            options["num_gpus"] = 1
        if self.accelerator is not None:
            options["accelerator_type"] = self.accelerator
        return options


def parse_accelerators(text: str) -> list[str]:
    """``"H100,A100"`` -> ``["H100", "A100"]``: Ray's accelerator type names, without repeats.

    Raises:
        AutotuneError: an empty list or a name Ray could not have given a node.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise AutotuneError(f"--accelerators {text!r} names no accelerator kind (e.g. H100,A100,L4)")
    bad = [name for name in names if not _ACCELERATOR.match(name)]
    if bad:
        raise AutotuneError(f"--accelerators: {', '.join(map(repr, bad))} is not an accelerator type name (e.g. H100)")
    return list(dict.fromkeys(names))


def parse_cards(text: str) -> list[str]:
    """``"h100,A100-80GB"`` -> ``["h100", "a100-80gb"]``: catalog cards (autotune/core/cards.py) by their
    short names, without repeats; a card named as NVML names it is taken too.

    Raises:
        AutotuneError: an empty list, or a name the catalog does not know (one line listing the known ones).
    """
    from autotune.core.cards import lookup

    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise AutotuneError(f"--gpu {text!r} names no card (e.g. h100,a100-80gb; `autotune gpus` lists them)")
    try:
        return list(dict.fromkeys(lookup(name).short_name for name in names))
    except ValueError as exc:
        raise AutotuneError(f"--gpu: {exc}") from None


def worker_spec(spec: str, working_dir: Path) -> str:
    """The spec as a worker loads it: a task file's path made relative to the working directory
    that Ray ships to the worker (the worker runs inside its copy), and an ``hf:`` spec's config the
    same way; a module spec as it is.

    Raises:
        TaskError: the file does not exist, or lies outside the working directory (it would not
            reach the workers).
    """
    from autotune.tasks.hf import HF_PREFIX, is_hf_spec

    if is_hf_spec(spec):  # hf:PATH[?options]: the config, like a task file, must reach the workers
        path_part, query_sep, query = spec[len(HF_PREFIX) :].partition("?")
        return HF_PREFIX + _shipped(path_part, spec, working_dir) + query_sep + query
    module_part, sep, attr = spec.rpartition(":") if ":" in spec else (spec, "", "")
    if not module_part:
        raise TaskError(f"task {spec!r} is not of the form path/to/file.py:name or package.module:name")
    if not (module_part.endswith(".py") or "/" in module_part):
        return spec
    if not Path(module_part).is_file():
        raise TaskError(f"task file {module_part!r} not found (from {spec!r})")
    return _shipped(module_part, spec, working_dir) + sep + attr


def _shipped(file: str, spec: str, working_dir: Path) -> str:
    """file's path relative to the working directory, which is what the workers receive."""
    path = Path(file)
    if not path.exists():
        raise TaskError(f"{file!r} not found (from {spec!r})")
    root = working_dir.resolve()
    try:
        relative = path.resolve().relative_to(root)
    except ValueError:
        raise TaskError(
            f"task file {file!r} is outside the working directory {str(root)!r} that is shipped to the "
            "workers: run from a directory that holds it, or pass --working-dir"
        ) from None
    return relative.as_posix()


def make_pairs(
    specs: Sequence[str],
    *,
    accelerators: Sequence[str] | None,
    device: str | None,
    budgets: Sequence[int | None],
    config_for: Callable[[str, int | None], Any],
    working_dir: Path,
    cards: Sequence[str] | None = None,
    estimate: EstimateOptions | None = None,
) -> list[Pair]:
    """Every task × (accelerator kind, or the one device, or emulated card) × budget, in that order.

    Args:
        specs: task specs as ``autotune probe`` takes them.
        accelerators: Ray accelerator types (each pair gets one GPU of that kind), or None.
        device: ``cpu`` or ``cuda`` when no accelerator kinds are given.
        budgets: budgets in bytes; ``[None]`` probes against each device's own memory.
        config_for: ``(device, budget) -> ProbeConfig`` with the probe's other options; for ``cards``,
            ``(card, budget) -> EstimateConfig``.
        working_dir: the directory shipped to the workers; task files must lie inside it.
        cards: catalog cards' short names (:func:`parse_cards`): each pair is an estimate for one, on
            a CPU, instead of a probe.
        estimate: the estimate pairs' lengths and routing (default: none).

    Raises:
        AutotuneError: no tasks, not exactly one of accelerators, device and cards, a device the fleet
            cannot place, the CPU without a budget, a repeated pair; TaskError for a bad spec.
    """
    if not specs:
        raise AutotuneError("fleet needs at least one task")
    if sum(given is not None for given in (accelerators, device, cards)) != 1:
        raise AutotuneError(
            "give --accelerators H100,A100 (GPU kinds, one GPU each), --device cpu|cuda "
            "or --gpu h100,a100-80gb (estimates for emulated cards)"
        )
    if device is not None and device not in FLEET_DEVICES:
        raise AutotuneError(
            f"--device {device!r}: a fleet runs on cpu or cuda (Ray assigns the GPU); "
            "name GPU kinds with --accelerators"
        )
    if device == "cpu" and any(budget is None for budget in budgets):
        raise AutotuneError("--device cpu needs --budget (the CPU meter has no memory size of its own)")
    if len(set(budgets)) != len(budgets):
        raise AutotuneError("--budget repeats a value: each budget makes its own pairs")
    if len(set(specs)) != len(specs):
        raise AutotuneError("a task is given twice: each task makes its own pairs")
    if cards is not None:
        return _estimate_pairs(specs, cards, budgets, config_for, working_dir, estimate or EstimateOptions())
    targets: list[tuple[str, str | None]] = (
        [(name, name) for name in accelerators] if accelerators is not None else [(str(device), None)]
    )
    pairs: list[Pair] = []
    for spec in specs:
        shipped = worker_spec(spec, working_dir)
        for on, accelerator in targets:
            for budget in budgets:
                config = config_for("cuda" if accelerator is not None else str(device), budget)
                pairs.append(Pair(len(pairs), spec, shipped, on, accelerator, config))
    return pairs


def _estimate_pairs(
    specs: Sequence[str],
    cards: Sequence[str],
    budgets: Sequence[int | None],
    config_for: Callable[[str, int | None], Any],
    working_dir: Path,
    estimate: EstimateOptions,
) -> list[Pair]:
    """Every task × card × budget as an estimate: no accelerator kind to ask Ray for, the card emulated."""
    if not cards:
        raise AutotuneError("--gpu names no card (e.g. h100,a100-80gb; `autotune gpus` lists them)")
    pairs: list[Pair] = []
    for spec in specs:
        shipped = worker_spec(spec, working_dir)
        for card in cards:
            for budget in budgets:
                config = config_for(card, budget)
                pairs.append(Pair(len(pairs), spec, shipped, card + EMULATED, None, config, estimate))
    return pairs
