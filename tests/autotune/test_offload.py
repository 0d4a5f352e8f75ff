"""--offload (autotune/measure/offload.py): the device's bytes against the CPU allocator's own count of the model
offloaded the ordinary way, the host's against what that model put on the host, the refusals, the fingerprint,
and FSDP2's CPUOffloadPolicy over a fake process group of two.

The truth (tests/autotune/_allocator_truth.py counts the allocator; the hooks below are written out here and
share nothing with the project): every block's forward runs under ``torch.autograd.graph.saved_tensors_hooks``
with save_on_cpu's pack and unpack as they run from a card: the pack copies the saved tensor to host memory, the
unpack copies it back to the device. On the CPU torch's own ``save_on_cpu`` returns the tensor itself
(``tensor.cpu()``), so the host copy is made where the device's allocator cannot see it (a numpy array, numpy's
memory) and the unpack is a copy the allocator makes, as a card's ``tensor.to(device)`` is.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

from autotune.cli import main
from autotune.core.consistency import check_profile
from autotune.core.errors import AutotuneError, ExitCode
from autotune.measure.meters import CpuMeter
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import TrialRunner
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.fingerprint import task_fingerprint
from examples.gpt import GPT, Block, GPTConfig, make_task
from tests.autotune._allocator_truth import allocator_peak_bytes
from tests.autotune._host_copies import HostCopies, offload_blocks

MiB = 1 << 20
TINY = GPTConfig(vocab_size=64, seq_len=32, d_model=32, n_heads=2, n_layers=4)
REPO = Path(__file__).resolve().parents[2]


def offloaded(model: nn.Module, copies: HostCopies) -> nn.Module:
    """model with every block's forward under the hooks."""
    offload_blocks(model.blocks, copies)
    return model


def offloaded_gpt(copies: HostCopies) -> nn.Module:
    return offloaded(GPT(TINY), copies)


def test_activations_offload_is_exact_against_the_allocator_at_m_max_and_past_it() -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), shard_classes=(Block,))
    budget = 2 * MiB
    config = ProbeConfig(device="cpu", budget_bytes=budget, offload="activations", breakdown=True)
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert measured.offload == "activations" and measured.tags["offload"] == "activations"
    limit = int(budget * (1 - config.headroom))
    # The same model without the hooks does not fit at m_max: the blocks' activations left the device.
    assert allocator_peak_bytes(task, m_max) > limit
    truth = {}
    for m in (m_max, m_max + 1):
        copies = HostCopies()
        device_peak = allocator_peak_bytes(task, m, model=lambda copies=copies: offloaded_gpt(copies))
        truth[m] = (device_peak, copies.peak_bytes)
    assert truth[m_max][0] <= limit < truth[m_max + 1][0]
    real = {t.micro_batch: (t.peak_bytes, t.host_peak_bytes) for t in measured.trials if not t.fake}
    assert real[m_max] == truth[m_max]
    assert real[m_max + 1] == truth[m_max + 1]
    assert measured.host_peak_bytes == truth[m_max][1]
    assert any("host and device are one memory" in w for w in measured.warnings)
    # The host's peak broken down: all of it the packed copies, the truth's host peak.
    assert [(b.micro_batch, b.host_parts) for b in measured.breakdown or []] == [
        (m, {"activations": truth[m][1]}) for m in (m_max, m_max + 1)
    ]
    from autotune.cli.report import breakdown_lines

    printed = breakdown_lines(measured)
    host = printed.index("  host at its peak (--offload)")
    assert printed[host + 1].split()[0] == "activations" and printed[host + 2].split()[:2] == ["host", "total"]


def test_offload_and_a_policy_compose_block_by_block() -> None:
    """every-2 checkpoints blocks 0 and 2 (they save nothing through the offload's hooks: checkpoint's own are
    innermost); blocks 1 and 3 offload. The truth wraps them so, with torch's checkpoint_wrapper."""
    task = dataclasses.replace(
        make_task(TINY, name="gpt-tiny"), shard_classes=(Block,), activation_checkpointing="every-2"
    )
    budget = 2 * MiB
    measured = probe(task, ProbeConfig(device="cpu", budget_bytes=budget, offload="activations"))
    m_max = measured.max_micro_batch

    def ordinary(copies: HostCopies) -> nn.Module:
        model = GPT(TINY)
        for index in (0, 2):
            model.blocks[index] = checkpoint_wrapper(model.blocks[index], checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        return offloaded(model, copies)

    real = {t.micro_batch: (t.peak_bytes, t.host_peak_bytes) for t in measured.trials if not t.fake}
    # torch.utils.checkpoint keeps the CPU generator's state per checkpointed call (made below the dispatcher,
    # where the meter does not see it; host memory on a card): two blocks' worth.
    kept = 2 * torch.get_rng_state().nbytes
    for m in (m_max, m_max + 1):
        copies = HostCopies()
        device_peak = allocator_peak_bytes(task, m, model=lambda copies=copies: ordinary(copies))
        assert (device_peak - kept, copies.peak_bytes) == real[m]
    assert real[m_max][0] <= int(budget * 0.9) < real[m_max + 1][0]


def test_a_host_budget_refuses_the_sizes_whose_host_bytes_exceed_it() -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), shard_classes=(Block,))
    config = ProbeConfig(device="cpu", budget_bytes=2 * MiB, offload="activations")
    free = probe(task, config)
    host_at = {t.micro_batch: t.host_peak_bytes for t in free.trials if not t.fake}
    m_free = free.max_micro_batch
    # A host budget that the free answer's host bytes cross: a smaller size decides.
    host_budget = host_at[m_free] - 1
    bound = probe(task, dataclasses.replace(config, host_budget_bytes=host_budget))
    assert bound.max_micro_batch < m_free
    assert bound.host_budget_bytes == host_budget
    assert bound.host_peak_bytes is not None and bound.host_peak_bytes <= host_budget
    over = [t for t in bound.trials if not t.fake and t.host_peak_bytes and t.host_peak_bytes > host_budget]
    assert over and not any(t.fits for t in over)
    check_profile(bound)  # the store takes it: fits agrees with the host budget


def test_the_fingerprint_tells_offloaded_from_plain() -> None:
    task = make_task(TINY, name="gpt-tiny")
    plain = task_fingerprint(task)
    activations = task_fingerprint(dataclasses.replace(task, offload="activations"))
    params = task_fingerprint(dataclasses.replace(task, offload="params"), strategy="fsdp", world_size=2)
    assert len({plain, activations, params, task_fingerprint(task, strategy="fsdp", world_size=2)}) == 4


def _plain_trials(task: Any, sizes: tuple[int, ...], world_size: int) -> dict[int, Any]:
    """The job without offload, trial by trial at sizes (rank 0 of fsdp over a fake group of world_size)."""
    meter = CpuMeter(64 * MiB)
    strategy = make_strategy("fsdp", world_size)
    with strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=64 * MiB, strategy=strategy)
        try:
            return {m: runner(m) for m in sizes}
        finally:
            runner.close()


def test_params_offload_under_fsdp_keeps_the_shards_on_the_host() -> None:
    task = dataclasses.replace(make_task(TINY, name="gpt-tiny"), shard_classes=(Block,))
    config = ProbeConfig(
        device="cpu", budget_bytes=2 * MiB, strategy="fsdp", world_size=2, offload="params", breakdown=True
    )
    measured = probe(task, config)
    m_max = measured.max_micro_batch
    assert measured.offload == "params" and measured.tags["offload"] == "params"
    assert measured.fingerprint != task_fingerprint(task, strategy="fsdp", world_size=2)
    sizes = (m_max - 1, m_max)
    plain = _plain_trials(task, (*sizes, m_max + 1), 2)
    offloaded = _plain_trials(dataclasses.replace(task, offload="params"), (m_max - 1,), 2)
    real = {t.micro_batch: t for t in measured.trials if not t.fake} | offloaded
    # What left the device is what the step holds without offload (rank 0's shard of the weights, their
    # gradients, AdamW's moments and the step's own): the host's whole figure, the same at every m, and the
    # step's phase on the device is empty (the step runs on the CPU).
    for m in sizes:
        assert real[m].host_peak_bytes == plain[m].step_bytes
        assert real[m].step_bytes == 0
    moved = {m: plain[m].peak_bytes - real[m].peak_bytes for m in sizes}
    shard_bytes = sum(p.numel() * p.element_size() for p in GPT(TINY).parameters()) // 2
    assert moved[m_max - 1] == moved[m_max] >= 4 * shard_bytes
    limit = int(config.budget_bytes * (1 - config.headroom))  # type: ignore[operator]
    assert real[m_max].fits and not real[m_max + 1].fits
    assert plain[m_max + 1].peak_bytes - moved[m_max] > limit
    assert measured.host_peak_bytes == real[m_max].host_peak_bytes
    assert any("--offload params on the CPU" in w for w in measured.warnings)
    # The host's peak at m_max by part, against counts of the model built the ordinary way: rank 0's shard of each
    # parameter (FSDP2 cuts dim 0 in 2, the first rank taking the larger half) and of its gradient, and the state
    # torch's own AdamW holds after a step over tensors of those shapes; the CPU step's own temporaries the rest.
    at_max = next(b for b in measured.breakdown or [] if b.micro_batch == m_max)
    shards = [torch.zeros(-(-p.shape[0] // 2), *p.shape[1:], requires_grad=True) for p in GPT(TINY).parameters()]
    for shard in shards:
        shard.grad = torch.zeros_like(shard)
    ordinary = torch.optim.AdamW(shards, lr=1e-3)
    ordinary.step()
    state = sum(t.untyped_storage().nbytes() for held in ordinary.state.values() for t in held.values())
    rank_shards = sum(shard.numel() * shard.element_size() for shard in shards)
    assert at_max.host_peak_bytes == real[m_max].host_peak_bytes
    parts = dict(at_max.host_parts or {})
    assert parts.pop("trainable_parameters") == parts.pop("gradients") == rank_shards
    assert parts.pop("optimizer_state") == state
    assert list(parts) == ["temporaries"] and 0 < parts["temporaries"] < rank_shards, parts


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--offload", "params"], "--offload params with --strategy ddp: it is FSDP2's CPUOffloadPolicy"),
        (["--offload", "weights"], "argument --offload: invalid choice: 'weights'"),
        (["--host-budget", "1GiB"], "--host-budget without --offload"),
        (["--offload", "activations", "--host-budget", "-1"], "argument --host-budget"),
    ],
)
def test_bad_offload_input_is_one_line_exit_2_and_stores_nothing(
    flags: list[str], said: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    output = tmp_path / "profile.json"
    argv = ["probe", "examples/gpt.py:task", "--device", "cpu", "--budget", "2MiB", "--output", str(output)]
    try:
        code = main([*argv, *flags])
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == ExitCode.USAGE
    assert len(lines) == 1 and lines[0].startswith("autotune: error: ") and said in lines[0]
    assert not output.exists() and captured.out == ""


def test_the_config_refuses_what_the_flags_refuse() -> None:
    with pytest.raises(AutotuneError, match="--offload params with --strategy ddp"):
        ProbeConfig(device="cpu", budget_bytes=MiB, offload="params").validate()
    with pytest.raises(AutotuneError, match="--host-budget without --offload"):
        ProbeConfig(device="cpu", budget_bytes=MiB, host_budget_bytes=MiB).validate()


def test_a_host_budget_on_an_estimate_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    output = tmp_path / "profile.json"
    argv = ["estimate", "examples/gpt.py:task", "--budget", "2GiB", "--offload", "activations", "--host-budget", "1GiB"]
    try:
        code = main([*argv, "--output", str(output)])
    except SystemExit as exc:
        code = int(exc.code or 0)
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == ExitCode.USAGE and len(lines) == 1
    assert "--host-budget applies to autotune probe" in lines[0] and not output.exists()


def test_the_doctests_hold() -> None:
    import doctest

    from autotune.measure import offload
    from autotune.measure.meters import host

    for module in (offload, host):
        failures, tried = doctest.testmod(module)
        assert tried > 0 and failures == 0, module.__name__


def test_the_host_budget_decides_the_longest_length_too() -> None:
    """Under --offload activations the longest length at m = 1 is searched by real trials that keep the host budget
    as m_max's do: the length found keeps at most the budget on the host, the next one more."""
    from autotune.orchestrate.lengths import probe_lengths
    from examples.gpt import make_seq_task

    LONGEST = 128  # noqa: N806  # the cap of the length search, the model's own maximum
    task = dataclasses.replace(
        make_seq_task(GPTConfig(vocab_size=64, seq_len=LONGEST, d_model=32, n_heads=2, n_layers=4)),
        shard_classes=(Block,),
    )
    config = ProbeConfig(device="cpu", budget_bytes=2 * MiB, offload="activations", throughput=False)
    free = probe_lengths(task, config, [64], max_seq_len=LONGEST).surface
    assert free is not None and free.longest is not None
    free_longest = free.longest.seq_len

    def host_bytes(seq_len: int) -> int:
        meter = CpuMeter(64 * MiB)
        offloaded = dataclasses.replace(task.at_length(seq_len), offload="activations")
        runner = TrialRunner(offloaded, meter, limit_bytes=64 * MiB)
        try:
            host = runner(1).host_peak_bytes
        finally:
            runner.close()
        assert host is not None
        return host

    host_budget = (host_bytes(free_longest // 2) + host_bytes(free_longest)) // 2
    bound = probe_lengths(task, dataclasses.replace(config, host_budget_bytes=host_budget), [64], max_seq_len=LONGEST)
    assert bound.surface is not None and bound.surface.longest is not None
    longest = bound.surface.longest.seq_len
    assert longest < free_longest
    assert host_bytes(longest) <= host_budget < host_bytes(longest + 1)
    assert "over --host-budget" in bound.surface.longest.note


def test_a_backward_that_ran_out_lets_go_of_its_graph() -> None:
    """autograd's engine keeps a failed backward's remaining work, and every tensor its graph saved, until the next
    backward: release_failed_backward drains it."""
    import weakref

    from autotune.measure.oom import release_failed_backward

    class Fails(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x * 2

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("out of memory (in the backward)")

    saved = torch.ones(64)
    kept = weakref.ref(saved)
    leaf = torch.ones(64, requires_grad=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        (Fails.apply(saved * leaf) * leaf).sum().backward()
    del saved
    release_failed_backward()
    assert kept() is None


def test_a_trial_after_one_that_ran_out_in_its_backward_reads_its_own_host_bytes() -> None:
    """--offload activations: the packed host copies of a trial that ran out in its backward stayed live into the
    next trial, whose host peak read them (m = 6 after m = 12 read 2,385,920 B where a fresh trial reads 1,150,464)."""
    from tests.autotune.test_compile import make_task as tiny_gpt_task

    task = tiny_gpt_task(offload="activations")
    budget = 1_400_000  # m = 6 fits (1,116,740 B), m = 12 (1,830,980 B) runs out in its backward

    def trials(*sizes: int) -> list[Any]:
        runner = TrialRunner(task, CpuMeter(budget), limit_bytes=budget, strategy=make_strategy("ddp", 1))
        try:
            return [runner(m) for m in sizes]
        finally:
            runner.close()

    fresh = trials(6)[0]
    over, after = trials(12, 6)
    assert over.oom and fresh.fits
    assert (after.peak_bytes, after.host_peak_bytes) == (fresh.peak_bytes, fresh.host_peak_bytes)
