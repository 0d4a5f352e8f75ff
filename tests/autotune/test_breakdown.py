"""Where the memory goes (autotune/measure/breakdown.py): a trial's peak by what holds it, and the step's timeline.

The truths share no code with the recorder: PyTorch's own ``MemTracker`` (torch.distributed._tools.mem_tracker) run
over the same steps of the same model built the ordinary way, category by category; the parameters' bytes summed
from the ordinary model; AdamW's state from torch's own AdamW after a real step; and the probe's real trial, whose
peak the parts must sum to.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from autotune.cli import main
from autotune.core.schemas import MAX_BYTES, MEMORY_PARTS, MemoryBreakdown, Profile
from autotune.measure.strategies import Replicated
from autotune.orchestrate.config import ProbeConfig
from autotune.orchestrate.probe import probe
from autotune.tasks.hf import LoraOptions, hf_task
from tests.autotune._hf_configs import CONFIGS, write_config

pytest.importorskip("transformers")

SEQ_LEN = 16
SIZES = (4, 5)


def fake_breakdowns(
    task: Any, strategy: Any, *, device_type: str, sizes: tuple[int, ...], limit_bytes: int
) -> list[MemoryBreakdown]:
    """The breakdown of a fake trial at each size, recorded as a probe's search records its trials
    (TrialRunner.breakdowns), on a fake meter with no budget and a model built inside each trial."""
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.trial import TrialRunner

    found = []
    for micro_batch in sizes:
        meter = FakeMeter(MAX_BYTES, device_type)
        try:
            with strategy.process_group(meter.device):
                runner = TrialRunner(task, meter, limit_bytes=limit_bytes, strategy=strategy, reuse_model=False)
                runner.breakdowns = {}
                runner(micro_batch)
                found.append(runner.breakdowns[micro_batch])
        finally:
            meter.close()
    return found


def _ordinary_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = {k: v for k, v in CONFIGS["llama"].items() if k != "model_type"}
    model = LlamaForCausalLM(LlamaConfig(**config))
    model.train()
    return model


def _tracked_peak(tracker: Any, model: Any, optimizer: Any, make_batch: Any, loss_of: Any) -> dict[Any, int]:
    """The tracker's categories at the peak of the trial's steps, run the ordinary way: two micro-batches of
    make_batch() a step, each held through its backward (as a loop over a loader holds it), loss_of(model, batch)
    halved, a step, zero_grad, twice."""
    with tracker:
        for _ in range(2):
            for _ in range(2):
                tracker.reset_mod_stats()  # one forward of the model per tracked iteration
                batch = make_batch()
                loss = loss_of(model, batch) / 2
                loss.backward()
                del batch, loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    return dict(peak)


def _llama_batch(micro_batch: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Input ids and their labels (a copy, as the hf: task's batch holds)."""
    ids = torch.randint(0, CONFIGS["llama"]["vocab_size"], (micro_batch, SEQ_LEN), generator=generator)
    return {"input_ids": ids, "labels": ids.clone()}


def _llama_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


class _NoHook:
    def remove(self) -> None:
        pass


def _memtracker_peak(micro_batch: int, lora_rank: int | None = None) -> dict[str, int]:
    """MemTracker's categories at the peak of the trial's steps (_tracked_peak) over the Llama built the ordinary
    way, AdamW. With lora_rank: peft's LoRA over the model (alpha 2r, no dropout, peft's default targets), AdamW over
    the adapters."""
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    tracker = MemTracker()
    model = _ordinary_llama()
    if lora_rank is not None:
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank, lora_dropout=0.0, task_type="CAUSAL_LM")
        model = get_peft_model(model, config)
        # MemTracker hooks every parameter's gradient, which a frozen one refuses (register_hook raises): a frozen
        # parameter has none to track, so it is marked as hooked already. MemTracker's counts are unchanged.
        for param in model.parameters():
            if not param.requires_grad:
                tracker._param_to_grad_hook_handles[param] = (_NoHook(), _NoHook())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    tracker.track_external(model, optimizer)
    generator = torch.Generator().manual_seed(0)
    peak = _tracked_peak(tracker, model, optimizer, lambda: _llama_batch(micro_batch, generator), _llama_loss)
    return {getattr(key, "name", key): value for key, value in peak.items()}


def test_the_peaks_parts_are_memtrackers_and_the_ordinary_counts(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    breakdowns = fake_breakdowns(task, Replicated(1), device_type="cpu", sizes=SIZES, limit_bytes=1 << 40)
    model = _ordinary_llama()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters())
    model(
        input_ids=torch.zeros(1, SEQ_LEN, dtype=torch.long), labels=torch.zeros(1, SEQ_LEN, dtype=torch.long)
    ).loss.backward()
    optimizer.step()
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor)
    )
    for breakdown in breakdowns:
        truth = _memtracker_peak(breakdown.micro_batch)
        parts = breakdown.parts
        print(f"m={breakdown.micro_batch}: autotune {parts} at {breakdown.peak_where}; MemTracker {truth}")
        assert sum(parts.values()) == breakdown.peak_bytes == truth["Total"]
        assert parts["trainable_parameters"] == truth["PARAM"] == param_bytes
        assert parts["buffers"] == truth["BUFFER"]
        assert parts["gradients"] == truth["GRAD"] == param_bytes  # the peak is in the second micro-batch's backward
        assert parts["optimizer_state"] == truth["OPT"] == state_bytes
        # MemTracker counts as activation what is made before the first module's backward hook fires: the loss's
        # seed gradient (one fp32 element), which autotune counts as the backward's temporary.
        seed = 4
        assert parts["activations"] + parts["inputs"] == truth["ACT"] - seed
        assert parts["temporaries"] == truth["TEMP"] + seed
        assert "backward" in breakdown.peak_where
    assert [b.fits for b in breakdowns] == [True, True]  # no limit was given: both ran whole


def test_a_task_files_parts_are_memtrackers() -> None:
    """The GPT example (examples/gpt.py:task: its own model, right-padded batches, token-mean loss) against
    MemTracker over its loop written out by hand with the file's own model, batch and loss: AdamW, two
    micro-batches a step, two steps."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from autotune.tasks.load import load_task

    task = load_task("examples/gpt.py:task")
    (breakdown,) = fake_breakdowns(task, Replicated(1), device_type="cpu", sizes=(4,), limit_bytes=1 << 40)
    torch.manual_seed(0)
    tracker = MemTracker()
    model = task.model()
    optimizer = torch.optim.AdamW(model.parameters())
    tracker.track_external(model, optimizer)
    assert task.loss is not None  # the GPT example's token-mean loss
    peak = _tracked_peak(tracker, model, optimizer, lambda: task.batch(4), task.loss)
    truth = {getattr(key, "name", key): value for key, value in peak.items()}
    parts = breakdown.parts
    print(f"gpt example m=4: autotune {parts} at {breakdown.peak_where}; MemTracker {truth}")
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(parts.values()) == breakdown.peak_bytes == truth["Total"]
    assert parts["trainable_parameters"] == truth["PARAM"] == param_bytes == parts["gradients"] == truth["GRAD"]
    assert parts["optimizer_state"] == truth["OPT"]
    seed = 4  # the loss's seed gradient (above)
    assert parts["activations"] + parts["inputs"] == truth["ACT"] - seed
    assert parts["temporaries"] == truth["TEMP"] + seed


def test_the_timeline_reaches_the_peak_at_its_event_in_phase_order(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    (breakdown,) = fake_breakdowns(task, Replicated(1), device_type="cpu", sizes=(4,), limit_bytes=1 << 40)
    assert len(breakdown.timeline) <= 250 and len(breakdown.timeline[0]) == len(MEMORY_PARTS) + 1
    at_peak = next(point for point in breakdown.timeline if point[0] == breakdown.peak_event)
    assert sum(at_peak[1:]) == breakdown.peak_bytes
    assert max(sum(point[1:]) for point in breakdown.timeline) == breakdown.peak_bytes
    names = [name for _, name in breakdown.phases]
    assert names[:3] == ["model", "inputs", "forward"] and names.count("backward") == 4 and names[-1] == "step"
    events = [index for index, _ in breakdown.phases]
    assert events == sorted(events) and events[-1] <= breakdown.events


@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated")  # peft 0.21 asks transformers 5
def test_under_lora_the_frozen_base_and_the_trained_adapters_are_apart(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model

    task = hf_task(write_config(tmp_path, "llama"), lora=LoraOptions(rank=4)).at_length(SEQ_LEN)
    (breakdown,) = fake_breakdowns(task, Replicated(1), device_type="cpu", sizes=(4,), limit_bytes=1 << 40)
    ordinary = get_peft_model(_ordinary_llama(), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM"))
    trained = sum(p.numel() * p.element_size() for p in ordinary.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for p in ordinary.parameters() if not p.requires_grad)
    assert breakdown.parts["trainable_parameters"] == trained == breakdown.parts["gradients"]
    assert breakdown.parts["frozen_parameters"] == frozen
    assert breakdown.parts["optimizer_state"] == 2 * trained + 4 * sum(
        1 for p in ordinary.parameters() if p.requires_grad
    )
    # The whole peak against PyTorch's MemTracker over the same steps of peft's model built the ordinary way.
    truth = _memtracker_peak(4, lora_rank=4)
    parts = breakdown.parts
    print(f"LoRA m=4: autotune {parts} at {breakdown.peak_where}; MemTracker {truth}")
    assert sum(parts.values()) == breakdown.peak_bytes == truth["Total"]
    assert parts["trainable_parameters"] + parts["frozen_parameters"] == truth["PARAM"] == trained + frozen
    assert parts["gradients"] == truth["GRAD"] and parts["optimizer_state"] == truth["OPT"]
    assert parts.get("buffers", 0) == truth["BUFFER"]
    seed = 4  # the loss's seed gradient: MemTracker's activation, autotune's backward temporary (above)
    assert parts["activations"] + parts["inputs"] == truth["ACT"] - seed
    assert parts["temporaries"] == truth["TEMP"] + seed


def test_a_probe_stores_the_breakdown_of_m_max_and_the_next_size_summing_to_the_real_peaks(tmp_path: Path) -> None:
    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    config = ProbeConfig(device="cpu", budget_bytes=1_000_000, headroom=0.0, breakdown=True)
    profile = probe(task, config)
    real = {t.micro_batch: t.peak_bytes for t in profile.trials if not t.fake and not t.oom}
    m_max = profile.max_micro_batch
    assert profile.breakdown is not None
    at_max, above = profile.breakdown
    assert (at_max.micro_batch, at_max.fits, above.micro_batch, above.fits) == (m_max, True, m_max + 1, False)
    assert at_max.peak_bytes == real[m_max]  # the real trial's own, recorded
    assert above.peak_bytes > profile.limit_bytes
    assert Profile.model_validate_json(profile.model_dump_json()).breakdown == profile.breakdown
    assert probe(task, ProbeConfig(device="cpu", budget_bytes=1_000_000, headroom=0.0)).breakdown is None


def test_the_datasheet_prints_the_parts_and_json_carries_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = write_config(tmp_path, "llama")
    argv = ["probe", f"hf:{where}", "--device", "cpu", "--budget", "1MB", "--seq-len", str(SEQ_LEN)]
    argv += ["--max-seq-len", str(SEQ_LEN), "--output", str(tmp_path / "p.json")]
    code = main(argv)
    done = capsys.readouterr()
    assert code == 0, done.err[-2000:]
    assert "memory at peak" in done.out and "optimizer state" in done.out and "peak of m=" in done.out
    (stored,) = json.loads((tmp_path / "p.json").read_text())
    assert [b["fits"] for b in stored["breakdown"]] == [True, False]
    quiet_code = main([*argv, "--no-breakdown"])
    quiet = capsys.readouterr()
    assert quiet_code == 0 and "memory at peak" not in quiet.out


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
def test_under_fsdp_each_part_is_the_ranks_shard(tmp_path: Path) -> None:
    """fsdp x 2: the parameters, gradients and AdamW's state are rank 0's shards (FSDP2 pads dim 0 to a multiple of
    the ranks: ceil(rows / 2) rows each), counted from the ordinary model's shapes."""
    import math

    from autotune.measure.strategies import Sharded

    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    (breakdown,) = fake_breakdowns(task, Sharded(2), device_type="cpu", sizes=(4,), limit_bytes=1 << 40)
    shard_bytes = sum(
        math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) * p.element_size() for p in _ordinary_llama().parameters()
    )
    assert breakdown.parts["trainable_parameters"] == shard_bytes
    assert breakdown.parts["gradients"] == shard_bytes
    assert breakdown.parts["optimizer_state"] == 2 * shard_bytes + 4 * len(list(_ordinary_llama().parameters()))
    assert sum(breakdown.parts.values()) == breakdown.peak_bytes
    # The whole peak against PyTorch's FSDPMemTracker over the same steps of the model sharded the ordinary way.
    truth = _fsdp_memtracker_peak(4)
    parts = breakdown.parts
    print(f"fsdp x 2, m=4: autotune {parts} at {breakdown.peak_where}; FSDPMemTracker {truth}")
    assert sum(parts.values()) == breakdown.peak_bytes == truth["Total"]
    assert parts["trainable_parameters"] == truth["Sharded Param"] == shard_bytes
    assert parts["gradients"] == truth["Sharded Grad"] and parts["optimizer_state"] == truth["OptState"]
    assert parts["buffers"] == truth["Buffer"]
    # What the mesh adds, its own part: the parameters FSDP2 gathered (the last block's, kept after forward), its
    # all-gather and reduce-scatter buffers and the unsharded gradients.
    gathered = sum(truth[k] for k in ("Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"))
    assert parts["collectives"] == gathered and truth["Unsharded Param"] > 0
    seed = 4  # the loss's seed gradient (above)
    assert parts["activations"] + parts["inputs"] == truth["Activation"] + truth["Inputs"] - seed
    assert parts["temporaries"] == truth["Temp"] + seed


def _fsdp_memtracker_peak(micro_batch: int) -> dict[str, int]:
    """FSDPMemTracker's categories at the peak, rank 0 of 2 under torch's fake process group: the Llama with each
    decoder layer a fully_shard unit (the last one kept unsharded after forward, torchtitan's way) and the root,
    AdamW, the steps of _tracked_peak."""
    import torch.distributed as dist
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = _ordinary_llama()
        layers = list(model.model.layers)
        for index, layer in enumerate(layers):
            fully_shard(layer, mesh=mesh, reshard_after_forward=index < len(layers) - 1)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())
        tracker = FSDPMemTracker(model, optimizer)
        generator = torch.Generator().manual_seed(0)
        peak = _tracked_peak(tracker, model, optimizer, lambda: _llama_batch(micro_batch, generator), _llama_loss)
    finally:
        dist.destroy_process_group()
    return {getattr(key, "value", key): value for key, value in peak.items()}


def test_under_ddp_the_buckets_are_the_mesh_part(tmp_path: Path) -> None:
    """ddp x 2 (CPU meter, torch's DDP over a fake process group): the reducer's gradient buckets, one flat copy of
    every gradient (gradient_as_bucket_view off, DDP's default), are the mesh's part; every other part is the one
    rank's job's."""
    from autotune.measure.meters import CpuMeter
    from autotune.measure.trial import TrialRunner

    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    found = {}
    for world_size in (1, 2):
        meter = CpuMeter(1 << 40)
        strategy = Replicated(world_size)
        with strategy.process_group(meter.device):
            runner = TrialRunner(task, meter, limit_bytes=1 << 40, strategy=strategy, reuse_model=False)
            runner.breakdowns = {}
            trial = runner(4)
            runner.close()
        found[world_size] = runner.breakdowns[4]
        assert found[world_size].peak_bytes == trial.peak_bytes
    grads = sum(p.numel() * p.element_size() for p in _ordinary_llama().parameters() if p.requires_grad)
    one, two = found[1].parts, found[2].parts
    assert two["collectives"] == grads == two["gradients"]
    assert {k: v for k, v in two.items() if k != "collectives"} == one and "collectives" not in one


def test_a_timeline_stored_before_the_mesh_part_reads_with_it_at_zero() -> None:
    old: dict[str, Any] = {"micro_batch": 1, "fits": True, "peak_bytes": 10, "parts": {"activations": 10}}
    old |= {"peak_event": 1, "events": 1, "phases": [[0, "forward"]]}
    old["timeline"] = [[0] + [0] * 8, [1, 0, 0, 0, 0, 0, 10, 0, 0]]  # event, then the 8 parts of before
    read = MemoryBreakdown.model_validate(old)
    assert [len(point) for point in read.timeline] == [len(MEMORY_PARTS) + 1] * 2
    assert read.timeline[1][1 + MEMORY_PARTS.index("collectives")] == 0 and read.timeline[1][-1] == 0
    # A profile checks every point's width (the parts sum to the peak, each point has every part).
    from autotune.core.schemas import _parts_sum_to_peak

    assert _parts_sum_to_peak(read) is read
    with pytest.raises(ValueError, match="each timeline point"):
        _parts_sum_to_peak(MemoryBreakdown.model_validate({**old, "timeline": [[0, 1, 2]]}))


def test_an_estimate_breaks_down_its_own_fake_trials(tmp_path: Path) -> None:
    from autotune.orchestrate.config import EstimateConfig
    from autotune.orchestrate.estimate import estimate

    task = hf_task(write_config(tmp_path, "llama")).at_length(SEQ_LEN)
    setup = ProbeConfig(budget_bytes=1_000_000, headroom=0.0, breakdown=True)
    profile = estimate(task, EstimateConfig(probe=setup, device_kind="cpu"))
    fake = {t.micro_batch: t.peak_bytes for t in profile.trials if t.fake}
    assert profile.breakdown is not None and profile.breakdown[0].micro_batch == profile.max_micro_batch
    assert profile.breakdown[0].peak_bytes == fake[profile.max_micro_batch]
    assert [b.fits for b in profile.breakdown] == [True, False]


@pytest.mark.parametrize(
    ("workers", "mesh"), [("0", []), ("1", ["--world-size", "2", "--tp", "2"])], ids=["here", "tp"]
)
def test_an_estimate_over_lengths_breaks_down_each_lengths_own_trials(
    workers: str, mesh: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`autotune estimate --seq-len 8,16`: each length's datasheet has the breakdown of its m_max and the next size,
    summing to that length's own fake trials: without lanes, and with a lane under a mesh (run in the run's group)."""
    where = write_config(tmp_path, "llama")
    output = tmp_path / "lengths.json"
    argv = ["estimate", f"hf:{where}", "--device-kind", "cpu", "--budget", "1MB", "--headroom", "0", *mesh]
    code = main([*argv, "--seq-len", "8,16", "--max-seq-len", "16", "--workers", workers, "--output", str(output)])
    assert code == 0, capsys.readouterr().err[-2000:]
    stored = json.loads(output.read_text())
    assert [p["seq_len"] for p in stored] == [8, 16]
    for profile in stored:
        fake = {t["micro_batch"]: t["peak_bytes"] for t in profile["trials"] if t["fake"]}
        m_max = profile["max_micro_batch"]
        at_max, above = profile["breakdown"]
        assert (at_max["micro_batch"], at_max["fits"], at_max["peak_bytes"]) == (m_max, True, fake[m_max])
        # The next size's trial stopped at the budget (its figure is where it stopped): its parts are up to there.
        assert (above["micro_batch"], above["fits"]) == (m_max + 1, False) and above["peak_bytes"] > 1_000_000
        assert all(sum(b["parts"].values()) == b["peak_bytes"] for b in profile["breakdown"])


def test_a_cards_parts_add_the_reserve_and_the_outside_bytes() -> None:
    from autotune.measure.breakdown import with_card_parts

    live = MemoryBreakdown.model_validate(
        {"micro_batch": 2, "fits": True, "peak_bytes": 100, "parts": {"activations": 60, "gradients": 40},
         "peak_event": 3, "events": 5, "timeline": [[0] + [0] * len(MEMORY_PARTS)], "phases": [[0, "forward"]]}
    )  # fmt: skip
    card = with_card_parts(live, reserved_bytes=2 << 20, outside_bytes=900, fits=False)
    assert card is not None and card.peak_bytes == (2 << 20) + 900 == sum(card.parts.values())
    assert card.parts == {
        "gradients": 40,
        "activations": 60,
        "allocator_reserve": (2 << 20) - 100,
        "outside_allocator": 900,
    }
    assert list(card.parts) == [p for p in MEMORY_PARTS if p in card.parts] and card.fits is False
    # Reserved bytes below the live peak cannot come from a replay of the same storages: no breakdown.
    assert with_card_parts(live, reserved_bytes=99, outside_bytes=0, fits=True) is None


def test_a_recorded_trials_model_dies_with_its_runner() -> None:
    """ModTracker's backward hooks hold the graph they hook (torch's closure keeps the grad_fns), down to the leaves:
    unremoved, a recorded trial's parameters outlived its runner (FSDP2's host shards stayed live into the next
    runner's trials). The recording removes them when it ends."""
    import gc
    import weakref

    from autotune.measure.meters import CpuMeter
    from autotune.measure.trial import TrialRunner
    from examples.gpt import GPTConfig, make_task

    task = make_task(GPTConfig(vocab_size=64, seq_len=16, d_model=16, n_heads=2, n_layers=2), name="gpt-tiny")
    meter = CpuMeter(1 << 30)
    strategy = Replicated(1)
    with strategy.process_group(meter.device):
        runner = TrialRunner(task, meter, limit_bytes=1 << 30, strategy=strategy)
        runner.breakdowns = {}
        runner(2)
        assert 2 in runner.breakdowns
        weights = [weakref.ref(p) for p in runner._model.parameters()]  # type: ignore[union-attr]
        runner.close()
    gc.collect()
    assert weights and not [w for w in weights if w() is not None]
