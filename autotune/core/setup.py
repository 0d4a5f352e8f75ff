"""A job's setup: every dimension that changes what a device holds or how the plan is formed, in one typed,
torch-free value (docs/design.md, "One job setup").

The probe's profile, ``/suggest``'s query, the client and the observer each build a ``JobSetup`` and ask it,
rather than spelling the dimensions again: D (the data-parallel replicas), whether DDP's gradient buckets are
held, which planner applies (a pipeline's K bounds or the accumulating plan), the store's kind, and how two
setups differ.

    >>> job = JobSetup(world_size=4, mesh=Mesh(tp=2))
    >>> job.data_parallel, job.holds_ddp_buckets
    (2, True)
    >>> JobSetup(world_size=4).differences(job)
    ('mesh',)
    >>> JobSetup(world_size=2, mesh=Mesh(pp=2, pp_microbatches=4)).plan(8, 32).accumulation_steps
    4

A field that is None (``precision``, ``compile``, ``offload``, ``host_budget_bytes``, ``seq_len``, ``lm_loss``) is one
the job does not set (the task's own, where a worker applies the setup to the task it loads: ``with_setup``);
``differences`` compares every field that changes memory or D, so a query that leaves one out is refused by a
profile that has it rather than served another job's plan.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from autotune.core.errors import AutotuneError
from autotune.core.loss_names import LOSS_TAG, PLAIN_LOSS, canonical_loss
from autotune.core.mesh import Mesh
from autotune.core.plan import DEFAULT_PLAN_POLICY, PlanPolicy, pipeline_plan, plan_with_single_step
from autotune.core.schemas import MAX_BYTES, MAX_WORLD_SIZE, Offload, Plan, Precision, Profile, Strategy, SuggestQuery

__all__ = ["MEMORY_FIELDS", "JobSetup", "Planner"]

Planner = Literal["accumulate", "pipeline"]

# The fields that change what a device holds or the plan's D, in the order a refusal names them. Each is a
# query parameter of /suggest under the same name.
MEMORY_FIELDS = (
    "strategy",
    "mesh",
    "world_size",
    "activation_checkpointing",
    "offload",
    "host_budget_bytes",
    "compile",
    "lm_loss",
)


class JobSetup(BaseModel):
    """One job's setup (see the module docstring). Frozen: hashable, a cache key and a store's kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    strategy: Strategy = "ddp"
    # W: every rank of the job; D is W over the mesh's model-parallel ranks.
    world_size: int = Field(default=1, ge=1, le=MAX_WORLD_SIZE)
    mesh: Mesh = Mesh()
    precision: Precision | None = None
    # The memory policy's canonical name (autotune/core/policy_names.py); None: the task's own (a setup on its way
    # to a worker or the emulated child, applied there to the task it loads).
    activation_checkpointing: str | None = "none"
    # A torch.compile mode; compiled_measured is False where the figures ran the eager model (an estimate's fake
    # trials), so a compiled job is told its answer is the eager step's.
    compile: str | None = None
    compiled_measured: bool = True
    offload: Offload | None = None
    host_budget_bytes: int | None = Field(default=None, gt=0, le=MAX_BYTES)
    seq_len: int | None = Field(default=None, ge=1)
    # The resolved tensor-parallel plan under tp > 1 (autotune/tasks/tp_plan.py: tp_plan_label), module pattern ->
    # style: another plan holds other shards. In the fingerprint (fingerprint_tags), not a /suggest field.
    tp_plan: str | None = None
    # The plan's name where the job names one (--tp-plan: hf or torchtitan; autotune/tasks/tp_plan.py), as a worker
    # or the emulated child applies it to the task it loads (with_setup); None: the task's own plan.
    tp_plan_name: str | None = None
    # The attention kernel the job makes SDPA run (--sdpa-backend: flash, efficient, cudnn, math;
    # autotune/tasks/task.py, SDPA_BACKENDS); None: the one torch picks, or the task's own.
    sdpa_backend: str | None = None
    # How the causal LM computes its loss (--loss: plain, chunked:N, fused-linear; autotune/core/loss_names.py),
    # canonical; None: the task's own (a setup on its way to a worker), or a query that leaves it to the fingerprint.
    lm_loss: str | None = None

    @field_validator("lm_loss")
    @classmethod
    def _canonical_loss(cls, value: str | None) -> str | None:
        return None if value is None else canonical_loss(value)

    @model_validator(mode="after")
    def _consistent(self) -> JobSetup:
        try:
            self.mesh.validate(self.world_size)
        except AutotuneError as exc:
            raise ValueError(str(exc)) from None
        if self.host_budget_bytes is not None and self.offload in (None, "none"):
            raise ValueError(
                "host_budget_bytes needs an offload (activations or params): without offload the job keeps "
                "nothing in host memory that a probe measures"
            )
        return self

    @classmethod
    def of_profile(cls, profile: Profile) -> JobSetup:
        """The setup a profile's figures were measured under: what every reader of the profile plans and matches
        with. An estimate's compiled setup ran the eager model (docs/compile.md)."""
        compiled = profile.tags.get("compile")
        offload = None if profile.offload in (None, "none") else profile.offload
        return cls(
            strategy=profile.strategy,
            world_size=profile.world_size,
            mesh=Mesh.from_dict(profile.mesh),
            precision=profile.precision,
            activation_checkpointing=profile.activation_checkpointing,
            compile=None if compiled is None else str(compiled),
            compiled_measured=profile.source == "measured",
            offload=offload,
            host_budget_bytes=profile.host_budget_bytes if offload is not None else None,
            seq_len=profile.seq_len,
            lm_loss=str(profile.tags.get(LOSS_TAG, PLAIN_LOSS)),
        )

    @classmethod
    def of_query(cls, query: SuggestQuery) -> JobSetup:
        """The part of a job's setup a /suggest query states: offload and compile as given (None: the
        fingerprint's), the host budget without its offload check (the profile holds the offload)."""
        return cls.model_construct(
            strategy=query.strategy,
            world_size=query.world_size,
            mesh=Mesh.parse(query.mesh),
            precision=None,
            activation_checkpointing=query.activation_checkpointing,
            compile=query.compile,
            compiled_measured=True,
            offload=None if query.offload == "none" else query.offload,
            host_budget_bytes=query.host_budget_bytes,
            seq_len=query.seq_len,
            lm_loss=query.lm_loss,
        )

    @property
    def data_parallel(self) -> int:
        """D: the replicas the target batch is split over, W / (tp x pp x cp)."""
        return self.mesh.data_parallel(self.world_size)

    @property
    def holds_ddp_buckets(self) -> bool:
        """Whether each rank holds DDP's gradient buckets: ddp with more than one rank reducing gradients, the
        replicas and (under cp, where DDP runs over the cp ranks too) the cp ranks."""
        return self.strategy == "ddp" and self.data_parallel * self.mesh.cp > 1

    @property
    def planner(self) -> Planner:
        """Which plan applies: a pipeline's (K within its measured bounds) or the accumulating one."""
        return "pipeline" if self.mesh.pp > 1 else "accumulate"

    @property
    def pipeline_microbatches(self) -> tuple[int, int] | None:
        """A pipeline's (least, most) K: the schedule's least (pp under 1F1B, 1 under GPipe) to the K its stages
        were measured at (the mesh's, else pp); None without a pipeline."""
        if self.mesh.pp == 1:
            return None
        measured = self.mesh.pp_microbatches or self.mesh.pp
        least = 1 if self.mesh.pp_schedule == "gpipe" else self.mesh.pp
        return min(least, measured), measured

    def plan(
        self,
        max_micro_batch: int,
        target_batch: int,
        *,
        multiple_of: int = 1,
        policy: PlanPolicy = DEFAULT_PLAN_POLICY,
        single_step_max: int | None = None,
    ) -> Plan:
        """The one plan every reader of a profile of this setup makes: m x A x D = T over this setup's D, a
        pipeline's in equal micro-batches with K within its bounds (autotune/core/plan.py).

        Raises:
            ValueError: the plan arithmetic refused (target below D, max_micro_batch below multiple_of, ...).
        """
        bounds = self.pipeline_microbatches
        if bounds is not None:
            least, most = bounds
            return pipeline_plan(
                max_micro_batch,
                target_batch,
                self.data_parallel,
                stages=self.mesh.pp,
                max_microbatches=most,
                min_microbatches=least,
                multiple_of=multiple_of,
                virtual_stages=self.mesh.virtual_stages,
            )
        return plan_with_single_step(
            max_micro_batch,
            target_batch,
            self.data_parallel,
            single_step_max=single_step_max,
            multiple_of=multiple_of,
            policy=policy,
        )

    def differences(self, other: JobSetup) -> tuple[str, ...]:
        """The fields (``MEMORY_FIELDS``, by name) in which other differs from this setup in what a device holds
        or in D. ``world_size`` counts where it changes D's share of a sharded model or DDP's buckets: two ddp
        setups over different numbers of replicas that both hold buckets (or both do not) are the same kind."""
        differ: list[str] = []
        for name in MEMORY_FIELDS:
            if name == "world_size":
                if self.strategy == "fsdp" or other.strategy == "fsdp":
                    if self.world_size != other.world_size:
                        differ.append(name)
                elif self.holds_ddp_buckets != other.holds_ddp_buckets:
                    differ.append(name)
                continue
            if name == "lm_loss":  # unset is the plain loss, as a profile without the tag was measured
                if (self.lm_loss or PLAIN_LOSS) != (other.lm_loss or PLAIN_LOSS):
                    differ.append(name)
                continue
            if getattr(self, name) != getattr(other, name):
                differ.append(name)
        return tuple(differ)

    def fingerprint_tags(self) -> dict[str, str]:
        """The fingerprint's setup part: the tags autotune adds to a task's own, for the dimensions that change
        what one rank holds and that the model, batch, optimizer and precision do not say. The plain setup adds
        none, so every fingerprint from before these dimensions stays what it was; the memory policy and the
        length are left out (a setup's policies and lengths share one fingerprint, each profile says its own)."""
        tags: dict[str, str] = {}
        if self.strategy != "ddp":
            tags["autotune.strategy"] = f"{self.strategy}x{self.world_size}"
        if self.strategy == "fsdp":
            # How fsdp holds a job changed (issue 33, item 5): bf16 is FSDP2's MixedPrecisionPolicy without
            # autocast, and the last block stays unsharded after forward; no earlier fsdp profile answers it.
            tags["autotune.fsdp_layout"] = "torchtitan"
        if not self.mesh.trivial:
            tags["autotune.mesh"] = self.mesh.label()
            if self.mesh.tp > 1 and self.tp_plan:
                tags["autotune.tp_plan"] = self.tp_plan
        return tags

    def kind(self) -> tuple[object, ...]:
        """The store's kind of a profile of this setup: profiles of one kind answer the same jobs, the newest
        first (the fingerprint, device, memory policy and length apart)."""
        sharded = self.world_size if self.strategy == "fsdp" else int(self.holds_ddp_buckets)
        loss = self.lm_loss or PLAIN_LOSS
        return (self.strategy, sharded, self.mesh.label(), self.offload, self.host_budget_bytes, self.compile, loss)
