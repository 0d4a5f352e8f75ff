"""Which job dimensions compose: one table of the compositions autotune refuses, and one refusal function that the
CLI (before any task loads), the configs (before any trial) and the strategies (where a library would fail) all ask
(docs/design.md, "One job setup").

Every pair of dimensions composes unless a rule below says why not, in one line naming both flags:

    >>> composition_refusal(Dimensions(world_size=2, cp=2, compile="default")).partition(":")[0]
    '--cp 2 with --compile default'
    >>> composition_refusal(Dimensions(strategy="fsdp", world_size=4, tp=2)) is None
    True

A field left at its "unknown" value (``lora`` None, ``optimizer_library`` None) is one the asker does not know yet
(the CLI before the optimizer's spec is resolved): the rules that read it wait for an asker that does know it.
Torch-free: the CLI and the server may ask without importing torch.

Some rows read the model: a mesh the model cannot take (``--tp 3`` on 4 heads, ``--pp 4`` on 2 blocks, ``--cp`` on
a model torch's context parallelism does not run, torchtitan's plan on a family it has no names for). They read a
:class:`ModelShape` (heads, key/value heads, blocks, ...), which an asker that has the task reads cheaply
(``autotune.measure.model_shape``: a meta build) before any trial; without one (``model`` None) they wait:

    >>> llama = ModelShape(name="llama-107K", heads=4, kv_heads=2, blocks=2, family="llama", causal_lm_sdpa=True)
    >>> composition_refusal(Dimensions(world_size=3, tp=3, model=llama)).partition(":")[0]
    "--tp 3 on the model's 4 attention heads (llama-107K)"
    >>> composition_refusal(Dimensions(world_size=3, tp=3)) is None
    True
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from autotune.core.errors import AutotuneError
from autotune.core.mesh import Mesh

__all__ = [
    "COMPOSITIONS",
    "Dimensions",
    "ModelShape",
    "Rule",
    "composition_refusal",
    "composition_table",
    "refuse_composition",
]

Why = Literal["not measured yet", "a library's limit", "meaningless"]


@dataclass(frozen=True)
class ModelShape:
    """What the mesh rows read of a model: its name (the task's), attention heads and key/value heads (None: no
    config says them), the blocks a pipeline cuts between (None: not one list of them), its hf: config's model type
    (None: no hf: config), whether torch's context parallelism runs it (an hf: causal LM with SDPA attention), and
    the plan names its family has module names for (``--tp-plan``)."""

    name: str
    heads: int | None = None
    kv_heads: int | None = None
    blocks: int | None = None
    family: str | None = None
    causal_lm_sdpa: bool = False
    tp_plans: tuple[str, ...] = ()
    # The routed experts of a mixture of experts in transformers' fused layout (None: a dense model, or experts
    # in another layout, which --ep cannot shard).
    experts: int | None = None

    def text(self) -> str:
        """How a refusal names the model: its task's name, and its family where it has one."""
        return self.name if self.family is None or self.family in self.name else f"{self.name}, {self.family}"


@dataclass(frozen=True)
class Dimensions:
    """The dimensions of one job a composition rule reads: strategy, W, the mesh's tp / pp / cp, compile, offload
    (and whether a host budget is given), the memory policy, QLoRA's quantization and whether LoRA is on, the
    optimizer's spec and library, precision, the weights' dtype and the loss."""

    strategy: str = "ddp"
    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    compile: str | None = None
    offload: str = "none"
    host_budget: bool = False
    activation_checkpointing: str = "none"
    quantize: str | None = None
    # None: not known to the asker (the rule waits for one that knows).
    lora: bool | None = None
    optimizer: str | None = None
    optimizer_library: str | None = None
    precision: str | None = None
    weights_dtype: str | None = None
    # How the causal LM computes its loss (autotune/core/loss_names.py): plain, chunked:N or fused-linear.
    lm_loss: str = "plain"
    # The lengths the job runs at (--seq-len, or the task's own), the tp plan by name, and the model's shape: None
    # and () where the asker does not know them (the rows that read them wait).
    seq_lens: tuple[int, ...] = ()
    tp_plan: str | None = None
    model: ModelShape | None = None

    @classmethod
    def of(cls, strategy: str, world_size: int, mesh: Mesh | None = None, **more: object) -> Dimensions:
        """A strategy's dimensions: its name, W and mesh (the rest as given)."""
        mesh = mesh or Mesh()
        return cls(strategy=strategy, world_size=world_size, tp=mesh.tp, pp=mesh.pp, cp=mesh.cp, ep=mesh.ep, **more)  # type: ignore[arg-type]

    @property
    def data_parallel(self) -> int:
        """D: the replicas, W / (tp x pp x cp)."""
        return max(1, self.world_size // max(1, self.tp * self.pp * self.cp))

    @property
    def trivial_mesh(self) -> bool:
        return self.tp == self.pp == self.cp == self.ep == 1

    def replace(self, **changes: object) -> Dimensions:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Rule:
    """One refused composition: the two flags it names, why (not measured yet, a library's limit, or a
    composition that means nothing), when it applies, and the one line it says (``flags`` with their values, then
    ``reason``)."""

    first: str
    second: str
    why: Why
    applies: Callable[[Dimensions], bool]
    flags: Callable[[Dimensions], str]
    reason: str

    def message(self, dims: Dimensions) -> str:
        return f"{self.flags(dims)}: {self.reason}"


# The libraries whose optimizer cannot step DTensor parameters (fsdp, tp), and why.
_BNB_NO_DTENSOR = (
    "bitsandbytes' update ops (bitsandbytes.optimizer_update_32bit, optimizer_update_8bit_blockwise) have no "
    "DTensor sharding rule, so its step fails on sharded parameters, in the job as here; use --strategy ddp "
    "(measured exact) or a torch.optim class"
)


def _sharded(d: Dimensions) -> str:
    return "--strategy fsdp" if d.strategy == "fsdp" else f"--tp {d.tp}"


# The table, in the order a refusal is looked for (the first that applies is said). docs/meshes.md prints it
# (composition_table) and a test keeps the page equal to it.
COMPOSITIONS: tuple[Rule, ...] = (
    Rule(
        "--cp",
        "--compile",
        "a library's limit",
        lambda d: d.cp > 1 and d.compile is not None,
        lambda d: f"--cp {d.cp} with --compile {d.compile}",
        "torch.compile cannot trace context parallelism's ring attention in this torch (dynamo stops on the "
        "DeviceMesh it holds: an opaque object without '_flatten_rank_map'); probe --cp eager, or --compile "
        "without --cp",
    ),
    Rule(
        "--strategy fsdp",
        "--world-size 1",
        "meaningless",
        lambda d: d.strategy == "fsdp" and d.world_size < 2,
        lambda d: f"--strategy fsdp with --world-size {d.world_size}",
        "FSDP shards over at least 2 ranks; one rank holding the whole model is --strategy ddp",
    ),
    Rule(
        "--strategy fsdp",
        "a mesh leaving one shard",
        "meaningless",
        lambda d: d.strategy == "fsdp" and not d.trivial_mesh and d.data_parallel * d.cp < 2,
        lambda d: f"--strategy fsdp with --world-size {d.world_size} over {_mesh_text(d)}",
        "FSDP2 shards over the data-parallel (and cp) ranks, and this mesh leaves 1: use --strategy ddp or a larger "
        "--world-size",
    ),
    Rule(
        "--offload params",
        "--strategy ddp",
        "meaningless",
        lambda d: d.offload == "params" and d.strategy != "fsdp",
        lambda d: f"--offload params with --strategy {d.strategy}",
        "it is FSDP2's CPUOffloadPolicy, which keeps each rank's shards on the host: give --strategy fsdp, or "
        "under ddp --offload activations",
    ),
    Rule(
        "--host-budget",
        "no --offload",
        "meaningless",
        lambda d: d.host_budget and d.offload == "none",
        lambda d: "--host-budget without --offload",
        "without --offload activations or params the job keeps nothing in host memory that the probe measures",
    ),
    Rule(
        "--quantize",
        "no --lora-rank",
        "meaningless",
        lambda d: d.quantize is not None and d.lora is False,
        lambda d: f"--quantize {d.quantize} without --lora-rank",
        "a 4-bit base is frozen, only LoRA adapters over it train: give --lora-rank R",
    ),
    Rule(
        "--quantize",
        "--strategy fsdp",
        "a library's limit",
        lambda d: d.quantize is not None and d.strategy == "fsdp",
        lambda d: f"--quantize {d.quantize} with --strategy fsdp",
        "sharding a 4-bit base fails in the libraries: FSDP2's fully_shard makes bitsandbytes' Params4bit a plain "
        "DTensor without its quant_state (even with bf16 quant storage), and its forward stops on 'quant_state is "
        "required'; train a 4-bit base over data-parallel replicas (--strategy ddp)",
    ),
    Rule(
        "--quantize",
        "--tp",
        "a library's limit",
        lambda d: d.quantize is not None and d.tp > 1,
        lambda d: f"--quantize {d.quantize} with --tp {d.tp}",
        "DTensor's column- and row-wise styles cannot shard bitsandbytes' packed 4-bit weights (a flat uint8 buffer "
        "and its quantization state); train a 4-bit base over data-parallel replicas (--strategy ddp) instead",
    ),
    Rule(
        "--optimizer (bitsandbytes)",
        "--strategy fsdp or --tp",
        "a library's limit",
        lambda d: d.optimizer_library == "bitsandbytes" and (d.strategy == "fsdp" or d.tp > 1),
        lambda d: f"--optimizer {d.optimizer} under {_sharded(d)}",
        _BNB_NO_DTENSOR,
    ),
    Rule(
        "--ac budget:R",
        "no --compile",
        "meaningless",
        lambda d: d.activation_checkpointing.startswith("budget:") and d.compile is None,
        lambda d: f"--ac {d.activation_checkpointing} without --compile",
        "the compiler's activation memory budget applies to a compiled job only: give --compile",
    ),
    Rule(
        "--loss",
        "--tp",
        "not measured yet",
        lambda d: d.lm_loss != "plain" and d.tp > 1,
        lambda d: f"--loss {d.lm_loss} with --tp {d.tp}",
        "under tp the LM head's weight is sharded over the vocabulary (colwise, or torchtitan's loss parallel): TRL's "
        "chunked loss gathers it whole on every rank (DTensor.full_tensor) and Liger's fused kernel takes no "
        "DTensor, so neither holds what the plain loss parallel does; probe --loss plain under --tp, or --loss "
        "without --tp",
    ),
    Rule(
        "--loss",
        "--pp",
        "not measured yet",
        lambda d: d.lm_loss != "plain" and d.pp > 1,
        lambda d: f"--loss {d.lm_loss} with --pp {d.pp}",
        "a pipeline's last stage runs the LM head and the loss as modules of its own cut, which --loss does not "
        "replace yet; probe --loss plain under --pp",
    ),
    Rule(
        "--loss",
        "--cp",
        "not measured yet",
        lambda d: d.lm_loss != "plain" and d.cp > 1,
        lambda d: f"--loss {d.lm_loss} with --cp {d.cp}",
        "under cp each rank computes the loss over its shard of the sequence, and no run of real cp ranks (the "
        "truth of --cp) has checked these losses there yet; probe --loss plain under --cp",
    ),
    Rule(
        "--weights-dtype fp16",
        "--precision fp16",
        "a library's limit",
        lambda d: d.weights_dtype == "fp16" and d.precision == "fp16",
        lambda d: "--weights-dtype fp16 with --precision fp16",
        "GradScaler cannot unscale fp16 gradients; hold fp16 weights with --precision fp32 (or bf16)",
    ),
    Rule(
        "--cp",
        "--seq-len",
        "meaningless",
        lambda d: d.cp > 1 and any(length % d.cp for length in d.seq_lens),
        lambda d: f"--cp {d.cp} at --seq-len {next(n for n in d.seq_lens if n % d.cp)}",
        "context parallelism splits each sequence over the cp ranks: --cp must divide every length",
    ),
    Rule(
        "--ep",
        "--strategy ddp",
        "not measured yet",
        lambda d: d.ep > 1 and d.strategy != "fsdp",
        lambda d: f"--ep {d.ep} with --strategy {d.strategy}",
        "expert parallelism is measured as torchtitan lays it out, under FSDP2 (the experts sharded over their own "
        "data-parallel ranks, W / ep); give --strategy fsdp",
    ),
    Rule(
        "--ep",
        "--tp, --pp or --cp",
        "not measured yet",
        lambda d: d.ep > 1 and d.tp * d.pp * d.cp > 1,
        lambda d: (
            f"--ep {d.ep} with "
            + " x ".join(f"--{n} {s}" for n, s in (("tp", d.tp), ("pp", d.pp), ("cp", d.cp)) if s > 1)
        ),
        "the experts' all-to-all is measured over ranks that hold the whole sequence and every block (ep x fsdp), "
        "and no run of real ranks has checked it beside tensor, pipeline or context parallelism yet; probe --ep "
        "with --strategy fsdp alone",
    ),
    Rule(
        "--ep",
        "--compile",
        "not measured yet",
        lambda d: d.ep > 1 and d.compile is not None,
        lambda d: f"--ep {d.ep} with --compile {d.compile}",
        "the dispatch reads the routing's counts on the host (.tolist()), a graph break no compiled run has been "
        "checked across yet; probe --ep eager",
    ),
    # The rows that read the model (ModelShape): asked once the task is known, before any trial.
    Rule(
        "--ep",
        "a dense model",
        "meaningless",
        lambda d: d.ep > 1 and d.model is not None and d.model.experts is None,
        lambda d: f"--ep {d.ep} on the model of {_model(d).text()}, which has no routed experts",
        "expert parallelism shards a mixture of experts' routed experts (transformers' fused gate_up_proj and "
        "down_proj), and this model has none",
    ),
    Rule(
        "--ep",
        "the model's experts",
        "meaningless",
        lambda d: d.ep > 1 and d.model is not None and d.model.experts is not None and d.model.experts % d.ep != 0,
        lambda d: f"--ep {d.ep} on the model's {_model(d).experts} experts ({_model(d).text()})",
        "expert parallelism gives each ep rank whole experts: --ep must divide the routed experts",
    ),
    Rule(
        "--tp",
        "the model's attention heads",
        "meaningless",
        lambda d: d.tp > 1 and d.model is not None and d.model.heads is not None and d.model.heads % d.tp != 0,
        lambda d: f"--tp {d.tp} on the model's {_model(d).heads} attention heads ({_model(d).text()})",
        "tensor parallelism gives each tp rank whole attention heads: --tp must divide the heads",
    ),
    Rule(
        "--tp",
        "the model's key/value heads",
        "meaningless",
        lambda d: (
            d.tp > 1
            and d.model is not None
            and d.model.kv_heads is not None
            and d.model.kv_heads != d.model.heads  # as many as the heads: the row above says it
            and d.model.kv_heads % d.tp != 0
        ),
        lambda d: f"--tp {d.tp} on the model's {_model(d).kv_heads} key/value heads ({_model(d).text()})",
        "tensor parallelism shards the key and value projections by head over the tp ranks: --tp must divide the "
        "key/value heads (grouped-query attention has fewer of them than query heads)",
    ),
    Rule(
        "--pp",
        "the model's blocks",
        "meaningless",
        lambda d: d.pp > 1 and d.model is not None and d.model.blocks is not None and d.model.blocks < d.pp,
        lambda d: f"--pp {d.pp} on the model's {_model(d).blocks} block(s) ({_model(d).text()})",
        "a pipeline cuts the model between its blocks, at least one to a stage: --pp at most the blocks",
    ),
    Rule(
        "--cp",
        "a model other than an hf: causal LM",
        "not measured yet",
        lambda d: d.cp > 1 and d.model is not None and not d.model.causal_lm_sdpa,
        lambda d: f"--cp {d.cp} on the model of {_model(d).text()}",
        "torch's context parallelism is measured for hf: causal LMs with SDPA attention (input_ids, labels), as "
        "transformers' Trainer runs it",
    ),
    Rule(
        "--tp-plan torchtitan",
        "a model of another family",
        "not measured yet",
        lambda d: d.tp_plan == "torchtitan" and d.model is not None and "torchtitan" not in d.model.tp_plans,
        lambda d: (
            f"--tp-plan torchtitan on the model of {_model(d).text()}"
            + ("" if _model(d).family else " (no hf: config)")
        ),
        "torchtitan's plan is written for the module names of the hf: Llama, Mistral, Qwen2, Qwen3, Mixtral and "
        "GPT-2 families; use --tp-plan hf (or the task's own tp_plan)",
    ),
)


def _model(d: Dimensions) -> ModelShape:
    assert d.model is not None  # a row that reads the model applies only where it is known
    return d.model


def _mesh_text(d: Dimensions) -> str:
    parts = [f"{name} {size}" for name, size in (("tp", d.tp), ("pp", d.pp), ("cp", d.cp)) if size > 1]
    return " x ".join(parts)


def composition_refusal(dims: Dimensions) -> str | None:
    """The one line that refuses dims' composition (the first rule of :data:`COMPOSITIONS` that applies), or None
    where every pair of its dimensions composes."""
    for rule in COMPOSITIONS:
        if rule.applies(dims):
            return rule.message(dims)
    return None


def refuse_composition(dims: Dimensions, error: type[Exception] = AutotuneError) -> None:
    """Raise error (the asker's own: the CLI's CliError, a task's TaskError) with :func:`composition_refusal`'s
    line, where there is one."""
    refusal = composition_refusal(dims)
    if refusal is not None:
        raise error(refusal)


def composition_table() -> str:
    """The table of refused compositions as markdown (docs/meshes.md holds it; a test keeps the two equal)."""
    rows = ["| dimension | with | why | what autotune says |", "|---|---|---|---|"]
    for rule in COMPOSITIONS:
        reason = rule.reason.replace("|", "\\|")
        rows.append(f"| `{rule.first}` | {rule.second} | {rule.why} | {reason} |")
    return "\n".join(rows)
