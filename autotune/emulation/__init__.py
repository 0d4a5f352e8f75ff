"""CUDA answers from a host without a card: fake trials on an emulated CUDA device.

A CUDA build of torch on a host with no GPU and no driver can run a fake trial with CUDA's choices
(dispatch, autocast's CUDA op lists, the SDPA kernel the architecture would pick, the optimizers'
``foreach`` paths) once it sees a device. This package gives it one, read from the card catalog
(``autotune.core.cards``): a stand-in CUDA runtime preloaded into a child process and a stand-in
``libcuda.so.1``, built from C sources on first use (``build``), whose card is set by environment
variables (``environment``); the child runs the fake trials (``child``) and the parent reads back
their peaks and allocation traces (``runner``), which the caching allocator's model
(``autotune.core.allocator``) turns into reserved bytes.

Nothing here allocates device memory: an allocation in a fake trial is refused with a line naming
it, and any entry point the emulation does not cover logs its name and fails.

Imports: ``autotune.core`` in the parent (torch-free); the child also imports ``autotune.measure``,
``autotune.search`` and ``autotune.tasks``.
"""

from autotune.emulation.build import EmulationError
from autotune.emulation.environment import card_environment, child_environment
from autotune.emulation.runner import (
    CudaTorchMissing,
    EmulatedDevice,
    EmulatedRun,
    EmulatedTrial,
    check_emulation,
    find_cuda_python,
    keep_children_warm,
    run_emulated_trials,
)

__all__ = [
    "CudaTorchMissing",
    "EmulatedDevice",
    "EmulatedRun",
    "EmulatedTrial",
    "EmulationError",
    "card_environment",
    "check_emulation",
    "child_environment",
    "find_cuda_python",
    "keep_children_warm",
    "run_emulated_trials",
]
