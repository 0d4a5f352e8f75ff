"""The device mesh of a job: how its W ranks split into tensor-, pipeline- and context-parallel groups, and
the data-parallel replicas D that are left. Pure arithmetic, no torch.

W counts every rank. The ranks that share one model through tensor (``tp``), pipeline (``pp``) or context
(``cp``) parallelism are not replicas, so the data-parallel degree is ``D = W / (tp x pp x cp)`` and the plan
holds ``T = m x A x D`` with that D (``autotune/core/plan.py``). A pipeline cuts each step's batch into K
micro-batches that flow through its ``pp`` stages; while the first stage starts and the last one drains,
stages idle: the bubble, a fraction ``(pp - 1) / (K + pp - 1)`` of a step (``(pp - 1) / (V K + pp - 1)``
with V virtual stages per rank under the interleaved schedule). Expert parallelism (``ep``) shards a mixture of
experts' routed experts over ep of the ranks that share one stage (dp x cp x tp, as torchtitan borrows them); it
leaves D as it is, and the experts' own data parallelism is ``efsdp = W / (pp x ep)``
(autotune/measure/experts.py).

    >>> mesh = Mesh(tp=2, pp=2, pp_microbatches=8)
    >>> mesh.data_parallel(16)
    4
    >>> round(mesh.bubble_fraction(), 4)
    0.1111
    >>> Mesh().trivial, mesh.as_dict()
    (True, {'tp': 2, 'pp': 2, 'pp_schedule': '1f1b', 'pp_microbatches': 8})

The trivial mesh (every degree 1) is every job before meshes: it records nothing (``as_dict`` is empty), so
fingerprints and profiles without a mesh are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from autotune.core.errors import AutotuneError

__all__ = ["PP_SCHEDULES", "Mesh", "PipelineSchedule"]

PipelineSchedule = Literal["1f1b", "gpipe", "interleaved-1f1b"]
PP_SCHEDULES: tuple[PipelineSchedule, ...] = ("1f1b", "gpipe", "interleaved-1f1b")
# The virtual stages per rank the interleaved schedule runs when --pp-virtual-stages is not given.
DEFAULT_VIRTUAL_STAGES = 2


def _positive(value: object, flag: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AutotuneError(f"{flag} must be a positive integer, got {value!r}")
    return value


def _number(text: str, key: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise AutotuneError(f"mesh: {key}={text!r} is not a number") from None


def _integer(text: str, key: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise AutotuneError(f"mesh: {key}={text!r} is not an integer") from None


@dataclass(frozen=True)
class Mesh:
    """The parallel degrees of a job besides data parallelism, and its pipeline's schedule.

    ``pp_microbatches`` is K, the micro-batches per optimizer step the schedule runs (None: the plan's
    accumulation steps). ``pp_virtual_stages`` is V, the model chunks per pipeline rank, under
    ``interleaved-1f1b`` only.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    pp_schedule: PipelineSchedule = "1f1b"
    pp_microbatches: int | None = None
    pp_virtual_stages: int | None = None
    ep: int = 1
    # Token dropping under ep (``--moe-capacity-factor``): each expert takes at most ceil(c x T k / E) of a rank's
    # T x k picks, the rest dropped (GShard, Switch); None: dropless (torchtitan's and Megatron's default).
    ep_capacity: float | None = None

    @property
    def model_parallel(self) -> int:
        """The ranks that hold one model between them: tp x pp x cp."""
        return self.tp * self.pp * self.cp

    @property
    def trivial(self) -> bool:
        """Whether every rank holds the whole model and the whole sequence (the job before meshes)."""
        return self.model_parallel == 1 and self.ep == 1

    @property
    def virtual_stages(self) -> int:
        """V: the model chunks each pipeline rank holds (1 but under the interleaved schedule)."""
        if self.pp_schedule != "interleaved-1f1b":
            return 1
        return self.pp_virtual_stages or DEFAULT_VIRTUAL_STAGES

    def validate(self, world_size: int | None = None) -> None:
        """Refuse, in one line naming the flag and the cause, a mesh no job runs.

        Raises:
            AutotuneError: a degree that is not a positive integer, a schedule this does not know, virtual
                stages outside the interleaved schedule, K < pp under a 1F1B schedule, or (given world_size)
                a mesh whose product does not divide it.
        """
        for flag, value in (("--tp", self.tp), ("--pp", self.pp), ("--cp", self.cp), ("--ep", self.ep)):
            _positive(value, flag)
        if self.ep_capacity is not None:
            if isinstance(self.ep_capacity, bool) or not isinstance(self.ep_capacity, (int, float)):
                raise AutotuneError(f"--moe-capacity-factor must be a number, got {self.ep_capacity!r}")
            if not 0 < self.ep_capacity < float("inf"):
                raise AutotuneError(
                    f"--moe-capacity-factor {self.ep_capacity:g} is not a positive finite number: each expert's "
                    "capacity is that many times its fair share of a rank's tokens"
                )
            if self.ep == 1:
                raise AutotuneError(
                    f"--moe-capacity-factor {self.ep_capacity:g} needs --ep of at least 2: it sizes the experts' "
                    "all-to-all, which only expert parallelism runs"
                )
        if self.pp_schedule not in PP_SCHEDULES:
            raise AutotuneError(f"--pp-schedule must be one of {', '.join(PP_SCHEDULES)}, got {self.pp_schedule!r}")
        if self.pp_microbatches is not None:
            _positive(self.pp_microbatches, "--pp-microbatches")
            if self.pp == 1:
                raise AutotuneError(
                    f"--pp-microbatches {self.pp_microbatches} needs --pp of at least 2: without a pipeline the "
                    "micro-batches per step are the plan's accumulation steps"
                )
        if self.pp_virtual_stages is not None:
            _positive(self.pp_virtual_stages, "--pp-virtual-stages")
            if self.pp_schedule != "interleaved-1f1b":
                raise AutotuneError(
                    f"--pp-virtual-stages {self.pp_virtual_stages} applies to --pp-schedule interleaved-1f1b "
                    f"only (got --pp-schedule {self.pp_schedule})"
                )
        if self.pp == 1 and self.pp_schedule != "1f1b":
            raise AutotuneError(f"--pp-schedule {self.pp_schedule} needs --pp of at least 2 (got --pp 1)")
        if self.pp_schedule != "gpipe" and self.pp_microbatches is not None and self.pp_microbatches < self.pp:
            raise AutotuneError(
                f"--pp-microbatches {self.pp_microbatches} is below --pp {self.pp}: under --pp-schedule "
                f"{self.pp_schedule} every stage needs a micro-batch in flight (K >= pp)"
            )
        if world_size is not None and world_size % self.model_parallel:
            raise AutotuneError(
                f"--world-size {world_size} is not a multiple of --tp x --pp x --cp = {self.tp} x {self.pp} x "
                f"{self.cp} = {self.model_parallel}: the data-parallel replicas would not be whole"
            )
        if world_size is not None and (world_size // self.pp) % self.ep:
            raise AutotuneError(
                f"--ep {self.ep} does not divide the {world_size // self.pp} ranks of a stage (--world-size "
                f"{world_size} over --pp {self.pp}): each expert's shard would not have whole data-parallel ranks"
            )

    def data_parallel(self, world_size: int) -> int:
        """D: the data-parallel replicas of world_size ranks, W / (tp x pp x cp).

        Raises:
            AutotuneError: the mesh is not valid, or its product does not divide world_size.
        """
        self.validate(world_size)
        return world_size // self.model_parallel

    def bubble_fraction(self, microbatches: int | None = None) -> float:
        """The share of a step a pipeline stage idles: (pp - 1) / (V K + pp - 1), 0 without a pipeline.

        Args:
            microbatches: K (default: ``pp_microbatches``; the bubble of a given K when the plan chose it).

        Raises:
            AutotuneError: a pipeline with no K given here or in the mesh.
        """
        if self.pp == 1:
            return 0.0
        k = microbatches if microbatches is not None else self.pp_microbatches
        if k is None:
            raise AutotuneError("the pipeline's bubble needs its micro-batches per step: give --pp-microbatches")
        return (self.pp - 1) / (self.virtual_stages * _positive(k, "--pp-microbatches") + self.pp - 1)

    def as_dict(self) -> dict[str, Any]:
        """The mesh as a profile and the fingerprint record it: only what differs from the trivial mesh
        (empty for it), the pipeline's schedule only with a pipeline."""
        out: dict[str, Any] = {
            name: getattr(self, name) for name in ("tp", "pp", "cp", "ep") if getattr(self, name) != 1
        }
        if self.ep_capacity is not None:  # as text: a profile's mesh holds integers and names
            out["ep_capacity"] = f"{self.ep_capacity:g}"
        if self.pp > 1:
            out["pp_schedule"] = self.pp_schedule
            for name in ("pp_microbatches", "pp_virtual_stages"):
                if getattr(self, name) is not None:
                    out[name] = getattr(self, name)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Mesh:
        """The mesh as_dict wrote (the trivial one for None or an empty dict)."""
        if not data:
            return cls()
        known = {"tp", "pp", "cp", "ep", "ep_capacity", "pp_schedule", "pp_microbatches", "pp_virtual_stages"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise AutotuneError(f"mesh: unknown field(s) {', '.join(unknown)}")
        if isinstance(data.get("ep_capacity"), str):
            data = {**data, "ep_capacity": _number(data["ep_capacity"], "ep_capacity")}
        mesh = cls(**data)
        mesh.validate()
        return mesh

    def label(self) -> str:
        """The mesh in one short text, as the fingerprint's tag and /suggest's ``mesh`` parameter carry it:
        ``tp=2,pp=2,pp_schedule=1f1b`` ('' for the trivial mesh); :meth:`parse` reads it back."""
        return ",".join(f"{key}={value}" for key, value in self.as_dict().items())

    @classmethod
    def parse(cls, text: str) -> Mesh:
        """The mesh :meth:`label` wrote ('' is the trivial one).

        Raises:
            AutotuneError: a part that is not KEY=VALUE, an unknown key, or a mesh no job runs.
        """
        data: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep:
                raise AutotuneError(f"mesh: {part!r} is not KEY=VALUE (e.g. tp=2,pp=2)")
            name = key.strip()
            if name == "ep_capacity":
                data[name] = _number(value, name)
            else:
                data[name] = value.strip() if name == "pp_schedule" else _integer(value, key)
        return cls.from_dict(data)

    def describe(self) -> str:
        """One line for a datasheet: 'tp 2 x pp 2 (1f1b, K 8)', 'no model parallelism' for the trivial mesh."""
        if self.trivial:
            return "no model parallelism"
        parts = [f"{name} {getattr(self, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(self, name) != 1]
        text = " x ".join(parts)
        if self.pp > 1:
            schedule: str = self.pp_schedule
            if self.pp_schedule == "interleaved-1f1b":
                schedule += f", V {self.virtual_stages}"
            if self.pp_microbatches is not None:
                schedule += f", K {self.pp_microbatches}"
            text += f" ({schedule})"
        if self.ep > 1:  # how the experts' all-to-all is sized
            text += " (dropless)" if self.ep_capacity is None else f" (capacity factor {self.ep_capacity:g})"
        return text
