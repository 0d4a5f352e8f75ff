"""The configs of a probe and of an estimate: one family (docs/design.md, "The waves' decisions").

``ProbeConfig`` is the job's setup and how it is measured, typed with ``core``'s ``Literal``s;
``EstimateConfig`` *contains* one (``probe``) and adds what only an estimate has: the device by kind,
the card (looked up once, here), the memory outside its allocator and the sizes to try. A new
dimension of the job is one field of ``ProbeConfig``: the CLI, the fleet and the library build both
configs from it, and ``applied_to`` sets it on the task.

    probe_config = ProbeConfig(device="cpu", budget_bytes=32 << 20, target_batch=256)
    estimate_config = EstimateConfig.of(gpu="h100", strategy="fsdp", world_size=8)
    estimate_config.probe.budget_bytes  # the card's memory: no --budget given

Torch-free but for the memory policy's check (``autotune.measure.policies``, imported when a policy
is given), so the CLI builds a config before it imports torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from autotune.core.cards import Card, resolve_card
from autotune.core.compositions import Dimensions, refuse_composition
from autotune.core.errors import AutotuneError, BudgetError, TaskError
from autotune.core.mesh import Mesh
from autotune.core.plan import MAX_TARGET_BATCH, PLAN_POLICIES, PlanPolicy
from autotune.core.schemas import OFFLOADS, PRECISIONS, STRATEGIES, Offload, Plan, Precision, Strategy
from autotune.core.setup import JobSetup
from autotune.core.step_time import FigureOverrides
from autotune.tasks.tp_plan import tp_plan_refusal

if TYPE_CHECKING:
    from autotune.tasks.task import ProbeTask

__all__ = ["DEVICE_KINDS", "DeviceKind", "EstimateConfig", "ProbeConfig", "card_of"]

DEVICE_KINDS = ("cpu", "cuda")
DeviceKind = Literal["cpu", "cuda"]


@dataclass(frozen=True)
class ProbeConfig:
    """What to probe and under which budget (the CLI flags of `autotune probe`); an estimate's setup too."""

    device: str = "auto"
    budget_bytes: int | None = None
    headroom: float = 0.10
    target_batch: int | None = None
    world_size: int = 1
    max_micro_batch: int = 4096
    multiple_of: int = 1
    precision: Precision | None = None
    strategy: Strategy = "ddp"
    # Find the boundary with fake-tensor trials first, then confirm it with real ones.
    presearch: bool = True
    # One model per probe, reused across trials (False: a fresh model per trial, as before; the
    # benchmarks compare the two).
    reuse_model: bool = True
    # How the plan splits the target batch: "balanced" (fewest steps, uneven micro-batches) or "divisor".
    plan_policy: PlanPolicy = "balanced"
    # The memory policy (none, every-K, full, op, op:OPS: autotune/core/policy_names.py, an open grammar, so
    # a string): None keeps the task's own activation_checkpointing.
    activation_checkpointing: str | None = None
    # A torch.compile mode the trials run the model compiled in (docs/compile.md); None keeps the task's own.
    compile: str | None = None
    # After the search, time updates at m_max and at the plan's sizes (autotune/measure/throughput.py).
    throughput: bool = False
    # After the search, the peak of m_max and of the size above it broken down by what holds it, with the step's
    # timeline (autotune/measure/breakdown.py): two fake trials more. The CLI asks for it; off for library calls.
    breakdown: bool = False
    # After the search, what each applicable change of the setup would buy (autotune/orchestrate/levers.py): a
    # fake trial and an estimate per change. `--levers` asks for it.
    levers: bool = False
    # A sequence-aware task's lengths, one profile each (autotune/orchestrate/lengths.py: probe_lengths); the cap
    # of the search for the longest length at m = multiple_of; tokens per update instead of
    # target_batch. The fleet's workers read them here; `autotune probe` passes them itself too.
    seq_lens: tuple[int, ...] = ()
    max_seq_len: int | None = None
    target_tokens: int | None = None
    # What the job keeps in host memory (autotune/measure/offload.py): None keeps the task's own offload;
    # host_budget_bytes (--host-budget): a size whose host bytes exceed it does not fit.
    offload: Offload | None = None
    host_budget_bytes: int | None = None
    # The job's mesh (autotune/core/mesh.py): tensor, pipeline and context parallel degrees; world_size counts
    # every rank, and the plan's D is the data-parallel replicas W / (tp x pp x cp).
    mesh: Mesh = Mesh()
    # The tensor-parallel plan by name under tp > 1 (autotune/tasks/tp_plan.py: hf, torchtitan); None keeps the
    # task's own (its tp_plan, else the model's).
    tp_plan: str | None = None
    # The kernel SDPA runs (--sdpa-backend: flash, efficient, cudnn, math); None keeps the task's own (torch's pick).
    sdpa_backend: str | None = None
    # How the causal LM computes its loss (--loss: plain, chunked:N, fused-linear; autotune/tasks/losses.py); None
    # keeps the task's own.
    lm_loss: str | None = None

    def validate(self) -> None:
        if not 0 <= self.headroom < 1:
            raise BudgetError(f"headroom must be in [0, 1), got {self.headroom}")
        if self.budget_bytes is not None and self.budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {self.budget_bytes} bytes")
        for name in ("world_size", "max_micro_batch", "multiple_of"):
            value = getattr(self, name)
            if value < 1:
                raise AutotuneError(f"{name.replace('_', '-')} must be a positive integer, got {value}")
        if self.multiple_of > self.max_micro_batch:
            raise AutotuneError(f"multiple-of {self.multiple_of} is larger than max-micro-batch {self.max_micro_batch}")
        if self.target_batch is not None:
            if self.target_batch < 1:
                raise AutotuneError(f"target-batch must be a positive integer, got {self.target_batch}")
            if self.target_batch > MAX_TARGET_BATCH:
                raise AutotuneError(f"target-batch {self.target_batch} is larger than {MAX_TARGET_BATCH}")
            replicas = self.world_size // max(1, self.mesh.model_parallel)
            if self.target_batch < replicas:
                over = "" if self.mesh.trivial else f" over {self.mesh.describe()} ({replicas} replicas)"
                raise AutotuneError(
                    f"target-batch {self.target_batch} is smaller than world-size {self.world_size}{over}: "
                    "every replica needs at least one sample per update"
                )
        # The Literals type the fields for the code; a caller's string is still checked here, in one line.
        if self.strategy not in STRATEGIES:
            raise AutotuneError(f"strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}")
        self.mesh.validate(self.world_size)
        refusal = tp_plan_refusal(self.tp_plan, tp=self.mesh.tp, cp=self.mesh.cp, seq_lens=self.seq_lens)
        if refusal is not None:
            raise AutotuneError(refusal)
        # FSDP2 shards over the data-parallel replicas, and under --cp over the cp ranks too (they hold the same
        # parameters: torchtitan's dp_shard_cp mesh), so fsdp over cp alone (D = 1) still shards.
        refuse_composition(self.dimensions())
        if self.precision is not None and self.precision not in PRECISIONS:
            raise AutotuneError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.plan_policy not in PLAN_POLICIES:
            raise AutotuneError(f"plan must be one of {', '.join(PLAN_POLICIES)}, got {self.plan_policy!r}")
        if self.activation_checkpointing is not None:
            from autotune.measure.policies import check_policy

            check_policy(self.activation_checkpointing)
        self._validate_offload()
        if self.target_tokens is not None and self.target_batch is not None:
            raise AutotuneError("give target-batch (sequences) or target-tokens (tokens), not both")
        if self.target_tokens is not None and not self.seq_lens:
            raise AutotuneError("target-tokens needs seq-len: tokens are planned in sequences of a length")

    def _validate_offload(self) -> None:
        if self.offload is not None and self.offload not in OFFLOADS:
            raise AutotuneError(f"--offload {self.offload!r}: not an offload; use one of {', '.join(OFFLOADS)}")
        if self.host_budget_bytes is not None:
            if self.host_budget_bytes <= 0:
                raise BudgetError(f"--host-budget must be positive, got {self.host_budget_bytes} bytes")

    def applied_to(self, task: ProbeTask) -> ProbeTask:
        """task with the precision and the memory policy asked for, where they are given: the one place
        a config changes the task (probe, estimate, a card's estimate and a run over lengths call it)."""
        # The task's own dimensions (its quantization, LoRA, optimizer's library) with the config's: refused for
        # every path, estimates included, before any trial.
        refuse_composition(self.dimensions(task), TaskError)
        if self.precision is not None and self.precision != task.precision:
            task = dataclasses.replace(task, precision=self.precision)
        if self.activation_checkpointing is not None or self.compile is not None:
            task = dataclasses.replace(
                task,
                activation_checkpointing=self.activation_checkpointing or task.activation_checkpointing,
                compile=self.compile or task.compile,
            )
        if self.offload is not None and self.offload != task.offload:
            task = dataclasses.replace(task, offload=self.offload)
        if self.tp_plan is not None and self.tp_plan != task.tp_plan:
            task = dataclasses.replace(task, tp_plan=self.tp_plan)
        if self.sdpa_backend is not None and self.sdpa_backend != task.sdpa_backend:
            task = dataclasses.replace(task, sdpa_backend=self.sdpa_backend)
        if self.lm_loss is not None and self.lm_loss != task.lm_loss:
            task = dataclasses.replace(task, lm_loss=self.lm_loss)
        from autotune.tasks.losses import check_loss

        check_loss(task)  # a model with no LM head to fuse: refused before any trial
        return task

    def dimensions(self, task: ProbeTask | None = None) -> Dimensions:
        """This config's dimensions for the composition table (autotune/core/compositions.py), with task's own
        (its quantization, LoRA, optimizer, weights' dtype, and what the config leaves to it) where given."""
        dims = Dimensions(
            strategy=self.strategy,
            world_size=self.world_size,
            tp=self.mesh.tp,
            pp=self.mesh.pp,
            cp=self.mesh.cp,
            ep=self.mesh.ep,
            compile=self.compile,
            offload=self.offload or "none",
            host_budget=self.host_budget_bytes is not None,
            activation_checkpointing=self.activation_checkpointing or "none",
            precision=self.precision,
            lm_loss=self.lm_loss or "plain",
            seq_lens=self.seq_lens,
            tp_plan=self.tp_plan,
        )
        if task is None:
            return dims
        from autotune.measure.model_shape import model_shape
        from autotune.tasks.optimizers import optimizer_library, optimizer_text

        quantize = task.tags.get("quantize")
        return dims.replace(
            compile=self.compile or task.compile,
            offload=self.offload or task.offload,
            activation_checkpointing=self.activation_checkpointing or task.activation_checkpointing,
            quantize=None if quantize is None else str(quantize),
            optimizer=optimizer_text(task.optimizer),
            optimizer_library=optimizer_library(task.optimizer),
            precision=self.precision or task.precision,
            weights_dtype=task.weights_dtype,
            lm_loss=self.lm_loss or task.lm_loss,
            # The mesh rows read the model (a meta build, once per model): only where a mesh asks them.
            seq_lens=self.seq_lens or ((task.seq_len,) if task.seq_len else ()),
            tp_plan=self.tp_plan or (task.tp_plan if isinstance(task.tp_plan, str) else None),
            model=None if self.mesh.trivial else model_shape(task),
        )

    @property
    def data_parallel(self) -> int:
        """D: the data-parallel replicas the plan holds T = m x A x D over (world_size over the mesh)."""
        return self.mesh.data_parallel(self.world_size)

    def with_setup(self, **changes: Any) -> ProbeConfig:
        """This config with some of its fields changed (EstimateConfig.with_setup changes its probe's)."""
        return dataclasses.replace(self, **changes)

    def plan_for(self, m_max: int, warnings: list[str], single_step_max: int | None = None) -> Plan | None:
        """The plan of the target batch at m_max (None without a target), appending to warnings what a
        datasheet must say: no plan reaches the target, the plan is not exact, m_max is the cap. With
        single_step_max (Profile.single_step), the one plan every reader of the profile makes
        (autotune.core.plan.plan_with_single_step)."""
        the_plan = None
        if self.target_batch:
            try:
                the_plan = self.job_setup.plan(
                    m_max,
                    self.target_batch,
                    multiple_of=self.multiple_of,
                    policy=self.plan_policy,
                    single_step_max=single_step_max,
                )
            except ValueError as exc:  # the measurement stands even where no plan reaches the target
                warnings.append(f"no plan: {exc}")
        if the_plan is not None and not the_plan.exact:
            warnings.append(the_plan.note)
        if m_max >= self.max_micro_batch:
            warnings.append(f"micro-batch reached the cap {self.max_micro_batch}: more may fit")
        return the_plan

    @property
    def job_setup(self) -> JobSetup:
        """The setup's part that decides the plan and D (autotune/core/setup.py): the one object the profile,
        /suggest and the client plan with, so the probe's own plan is the plan a job receives. A pipeline's
        K runs from the schedule's least to the K the stages were measured at."""
        return JobSetup(strategy=self.strategy, world_size=self.world_size, mesh=self.mesh)


def card_of(name: str, memory_bytes: int | None = None) -> Card:
    """The card ``--gpu NAME [--gpu-memory BYTES]`` names: the catalog's card called name, or with a memory
    one the catalog lacks (or a catalog card with other memory), its architecture the closest catalog
    card's (autotune.core.cards.resolve_card); AutotuneError in one line for a name it cannot place."""
    try:
        return resolve_card(name, memory_bytes)
    except ValueError as exc:
        flag = "--gpu" if memory_bytes is None else "--gpu/--gpu-memory"
        raise AutotuneError(f"{flag}: {exc}") from None


@dataclass(frozen=True)
class EstimateConfig:
    """The flags of `autotune estimate`: the probe's setup (``probe``; its ``device`` is not read), the
    device by kind, and for a card of the catalog the card itself.

    A card fills what is not given, once, here: the budget (its memory) and the device's name (NVML's).
    Build one from flat keywords with :meth:`of`.
    """

    probe: ProbeConfig = field(default_factory=ProbeConfig)
    device_kind: DeviceKind = "cuda"
    device_name: str | None = None
    # A card of the catalog (autotune/core/cards.py): its name, budget and CUDA semantics, by emulated fake
    # trials (autotune/orchestrate/card_estimate.py).
    card: Card | None = None
    # Memory outside the caching allocator (the CUDA context): None takes the catalog's figure; where
    # it came from when not from --context-bytes (the store's measurements: autotune/cli/estimate.py).
    context_bytes: int | None = None
    context_source: str | None = None
    # Sizes estimated besides the search's (their trials in the profile): "will m = 32 fit?".
    micro_batches: tuple[int, ...] = ()
    # Why the card could not be emulated, where a run over lengths found out already: CPU semantics then.
    emulation_failed: str | None = None
    # --estimate-bound: "safe" adds a stated bound for each part the card's figure does not model (NCCL's
    # buffers: autotune/core/unmodelled.py), "tight" adds none.
    estimate_bound: str = "safe"
    # Whether a card's estimate predicts the step's time (autotune/orchestrate/predicted.py): every estimate does; the
    # levers' estimates of changed setups, which read memory only, do not.
    predict: bool = True
    # The card's and the fabric's figures the user gives for the predicted step time (--peak-tflops, ...:
    # autotune/core/step_time.py), in place of the catalog's.
    figures: FigureOverrides = field(default_factory=FigureOverrides)
    # --full-walk: every block of an emulated card's trials walked, not a few repeated (autotune/search/depth.py).
    full_walk: bool = False

    def __post_init__(self) -> None:
        if self.card is None:
            return
        if self.probe.budget_bytes is None:
            object.__setattr__(self, "probe", self.probe.with_setup(budget_bytes=self.card.device_total_bytes))
        if self.device_name is None:
            object.__setattr__(self, "device_name", self.card.nvml_name)

    @classmethod
    def of(
        cls,
        *,
        gpu: str | None = None,
        gpu_memory: int | None = None,
        device_kind: DeviceKind = "cuda",
        device_name: str | None = None,
        context_bytes: int | None = None,
        context_source: str | None = None,
        micro_batches: tuple[int, ...] = (),
        emulation_failed: str | None = None,
        estimate_bound: str = "safe",
        figures: FigureOverrides | None = None,
        full_walk: bool = False,
        **setup: Any,
    ) -> EstimateConfig:
        """The config from flat keywords: ``setup`` is ProbeConfig's fields, ``gpu`` a card's name and
        ``gpu_memory`` its memory in bytes where the catalog lacks the card (or it has other memory).

            EstimateConfig.of(budget_bytes=80 << 30, strategy="fsdp", world_size=8)

        Raises:
            AutotuneError: gpu names no card of the catalog and no memory is given (one line listing the
                known ones), or a name of no family the catalog knows.
            TypeError: a keyword that is no field of either config.
        """
        if gpu_memory is not None and gpu is None:
            raise AutotuneError("--gpu-memory is the memory of the card --gpu names: give --gpu NAME with it")
        return cls(
            probe=ProbeConfig(**setup),
            device_kind=device_kind,
            device_name=device_name,
            card=card_of(gpu, gpu_memory) if gpu is not None else None,
            context_bytes=context_bytes,
            context_source=context_source,
            micro_batches=tuple(micro_batches),
            emulation_failed=emulation_failed,
            estimate_bound=estimate_bound,
            figures=figures or FigureOverrides(),
            full_walk=full_walk,
        )

    def with_setup(self, **changes: Any) -> EstimateConfig:
        """This config with some of its probe's fields changed (the policy, the target at one length)."""
        return dataclasses.replace(self, probe=self.probe.with_setup(**changes))

    def applied_to(self, task: ProbeTask) -> ProbeTask:
        return self.probe.applied_to(task)

    def validate(self) -> None:
        card = self.card
        if card is not None:
            if self.device_kind != "cuda":
                raise AutotuneError(
                    f"--gpu {card.short_name} names a CUDA card: it cannot go with --device-kind {self.device_kind}"
                )
            if self.context_bytes is not None and not 0 <= self.context_bytes < card.device_total_bytes:
                raise AutotuneError(
                    f"--context-bytes must be at least 0 and below the {card.short_name}'s memory "
                    f"({card.device_total_bytes} bytes), got {self.context_bytes}"
                )
        elif self.context_bytes is not None:
            raise AutotuneError("--context-bytes applies to an estimate for a card: name it with --gpu")
        elif self.figures.flags():
            raise AutotuneError(
                f"{self.figures.flags()[0].split()[0]} is a figure of the predicted step time on a card: name the card "
                "with --gpu"
            )
        from autotune.core.unmodelled import BOUNDS

        if self.estimate_bound not in BOUNDS:
            raise AutotuneError(f"--estimate-bound must be one of {', '.join(BOUNDS)}, got {self.estimate_bound!r}")
        if any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.micro_batches):
            raise AutotuneError(f"--micro-batches must be positive integers, got {list(self.micro_batches)}")
        if self.probe.budget_bytes is None:
            raise BudgetError("estimate needs a budget: pass --budget (for example --budget 80GiB)")
        if self.probe.budget_bytes <= 0:
            raise BudgetError(f"budget must be positive, got {self.probe.budget_bytes} bytes")
        if self.device_kind not in DEVICE_KINDS:
            raise AutotuneError(f"device kind must be one of {', '.join(DEVICE_KINDS)}, got {self.device_kind!r}")
        self.probe.validate()
