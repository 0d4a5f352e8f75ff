"""The environment of a process that sees an emulated card: the card's variables, and the libraries.

The runtime shim reads the card at its first call (native/card.h), so one build serves every card: the
variables below are the card's entry in the catalog (autotune/core/cards.py), each named
``AUTOTUNE_EMULATED_<FIELD>``. ``LD_PRELOAD`` puts the shim before the real CUDA runtime, and
``LD_LIBRARY_PATH`` the stand-in ``libcuda.so.1`` before any real driver. Torch-free.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from autotune.core.cards import Card
from autotune.emulation.build import EmulationLibraries

__all__ = ["DISABLE_VARIABLE", "card_environment", "child_environment"]

# Emulated entry points to answer as uncovered ones (comma-separated): how a test makes a runtime fail.
DISABLE_VARIABLE = "AUTOTUNE_EMULATION_DISABLE"
# Variables of the host that would take torch past the emulation: NVML's device count (no NVML here),
# and devices hidden from the runtime the shim replaces.
_DROPPED = ("PYTORCH_NVML_BASED_CUDA_CHECK", "CUDA_VISIBLE_DEVICES")


def card_environment(card: Card, *, driver_version: int) -> dict[str, str]:
    """The variables that describe card to the emulation. driver_version is what
    ``cudaDriverGetVersion`` answers (1000 x major + 10 x minor: 13010 for CUDA 13.1).

    >>> from autotune.core.cards import lookup
    >>> env = card_environment(lookup("h100"), driver_version=13010)
    >>> env["AUTOTUNE_EMULATED_NAME"], env["AUTOTUNE_EMULATED_CC_MAJOR"], env["AUTOTUNE_EMULATED_SM_COUNT"]
    ('NVIDIA H100 80GB HBM3', '9', '132')
    """
    arch = card.architecture
    values = {
        "NAME": card.nvml_name,
        "TOTAL_BYTES": card.device_total_bytes,
        "CC_MAJOR": card.compute_capability[0],
        "CC_MINOR": card.compute_capability[1],
        "SM_COUNT": card.sm_count,
        "L2_BYTES": card.l2_cache_bytes,
        "BUS_WIDTH_BITS": card.memory_bus_width_bits,
        "MAX_THREADS_PER_SM": arch.max_threads_per_sm,
        "MAX_BLOCKS_PER_SM": arch.max_blocks_per_sm,
        "MAX_THREADS_PER_BLOCK": arch.max_threads_per_block,
        "WARP_SIZE": arch.warp_size,
        "SHARED_PER_SM": arch.shared_memory_per_sm_bytes,
        "SHARED_PER_BLOCK": arch.shared_memory_per_block_bytes,
        "SHARED_PER_BLOCK_OPTIN": arch.shared_memory_per_block_optin_bytes,
        "SHARED_RESERVED_PER_BLOCK": arch.reserved_shared_memory_per_block_bytes,
        "REGISTERS_PER_SM": arch.registers_per_sm,
        "REGISTERS_PER_BLOCK": arch.registers_per_block,
        "CONSTANT_BYTES": arch.constant_memory_bytes,
        "DRIVER_VERSION": driver_version,
    }
    return {f"AUTOTUNE_EMULATED_{key}": str(value) for key, value in values.items()}


def child_environment(
    card: Card,
    libraries: EmulationLibraries,
    *,
    driver_version: int,
    base: Mapping[str, str] | None = None,
    disable: Iterable[str] = (),
) -> dict[str, str]:
    """The environment of a child process that sees card: base (this process's environment by
    default) with the emulation's libraries first on ``LD_PRELOAD`` and ``LD_LIBRARY_PATH`` and the
    card's variables set. disable: emulated entry points to answer as uncovered ones (for tests)."""
    env = dict(os.environ if base is None else base)
    for name in _DROPPED:
        env.pop(name, None)
    env = {key: value for key, value in env.items() if not key.startswith("AUTOTUNE_EMULATED_")}
    env["LD_PRELOAD"] = _prepend(str(libraries.runtime), env.get("LD_PRELOAD"), " ")
    env["LD_LIBRARY_PATH"] = _prepend(str(libraries.driver_dir), env.get("LD_LIBRARY_PATH"), ":")
    env.update(card_environment(card, driver_version=driver_version))
    disabled = ",".join(disable)
    if disabled:
        env[DISABLE_VARIABLE] = disabled
    else:
        env.pop(DISABLE_VARIABLE, None)
    return env


def _prepend(first: str, rest: str | None, separator: str) -> str:
    return first if not rest else f"{first}{separator}{rest}"
