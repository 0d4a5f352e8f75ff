"""Fake trials on emulated cards show CUDA's choices: the device is the card, AdamW takes its foreach
path, SDPA the kernel of the architecture, autocast bf16 on matmuls; the traces balance; an uncovered
entry point, a missing CUDA build or a hung child each end in one line.

The emulated tests need a CUDA build of torch (``make .venv-cuda``); without one they skip, saying so.
Each child process costs a torch import (seconds), so the trials of every card run once per module,
one child per card (in turn: side by side they were slower on two cores).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import torch

from autotune.core.allocator import FREE, replay
from autotune.core.cards import lookup
from autotune.core.schemas import MAX_BYTES
from autotune.emulation import (
    CudaTorchMissing,
    EmulatedRun,
    EmulationError,
    card_environment,
    check_emulation,
    child_environment,
    find_cuda_python,
    run_emulated_trials,
)
from autotune.emulation import runner as runner_module
from autotune.emulation.build import EmulationLibraries
from autotune.measure.meters import CpuMeter
from autotune.measure.meters.fake import FakeMeter
from autotune.measure.trial import TrialRunner
from autotune.tasks.load import load_task

GPT = "examples/gpt.py:task"
SIZES = (2,)
MiB = 1 << 20
# (card, strategy, world size) of the module's runs: three architectures, and FSDP2's resizes on one.
RUNS = {"h200": ("ddp", 1), "a100-80gb": ("fsdp", 2), "t4": ("ddp", 1)}


@pytest.fixture(scope="module")
def runs(cuda_python: str) -> dict[str, EmulatedRun]:
    def one(card: str) -> EmulatedRun:
        strategy, world_size = RUNS[card]
        return run_emulated_trials(
            GPT, SIZES, card=card, precision="bf16", strategy=strategy, world_size=world_size, record_ops=True
        )

    return {card: one(card) for card in RUNS}


def test_the_emulated_device_is_the_card(cuda_python: str, runs: dict[str, EmulatedRun]) -> None:
    h100 = check_emulation("h100")
    assert (h100.name, h100.capability, h100.sm_count) == ("NVIDIA H100 80GB HBM3", (9, 0), 132)
    assert h100.total_bytes == lookup("h100").device_total_bytes == 81089 * MiB
    for card, run in runs.items():
        expected = lookup(card)
        assert (run.device.name, run.device.capability) == (expected.nvml_name, expected.compute_capability)
        assert run.device.total_bytes == expected.device_total_bytes
        assert run.device.cuda_version is not None and run.log == []


def _cpu_semantics_step_bytes(micro_batch: int) -> tuple[int, int, int]:
    """A fake trial of the same task with CPU semantics (this process's torch, device cpu): its step's
    peak, the bytes of AdamW's second moments, and how many parameters there are."""
    task = dataclasses.replace(load_task(GPT), precision="bf16")
    runner = TrialRunner(task, FakeMeter(MAX_BYTES, "cpu"), limit_bytes=MAX_BYTES)
    try:
        trial = runner(micro_batch)
        params = list(runner._model.parameters()) if runner._model is not None else []
    finally:
        runner.close()
    assert trial.step_bytes is not None and params
    return trial.step_bytes, sum(p.numel() * 4 for p in params), len(params)  # fp32 parameters and moments


def test_adamw_takes_its_foreach_path(runs: dict[str, EmulatedRun]) -> None:
    """CUDA's AdamW makes a temporary of every second moment at once (``_foreach_sqrt``); the CPU's
    for-loop path holds a parameter's two temporaries at a time (and the last one's until replaced)."""
    cpu_step, second_moments, _ = _cpu_semantics_step_bytes(SIZES[0])
    trial = runs["h200"].trials[0]
    # Weights, gradients, both moments and the temporary of every second moment; the step counters are
    # 4-byte tensors on the host (AdamW is not capturable): host memory, which a card's figure leaves out.
    assert trial.step_bytes == 5 * second_moments
    extra = trial.step_bytes - cpu_step
    assert 0.75 * second_moments < extra < second_moments, (extra, second_moments)
    assert trial.ops["aten._foreach_sqrt.default"] == ("float32",)


def _attention_ops(run: EmulatedRun) -> set[str]:
    return {name for name in run.trials[0].ops if "scaled_dot_product" in name}


def test_bf16_causal_attention_takes_the_architectures_kernel(runs: dict[str, EmulatedRun]) -> None:
    # torch 2.13: cuDNN attention on sm_90, flash on sm_80, and on sm_75 (no bf16 flash or
    # memory-efficient kernel) the math path, whose batched matmuls run in fp32.
    assert _attention_ops(runs["h200"]) == {
        "aten._scaled_dot_product_cudnn_attention.default",
        "aten._scaled_dot_product_cudnn_attention_backward.default",
    }
    assert _attention_ops(runs["a100-80gb"]) == {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_flash_attention_backward.default",
    }
    assert _attention_ops(runs["t4"]) == set()
    assert runs["t4"].trials[0].ops["aten.bmm.default"] == ("float32",)


def test_autocast_runs_matmuls_in_bf16(runs: dict[str, EmulatedRun]) -> None:
    for run in runs.values():
        ops = run.trials[0].ops
        assert ops["aten.mm.default"] == ("bfloat16",) and ops["aten.addmm.default"] == ("bfloat16",)


def test_traces_balance_and_replay(runs: dict[str, EmulatedRun]) -> None:
    for run in runs.values():
        for trial in run.trials:
            live = dict(trial.held)
            at_start, peak = sum(live.values()), sum(live.values())
            current = at_start
            for key, nbytes in trial.events:
                if nbytes == FREE:
                    current -= live.pop(key)  # a KeyError is a release of something never allocated
                else:
                    assert key not in live and nbytes > 0
                    live[key] = nbytes
                    current += nbytes
                peak = max(peak, current)
            assert live == dict(trial.held), "the trial left storages behind, or freed what it held"
            assert peak == trial.peak_bytes
            assert trial.reserved_bytes is not None and trial.allocated_bytes is not None
            assert trial.reserved_bytes % (2 * MiB) == 0
            assert trial.reserved_bytes >= trial.allocated_bytes >= trial.peak_bytes
            assert replay(trial.held + trial.events, streams=trial.streams).peak_reserved_bytes == trial.reserved_bytes
    # FSDP2 frees its unsharded parameters by resizing their storages to 0: the held storages are the
    # shards, and each trial allocates and frees the gathered parameters under the same keys.
    assert len(runs["a100-80gb"].trials[0].held) == len(runs["h200"].trials[0].held)
    assert sum(n for _, n in runs["a100-80gb"].trials[0].held) < sum(n for _, n in runs["h200"].trials[0].held)


def test_fsdp2_allocates_its_collectives_on_streams_of_their_own(runs: dict[str, EmulatedRun]) -> None:
    # FSDP2 all-gathers on one stream and reduce-scatters on another (FSDPCommContext.lazy_init); the caching
    # allocator keeps each stream's blocks apart, so the trace says which allocations were made there. DDP's
    # trials make none off the default stream.
    fsdp = runs["a100-80gb"].trials[0]
    sizes = dict(fsdp.held + tuple(e for e in fsdp.events if e[1] != FREE))
    side = {stream: [sizes[key] for key, s in fsdp.streams.items() if s == stream] for stream in fsdp.streams.values()}
    assert len(side) == 2, side  # the all-gather stream and the reduce-scatter stream
    # The model's parameters gathered (bf16) and its gradients reduce-scattered (fp32: the policy's reduce
    # dtype), a block at a time: each side stream's largest allocation is one block's, under the whole model.
    whole_fp32 = _cpu_semantics_step_bytes(SIZES[0])[1]
    assert all(0 < max(found) < whole_fp32 for found in side.values())
    assert runs["h200"].trials[0].streams == {} and runs["t4"].trials[0].streams == {}
    single = replay(fsdp.held + fsdp.events).peak_reserved_bytes
    assert fsdp.reserved_bytes is not None and fsdp.reserved_bytes > single


def test_an_uncovered_entry_point_is_one_line_naming_it(cuda_python: str) -> None:
    with pytest.raises(EmulationError) as caught:
        check_emulation("l4", disable=["cudaGetDeviceProperties"])
    message = str(caught.value)
    assert "\n" not in message
    assert "cudaGetDeviceProperties is not emulated" in message and "emulated l4" in message


def test_a_child_that_hangs_is_killed(cuda_python: str) -> None:
    started = time.perf_counter()
    with pytest.raises(EmulationError, match=r"did not finish within 0.5 s: killed"):
        run_emulated_trials(GPT, [2], card="h100", timeout_seconds=0.5)
    assert time.perf_counter() - started < 10


def test_without_a_cuda_build_it_says_what_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setattr(runner_module, "_current_torch_is_cuda", lambda: False)
    monkeypatch.setattr(runner_module, "_REPO", tmp_path)
    monkeypatch.delenv("AUTOTUNE_CUDA_PYTHON", raising=False)
    with pytest.raises(CudaTorchMissing) as caught:
        find_cuda_python()
    assert "make .venv-cuda" in str(caught.value) and "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="positive"):
        run_emulated_trials(GPT, [0], card="h100")


def test_the_childs_environment(tmp_path) -> None:
    libraries = EmulationLibraries(tmp_path / "libautotune_cudart.so", tmp_path / "driver", tmp_path)
    base = {"LD_PRELOAD": "/other.so", "CUDA_VISIBLE_DEVICES": "", "AUTOTUNE_EMULATED_NAME": "stale", "PATH": "/bin"}
    env = child_environment(lookup("a10g"), libraries, driver_version=13010, base=base, disable=["cudaMalloc"])
    assert env["LD_PRELOAD"] == f"{libraries.runtime} /other.so"
    assert env["LD_LIBRARY_PATH"] == str(libraries.driver_dir)
    assert "CUDA_VISIBLE_DEVICES" not in env and env["PATH"] == "/bin"
    assert env["AUTOTUNE_EMULATED_NAME"] == "NVIDIA A10G" and env["AUTOTUNE_EMULATION_DISABLE"] == "cudaMalloc"
    card = card_environment(lookup("a10g"), driver_version=13010)
    assert card["AUTOTUNE_EMULATED_SHARED_PER_BLOCK_OPTIN"] == str(99 * 1024)
    assert card["AUTOTUNE_EMULATED_TOTAL_BYTES"] == str(22587 * MiB)
    assert set(card) <= set(env)


@pytest.fixture
def meter() -> Iterator[CpuMeter]:
    meter = CpuMeter(1 << 30)
    yield meter
    meter.release()


def test_the_ledger_records_allocations_resizes_and_releases(meter: CpuMeter) -> None:
    with meter.hold():
        kept = torch.ones(16)  # 64 bytes, held before the recording
    with meter.record_events() as recorded, meter.hold():
        a = torch.ones(256)  # 1024 bytes
        a.untyped_storage().resize_(0)  # FSDP2's free of an unsharded parameter
        a.untyped_storage().resize_(1024)  # and its all-gather's allocation
        a.untyped_storage().resize_(2048)  # another size: the new bytes first, the old freed after
        del a
    ((held_key, held_bytes),) = recorded.held
    assert held_bytes == 64 and held_key == kept.untyped_storage()._cdata
    key = recorded.events[0][0]
    renamed = recorded.events[3][0]
    assert recorded.events == [(key, 1024), (key, FREE), (key, 1024), (renamed, 2048), (key, FREE), (renamed, FREE)]
    assert renamed != key and replay(recorded.held + recorded.events).peak_allocated_bytes == 512 + 1024 + 2048


def test_a_missing_compiler_is_one_line(cuda_python: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    from autotune.emulation.build import build_libraries, inspect_cuda_torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-gcc"))
    with pytest.raises(EmulationError, match=r"builds its libraries with gcc, which is not on PATH \(install gcc"):
        build_libraries(inspect_cuda_torch(cuda_python))


def _scratch(events: tuple[tuple[int, int], ...], sizes: tuple[int, ...]) -> int:
    """How many times the trace allocates sizes in a row and then frees them in reverse order, as one op's
    temporaries do (autotune/core/kernel_temporaries.py)."""
    n = len(sizes)
    found = 0
    for i in range(len(events) - 2 * n + 1):
        window = events[i : i + 2 * n]
        keys = [key for key, _ in window[:n]]
        freed = [(key, FREE) for key in reversed(keys)]
        if [nbytes for _, nbytes in window[:n]] == list(sizes) and list(window[n:]) == freed:
            found += 1
    return found


def test_the_kernels_temporaries_are_in_the_trace(runs: dict[str, EmulatedRun]) -> None:
    """bf16 causal attention at m = 2 (4 heads of 16, 64 tokens): on the H200 cuDNN's backward takes its
    workspace (a float grad-Q accumulator and the softmax sums: 4 * 2 * 4 * 64 * 17 bytes), on the A100
    flash attention's backward its softmax_d (64 tokens rounded to 128) and dq_accum (head rounded to 32);
    once per layer and micro-batch: 2 layers x 4 micro-batches."""
    assert _scratch(runs["h200"].trials[0].events, (4 * 2 * 4 * 64 * 17,)) == 8
    assert _scratch(runs["a100-80gb"].trials[0].events, (4 * 2 * 4 * 128, 4 * 2 * 128 * 4 * 32)) == 8


def test_the_trials_child_holds_the_setups_mesh(cuda_python: str) -> None:
    # Issue 40: the trials job's request never sent the mesh its child read, so a tp rank ran as the whole model.
    # The setup now travels whole (JobSetup as JSON): the tp 2 rank holds less than the whole model at the same m.
    from autotune.core.mesh import Mesh

    llama = "hf:examples/configs/tiny-llama.json?optimizer=AdamW:foreach=false"
    ranked = run_emulated_trials(llama, [2], card="h100", seq_len=64, world_size=2, mesh=Mesh(tp=2))
    whole = run_emulated_trials(llama, [2], card="h100", seq_len=64, world_size=2)
    assert 0 < ranked.trials[0].peak_bytes < whole.trials[0].peak_bytes


def test_a_warm_child_is_a_fresh_process_measuring_what_a_cold_one_does(cuda_python: str) -> None:
    # The suite keeps children warm (tests/conftest.py): one zygote per card environment forks each child.
    warm = [run_emulated_trials(GPT, [2, 3], card="h100", python=cuda_python) for _ in range(2)]
    zygotes = [z for z in runner_module._ZYGOTES.values() if z.poll() is None]
    runner_module.keep_children_warm(False)
    try:
        cold = run_emulated_trials(GPT, [2, 3], card="h100", python=cuda_python)
    finally:
        runner_module.keep_children_warm()
    assert zygotes, "no zygote was kept"

    def figures(run: EmulatedRun) -> list[tuple[int, int | None, tuple[tuple[int, int], ...]]]:
        return [(trial.peak_bytes, trial.reserved_bytes, trial.events) for trial in run.trials]

    # The second warm child starts from nothing the first left: its trials, traces included, are the cold one's.
    assert figures(warm[0]) == figures(warm[1]) == figures(cold)
    assert warm[0].device == cold.device
