"""The depth shortcut (autotune/search/depth.py) against the whole walk (``--full-walk``): the card's search over
models of 5 identical blocks (7 for a policy of period 2), walked as 2, 3 and 4 of them and the rest repeated (the
product waits for 8 blocks, where the shortcut starts to pay; the arithmetic is the same), gives every trial's figures
(reserved, allocated, the live phases), the breakdown and the warnings of the search that walks all 8, to the byte.
The models of bench/, small: Llama under fsdp with op-level checkpointing, ddp without, fsdp x tp, fsdp x cp, GPT-2
checkpointed every 2 blocks, a Mixtral-shaped mixture of experts (the suite's search stops at m = 2 and leaves the
8-way op-level case to the emulated cards; bench/depth_cases.py runs every case to m = 3), a search whose live bytes
cross the card (the whole walk rebuilds its model after that OOM, and so do the cut walks); the CNN (blocks that
differ) and an offload walk every block, and the datasheet says why. The fake trials run on the CPU here (the
arithmetic is the device's own; CUDA's streams and kernel temporaries are in the emulated card's case at the end).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from autotune.core.mesh import Mesh
from autotune.core.setup import JobSetup
from autotune.measure.strategy_choice import make_strategy
from autotune.measure.trial import frozen_heap
from autotune.search import depth
from autotune.search.presearch import fake_strategy
from autotune.search.reserved import ReservedSearch, reserved_search
from autotune.tasks.hf import hf_task
from autotune.tasks.load import load_task
from autotune.tasks.task import ProbeTask
from tests.autotune._hf_configs import write_config

pytest.importorskip("transformers")
pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed"),
    pytest.mark.filterwarnings("ignore:FSDP2-wrapped module"),
]
GiB = 1 << 30
BLOCKS = 5
DEPTH = {"num_hidden_layers": BLOCKS}
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 256,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": BLOCKS,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 64,
}


def _task(tmp_path: Path, arch: str, setup: JobSetup, **config: Any) -> ProbeTask:
    if arch == "mixtral":
        where = tmp_path / "mixtral"
        where.mkdir(exist_ok=True)
        import json

        (where / "config.json").write_text(json.dumps({**MIXTRAL, **config}))
    else:
        where = write_config(tmp_path, arch, **(config or DEPTH))  # GPT-2's n_layer is num_hidden_layers too
    return hf_task(where).with_setup(setup).at_length(16)


def _search(
    task: ProbeTask, setup: JobSetup, *, shortcut: bool, budget_bytes: int = 8 * GiB, extra: tuple[int, ...] = (3,)
) -> ReservedSearch:
    strategy = fake_strategy(make_strategy(setup.strategy, setup.world_size, setup.mesh))
    with strategy.process_group(torch.device("cpu")), frozen_heap():
        return reserved_search(
            task,
            device_type="cpu",
            device_name="cpu",
            budget_bytes=budget_bytes,
            limit_bytes=budget_bytes,
            outside_bytes=0,
            workspace_bytes=(),
            strategy=strategy,
            max_micro_batch=2,
            multiple_of=1,
            extra_sizes=extra,
            breakdown=True,
            depth_shortcut=shortcut,
        )


def _figures(found: ReservedSearch) -> dict[str, Any]:
    """Everything the search found but the seconds it took and the datasheet's line on how it walked."""
    return {
        "max_micro_batch": found.max_micro_batch,
        "trials": {m: t.model_dump(exclude={"seconds"}) for m, t in found.trials.items()},
        "breakdowns": {m: b.model_dump() for m, b in found.breakdowns.items()},
        "fit": found.fit,
        "no_fit": found.no_fit,
        "warnings": [w for w in found.warnings if not w.startswith("depth:")],
    }


def _setup(strategy: str = "fsdp", world_size: int = 8, mesh: Mesh | None = None, **task: Any) -> JobSetup:
    return JobSetup.model_construct(strategy=strategy, world_size=world_size, mesh=mesh or Mesh(), **task)


CASES = {
    "llama fsdp 8, op": ("llama", _setup(precision="bf16", activation_checkpointing="op"), {}),
    "llama ddp, none": ("llama", _setup("ddp", 1, activation_checkpointing="none"), {}),
    "llama fsdp 4 x tp 2, full": ("llama", _setup(mesh=Mesh(tp=2), activation_checkpointing="full"), {}),
    "llama fsdp 4 x cp 2, op": ("llama", _setup(mesh=Mesh(cp=2), activation_checkpointing="op"), {}),
    "gpt2 fsdp 2, every-2": ("gpt2", _setup("fsdp", 2, activation_checkpointing="every-2"), {"n_layer": 7}),
    "mixtral fsdp 8, full": ("mixtral", _setup(activation_checkpointing="full"), {}),
}
# The suite's cases, each searched over m = 1 and 2 (the second size carries the first's template): the 8-way
# op-level case runs on the emulated cards below. bench/depth_cases.py runs every case up to m = 3.
SUITE_CASES = ("llama ddp, none", "llama fsdp 4 x tp 2, full", "llama fsdp 4 x cp 2, op", "gpt2 fsdp 2, every-2",
               "mixtral fsdp 8, full")  # fmt: skip


@pytest.fixture(autouse=True)
def _few_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shortcut from 5 blocks on, not 8: small models keep the suite quick."""
    monkeypatch.setattr(depth, "MIN_BLOCKS", BLOCKS)


@pytest.mark.parametrize("case", SUITE_CASES)
def test_the_shortcut_reads_what_the_whole_walk_reads(tmp_path: Path, case: str) -> None:
    arch, setup, config = CASES[case]
    task = _task(tmp_path, arch, setup, **config)
    short = _search(task, setup, shortcut=True, extra=())
    whole = _search(task, setup, shortcut=False, extra=())
    said = [w for w in short.warnings if w.startswith("depth:")]
    assert len(said) == 1 and " identical " in said[0], said  # the shortcut was taken
    assert _figures(short) == _figures(whole)
    assert short.breakdowns  # the breakdown was compared, not two empty ones


def test_a_trial_past_the_card_and_the_rebuild_after_it(tmp_path: Path) -> None:
    """A budget the live bytes of m = 3 cross: the whole walk's trial stops there (its peak the live bytes when they
    crossed), and its runner drops the model an OOM stopped mid-step, building it again inside the next trial (m = 4);
    the cut walks do too."""
    setup = _setup("ddp", 1, activation_checkpointing="none")
    task = _task(tmp_path, "llama", setup)
    roomy = _search(task, setup, shortcut=False)
    budget = (_live_peak(roomy, 2) + _live_peak(roomy, 3)) // 2
    short = _search(task, setup, shortcut=True, budget_bytes=budget, extra=(3, 4))
    whole = _search(task, setup, shortcut=False, budget_bytes=budget, extra=(3, 4))
    assert whole.trials[3].oom and whole.trials[4].oom  # m = 4 builds the model again, inside its trial
    assert _figures(short) == _figures(whole)
    assert any(" identical " in w for w in short.warnings if w.startswith("depth:"))


def _live_peak(found: ReservedSearch, micro_batch: int) -> int:
    """The live bytes' peak of a trial: its breakdown's parts but what the card adds (the allocator's reserve, the
    memory outside it)."""
    parts = found.breakdowns[micro_batch].parts
    return sum(parts.values()) - parts.get("allocator_reserve", 0) - parts.get("outside_allocator", 0)


@pytest.mark.parametrize(
    ("spec", "offload", "why"),
    [
        ("examples/cnn.py:task", "none", "it has no repeated blocks"),
        ("llama", "activations", "--offload activations"),
        ("llama-ddp-2", "none", "DDP's gradient buckets"),
    ],
)
def test_where_the_repetition_cannot_be_shown_every_block_is_walked(
    tmp_path: Path, spec: str, offload: str, why: str
) -> None:
    setup = _setup("ddp", 2 if spec.endswith("ddp-2") else 1, offload=offload)
    if spec.endswith(":task"):
        task = load_task(spec).with_setup(setup)
    else:
        task = _task(tmp_path, spec.split("-")[0], setup)
    found = _search(task, setup, shortcut=True)
    said = [w for w in found.warnings if w.startswith("depth:")]
    assert len(said) == 1 and said[0].startswith("depth: every block walked") and why in said[0], said


def test_on_emulated_cards_every_figure_is_the_full_walks(tmp_path: Path, cuda_python: str) -> None:
    """CUDA's semantics (FSDP2's collectives on streams of their own, the kernels' temporaries, the cuDNN attention of
    the card) on an emulated H100 and H200 in one run (`--gpu h100,h200`): 8 blocks walked as 2, 3 and 4, each card's
    profile the same as `--full-walk`'s, the H200's search reading the walks the H100's made (one architecture). One
    size per card (the CPU cases above carry the walks learnt at one size into the next). The step whose time each card
    predicts is recorded at cuts to 3, 4 and 5 blocks and made at 8, and predicts what the whole model's record does."""
    import json

    from autotune.cli import main

    where = write_config(tmp_path, "llama", num_hidden_layers=8)
    common = [
        "estimate", f"hf:{where}", "--gpu", "h100,h200", "--strategy", "fsdp", "--world-size", "8", "--precision",
        "bf16", "--ac", "op", "--seq-len", "16", "--max-micro-batch", "1", "--micro-batches", "1", "--target-batch",
        "16",
    ]  # fmt: skip
    profiles = {}
    for walk in ("short", "full"):
        out = tmp_path / f"{walk}.json"
        assert main([*common, *(["--full-walk"] if walk == "full" else []), "--output", str(out)]) == 0
        profiles[walk] = json.loads(out.read_text())
    short, full = profiles["short"], profiles["full"]
    assert [p["device"]["name"] for p in short] == ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    for one, other in zip(short, full, strict=True):
        # The predicted step time, of m_max and the plan (1 x 2 x 8), from the step recorded at cuts to 3, 4 and 5
        # blocks, and from the whole model's (autotune/search/depth_steps.py).
        keys = ("max_micro_batch", "breakdown", "fit", "throughput")
        assert {k: one[k] for k in keys} == {k: other[k] for k in keys}
        assert [{k: v for k, v in t.items() if k != "seconds"} for t in one["trials"]] == [
            {k: v for k, v in t.items() if k != "seconds"} for t in other["trials"]
        ]
    lines = [next(w for w in p["warnings"] if w.startswith("depth:")) for p in short]
    assert " identical " in lines[0] and "at m = 1" in lines[0]
    assert "that another card's search made" in lines[1]  # every size the H200 asked, the H100 had walked
    for profile in short:
        assert profile["throughput"] and all(t["predicted"] for t in profile["throughput"])
        assert (
            "depth: the step whose time is predicted recorded from cuts to 3, 4, 5 of the 8 blocks"
            in profile["warnings"]
        )
