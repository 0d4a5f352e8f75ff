"""suggest(model, target_batch): the one call a training script makes before it builds its DataLoader.

    from autotune_client import suggest

    s = suggest(model, target_batch=512, example=lambda m: make_batch(m))
    loader = DataLoader(dataset, batch_sampler=PlanBatchSampler(RandomSampler(dataset), s))
    # ... accumulate s.accumulation_steps micro-batches (s.micro_batches: sizes within one of each
    # other, autotune.PlanBatchSampler yields them) per optimizer step

The model's fingerprint is asked of the server; on a miss the setup is probed here, on this job's own
device (``autotune_client._local_probe``), the profile is uploaded, and the next job with the same setup
gets it from the store. torch and the probe are imported only inside these functions: ``import
autotune_client`` stays cheap and torch-free (``autotune.core``, which it imports, is torch-free).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.core import units
from autotune.core.errors import AutotuneError
from autotune.core.plan import PLAN_POLICIES
from autotune.core.policy_names import canonical_policy
from autotune.core.schemas import (
    OBJECTIVES,
    STRATEGIES,
    Profile,
    Suggestion,
    SuggestQuery,
    TagValue,
    shown_fingerprint,
)
from autotune_client._client import TunerClient
from autotune_client._constants import DEFAULT_TIMEOUT_SECONDS, ENV_URL
from autotune_client._distributed import DECISION_SLACK_SECONDS, in_process_group, one_decision
from autotune_client._local_probe import probe_locally, suggestion_from_profile
from autotune_client.errors import (
    APIConnectionError,
    AutotuneClientError,
    InternalServerError,
    NotFoundError,
    RateLimitError,
    TunerUnavailableWarning,
)

if TYPE_CHECKING:
    from torch import nn

    from autotune.tasks.task import LossFn, OptimizerFactory

__all__ = ["job_fingerprint", "parse_bytes", "suggest"]


def parse_bytes(value: int | str) -> int:
    """Bytes from an int or a size such as ``"64MiB"``, ``"1.5GiB"``, ``"80GB"`` or ``"80G"``: the units of
    :func:`autotune.core.units.parse_bytes`, the one parser of sizes (``autotune probe --budget`` uses it too).

    Raises:
        AutotuneClientError: not a positive size in a known unit.
    """
    if isinstance(value, bool):
        raise AutotuneClientError(f"budget must be bytes or a size like '4GiB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise AutotuneClientError(f"budget must be positive, got {value!r}")
        return value
    try:
        return units.parse_bytes(str(value))
    except ValueError as exc:
        raise AutotuneClientError(f"budget {value!r}: {exc}") from None


def job_fingerprint(
    model: nn.Module,
    *,
    example: Any,
    optimizer: OptimizerFactory | None = None,
    precision: str | None = None,
    tags: Mapping[str, TagValue] | None = None,
    seq_len: int | None = None,
    strategy: str = "ddp",
    world_size: int = 1,
    mesh: str = "",
    tp_plan: str | None = None,
) -> str:
    """The fingerprint :func:`suggest` asks the server for, without asking it.

    For launch scripts that query with ``autotune suggest --fingerprint``; the arguments mean what
    they mean for :func:`suggest`. Equal to ``autotune probe``'s fingerprint of a task with the same
    model, ``batch``, optimizer, precision and tags (with ``seq_len``: of the sequence-aware task, whose
    fingerprint leaves the length out), under the same strategy, world size and mesh (``--strategy fsdp
    --world-size N``, ``--tp 2``: their tags are the setup's, ``JobSetup.fingerprint_tags``).
    """
    from autotune.tasks.fingerprint import fingerprint_model

    _, one_sample = _batch_factory(example)
    _check_length(one_sample, seq_len)
    unwrapped = _unwrap(model)
    return fingerprint_model(
        unwrapped,
        one_sample,
        optimizer=optimizer,
        precision=precision or "fp32",
        tags={
            **(tags or {}),
            **_compilation(model),
            **_setup_tags(unwrapped, strategy, world_size, mesh, tp_plan),
        },
        seq_len=seq_len,
    )


def _setup_tags(
    model: nn.Module, strategy: str, world_size: int, mesh: str, tp_plan: str | None = None
) -> dict[str, str]:
    """The fingerprint's setup part, as the probe's (``autotune.tasks.fingerprint.job_setup_of``): the strategy,
    the world size, the mesh and under tp the plan (by its name, else the model's own), with the tag a task that
    names torchtitan's plan carries."""
    from types import SimpleNamespace

    from autotune.core.errors import TaskError
    from autotune.core.setup import JobSetup
    from autotune.tasks.tp_plan import TP_PLAN_NAMES, tp_plan_label, tp_plan_of

    if tp_plan is not None and tp_plan not in TP_PLAN_NAMES:
        raise AutotuneClientError(f"tp_plan {tp_plan!r}: not a plan's name; use one of {', '.join(TP_PLAN_NAMES)}")
    layout = _mesh(mesh)
    plan = None
    if layout.tp > 1:
        try:
            plan = tp_plan_label(tp_plan_of(model, SimpleNamespace(tp_plan=tp_plan)))
        except TaskError as exc:
            raise AutotuneClientError(str(exc)) from None
    tags = JobSetup.model_construct(
        strategy=strategy, world_size=world_size, mesh=layout, tp_plan=plan
    ).fingerprint_tags()
    if tp_plan == "torchtitan" and layout.tp > 1:
        tags["tp_plan"] = tp_plan  # ProbeTask's own tag for the plan's name
    return tags


def _mesh(text: str) -> Any:
    """The Mesh a ``mesh`` argument names (``Mesh.label``'s text), its refusal as the client's one line."""
    from autotune.core.errors import AutotuneError
    from autotune.core.mesh import Mesh

    try:
        return Mesh.parse(text)
    except AutotuneError as exc:
        raise AutotuneClientError(f"mesh: {exc}") from None


def suggest(
    model: nn.Module,
    target_batch: int | None = None,
    *,
    example: Any = None,
    world_size: int | None = None,
    loss: LossFn | None = None,
    optimizer: OptimizerFactory | None = None,
    precision: str | None = None,
    tags: Mapping[str, TagValue] | None = None,
    device: Any = None,
    budget: int | str | None = None,
    probe_if_missing: bool = True,
    client: TunerClient | None = None,
    strategy: str = "ddp",
    plan: str = "balanced",
    distributed: bool = True,
    objective: str = "memory",
    activation_checkpointing: str = "none",
    seq_len: int | None = None,
    target_tokens: int | None = None,
    mesh: str = "",
    tp_plan: str | None = None,
) -> Suggestion:
    """The micro-batch and accumulation steps for this job, measured rather than guessed.

    Call it before moving the model to its device: a model already on the GPU occupies memory a
    local probe would then count against the budget (the answer stays safe, only smaller).

    Args:
        model: the model as the script built it. It is never modified: weights, ``requires_grad``,
            device and train/eval mode are as they were, and torch's RNG state is restored after a
            local probe. A DDP wrapper is looked through; a ``torch.compile``'d model's compilation is passed
            on (its mode is the tag ``compile``: the probe measures the compiled step, docs/compile.md), or a
            warning says why it cannot be (another backend, options beyond a mode) and the model is measured eager.
        target_batch: the effective batch T the recipe asks for (samples per optimizer update).
        example: one batch of inputs as the model's loss takes it (its first sample is used), or
            a ``batch(m)`` callable returning a batch of m samples. Required: the input signature
            is part of what decides memory.
        world_size: every rank of the job; defaults to torch.distributed's world size when it is
            initialized, else ``$WORLD_SIZE``, else 1. Without a ``mesh`` these are the data-parallel replicas.
        loss: ``loss(model, batch) -> scalar`` for the local probe; None uses the task default.
        optimizer: factory taking the parameters (``lambda ps: torch.optim.AdamW(ps, lr=3e-4)``);
            None is AdamW. Part of the fingerprint.
        precision: "fp32" (default), "bf16" or "fp16". Part of the fingerprint.
        tags: facts that change memory and are not in the model (seq_len, checkpointing, ...).
        device: where the job trains; defaults to the model's device if on CUDA, else
            ``cuda:$LOCAL_RANK`` / the current CUDA device when CUDA is available, else the CPU.
        budget: bytes (or "4GiB") the job may use; required to probe on the CPU, optional on
            CUDA (the card's memory). Sent to the server, which predicts from other devices' fits.
        probe_if_missing: on a miss, probe here and upload; when False a miss raises.
        client: a TunerClient; None builds one from ``$AUTOTUNE_URL`` / ``$AUTOTUNE_TOKEN``. With no
            server configured at all, the job probes locally (with a warning).
        strategy: "ddp" (every rank holds the whole model) or "fsdp" (FSDP2 over ``world_size``
            ranks, which the store then matches exactly: one rank's memory depends on it; the fingerprint
            carries it, as the probe's does). A local probe runs with the same strategy and world size.
        mesh: the job's model parallelism as ``autotune suggest``'s ``--mesh`` text (``"tp=2"``,
            ``"tp=2,pp=2,pp_schedule=1f1b"``; '' for none): the fingerprint carries it, the plan is over the
            replicas ``world_size / (tp x pp x cp)``, and only profiles of that mesh answer. A mesh job is not
            probed locally on a miss (probe it with ``autotune probe --tp ...``).
        tp_plan: under a mesh with tp, the tensor-parallel plan's name the job applies, as ``autotune probe
            --tp-plan`` names it: "torchtitan" (sequence and loss parallel, autotune/tasks/tp_plan.py); None or
            "hf" for transformers' own. The fingerprint carries the plan, so a job finds the profiles of its own.
        plan: "balanced" (default: the fewest accumulation steps, with micro-batches that differ by
            at most one, e.g. 6 x 26 + 4 x 25 = 256 in 10 steps; feed them with
            ``autotune.loop.accumulate.PlanBatchSampler``) or "divisor" (equal micro-batches, e.g. 16 x 16).
            The adapters (``as_hf_training_args`` ...) give the best equal plan either way.
        distributed: under an initialized torch.distributed process group of several ranks (call
            it on every rank), rank 0 asks the store (or probes) and the others receive the same
            Suggestion: one decision per job. The others wait at most the client's timeout plus
            ``DECISION_SLACK_SECONDS``, or until rank 0's local probe ends. False: each rank
            decides on its own (and the only way when not every rank calls it).
        objective: "memory" (default: the answer for ``activation_checkpointing``) or "throughput":
            among the policies stored for this setup, the one whose plan was timed fastest; the
            Suggestion's ``activation_checkpointing`` says which (``as_hf_training_args`` turns on
            ``gradient_checkpointing`` for "full"). A local probe times its plan under
            ``activation_checkpointing``.
        activation_checkpointing: the job's memory policy: "none" (default), "every-K" (every K-th block of
            the model's ``nn.ModuleList`` recomputes its forward in the backward, K >= 2), "full" (every
            block), "op" (every block op by op, torchtitan's rule) or "op:OP/OP/..." (the named ops' outputs
            kept; autotune.core.policy_names).
        seq_len: a sequence-aware job's sequence length (the example's dimensions equal to it are
            the length): the store answers from its profile at that length, or predicts it from the
            memory surface of a probe over lengths (``autotune probe --seq-len``). The answer also
            says tokens per micro-batch and per update.
        target_tokens: tokens per update instead of ``target_batch`` (needs ``seq_len``): planned in
            sequences, with the deviation said where the tokens are not a whole number of them.

    Returns:
        A Suggestion: ``micro_batch``, ``accumulation_steps``, ``world_size``, ``effective_batch``,
        ``exact``, ``source`` ("measured", "predicted", "estimated" or "probed"), ``strategy``,
        ``profile_id`` and more.

    Raises:
        NotFoundError: nothing stored and ``probe_if_missing`` is False.
        APIConnectionError: server unreachable and ``probe_if_missing`` is False.
        APIStatusError: the server refused the request (bad token, invalid field).
        autotune.core.errors.AutotuneError: the local probe failed (its message says why).

    A warning (:class:`TunerUnavailableWarning`) says when the server could not be used; the same
    text is in ``Suggestion.warnings``. Talking to the server never takes longer than the client's
    timeout, retries included.
    """
    arguments = dict(locals())  # the call as made, for rank 0 to repeat without the process group
    if distributed and in_process_group():
        wait = (client.timeout if client is not None else DEFAULT_TIMEOUT_SECONDS) + DECISION_SLACK_SECONDS
        return one_decision(lambda: suggest(**{**arguments, "distributed": False}), wait_seconds=wait)
    call = _Call(**arguments)
    target_batch, token_note = _validated(call)
    job = _resolved(call, target_batch)
    notes: list[str] = []
    with _tuner(client) as tuner:
        answer, upload_to = _ask(tuner, call, job, notes)
        if answer is None:
            profile = _probe(call, job, notes)
            profile_id = _upload(profile, upload_to, notes)
            answer = suggestion_from_profile(profile, job.target_batch, job.world_size, profile_id, notes, plan)
    return _in_tokens(answer, seq_len, target_tokens, token_note)


@dataclass(frozen=True)
class _Call:
    """The arguments of one :func:`suggest` call as given (its docstring says what each means)."""

    model: nn.Module
    target_batch: int | None
    example: Any
    world_size: int | None
    loss: LossFn | None
    optimizer: OptimizerFactory | None
    precision: str | None
    tags: Mapping[str, TagValue] | None
    device: Any
    budget: int | str | None
    probe_if_missing: bool
    client: TunerClient | None
    strategy: str
    plan: str
    distributed: bool
    objective: str
    activation_checkpointing: str
    seq_len: int | None
    target_tokens: int | None
    mesh: str
    tp_plan: str | None


@dataclass(frozen=True)
class _Job:
    """What a call resolves to: the store's key and what a local probe measures, defaults filled in."""

    model: nn.Module
    fingerprint: str
    target_batch: int
    world_size: int
    batch_fn: Callable[[int], Any]
    precision: str
    tags: dict[str, TagValue]
    device_spec: str
    device_name: str
    budget_bytes: int | None


def _validated(call: _Call) -> tuple[int, str | None]:
    """The target in sequences per update and the note on it, once the choices are known ones."""
    target_batch, token_note = _target_in_sequences(
        call.target_batch, call.target_tokens, call.seq_len, call.world_size
    )
    if call.strategy not in STRATEGIES:
        raise AutotuneClientError(f"strategy must be one of {', '.join(STRATEGIES)}, got {call.strategy!r}")
    if call.plan not in PLAN_POLICIES:
        raise AutotuneClientError(f"plan must be one of {', '.join(PLAN_POLICIES)}, got {call.plan!r}")
    if call.objective not in OBJECTIVES:
        raise AutotuneClientError(f"objective must be one of {', '.join(OBJECTIVES)}, got {call.objective!r}")
    try:
        canonical_policy(call.activation_checkpointing)
    except ValueError as exc:
        raise AutotuneClientError(f"activation_checkpointing: {exc}") from None
    return target_batch, token_note


def _resolved(call: _Call, target_batch: int) -> _Job:
    """The call's defaults filled in (world size, device, precision), its example turned into batches, its
    budget read, and the fingerprint taken."""
    from autotune.tasks.fingerprint import fingerprint_model

    model = _unwrap(call.model)
    world = _resolve_world_size(call.world_size)
    layout = _mesh(call.mesh)
    try:
        replicas = layout.data_parallel(world)
    except AutotuneError as exc:
        raise AutotuneClientError(f"mesh {call.mesh!r}: {exc}") from None
    if target_batch < replicas:
        over = f"world_size {world}"
        if not layout.trivial:
            over = f"the {replicas} replicas of {over} over {call.mesh}"
        raise AutotuneClientError(
            f"target_batch {target_batch} is smaller than {over}: every replica needs at least one sample per update"
        )
    batch_fn, one_sample = _batch_factory(call.example)
    _check_length(one_sample, call.seq_len)
    precision = call.precision or "fp32"
    tags = {**(call.tags or {}), **_compilation(call.model)}
    device_spec = _job_device(model, call.device)
    budget_bytes = parse_bytes(call.budget) if call.budget is not None else None
    setup_tags = _setup_tags(model, call.strategy, world, call.mesh, call.tp_plan)
    # The setup's tags go into the key only: the local probe's task adds them itself (task_fingerprint).
    fingerprint = fingerprint_model(
        model,
        one_sample,
        optimizer=call.optimizer,
        precision=precision,
        tags={**tags, **setup_tags},
        seq_len=call.seq_len,
    )
    return _Job(
        model=model,
        fingerprint=fingerprint,
        target_batch=target_batch,
        world_size=world,
        batch_fn=batch_fn,
        precision=precision,
        tags=tags,
        device_spec=device_spec,
        device_name=_device_name(device_spec),
        budget_bytes=budget_bytes,
    )


@contextlib.contextmanager
def _tuner(client: TunerClient | None) -> Iterator[TunerClient | None]:
    """The server to ask: the client given, else one built from ``$AUTOTUNE_URL`` (closed after the
    call), else None (no server configured)."""
    if client is not None or not os.environ.get(ENV_URL, "").strip():
        yield client
        return
    own_client = TunerClient()
    try:
        yield own_client
    finally:
        own_client.close()


def _ask(
    tuner: TunerClient | None, call: _Call, job: _Job, notes: list[str]
) -> tuple[Suggestion | None, TunerClient | None]:
    """The store's answer, or (None, where a local probe's profile goes) on a miss that a probe may fill:
    the tuner itself when it works and lacks this setup, None when it is absent or unavailable (the
    reason is warned and added to ``notes``).

    Raises:
        AutotuneClientError: no server, or a miss or an outage, and ``probe_if_missing`` is False.
    """
    if tuner is None:
        if not call.probe_if_missing:
            raise AutotuneClientError(f"no tuner server: pass client= or set {ENV_URL} (or allow a local probe)")
        notes.append(_warn(f"no tuner server configured (${ENV_URL} unset): probing locally, nothing is stored"))
        return None, None
    try:
        answer = tuner._suggest_query(_query(call, job))
        return answer, None
    except NotFoundError:
        if not call.probe_if_missing:
            raise
        if call.mesh:
            raise AutotuneClientError(
                f"no profile of this job's mesh ({call.mesh}) in the store, and a mesh job is not probed locally: "
                "probe it with `autotune probe TASK --tp ... --server URL` (or estimate it), then ask again"
            ) from None
        return None, tuner  # the server works and lacks this setup: it gets the profile
    except (APIConnectionError, InternalServerError, RateLimitError) as exc:
        if not call.probe_if_missing:
            raise
        notes.append(_warn(f"tuner unavailable ({exc}): probing locally, the profile is not uploaded"))
        return None, None


def _query(call: _Call, job: _Job) -> SuggestQuery:
    """What the store is asked: the job as resolved (the target in sequences), the call's choices as given
    (validated by ``_validated``; the server validates the rest)."""
    return SuggestQuery.model_construct(
        fingerprint=job.fingerprint,
        device_name=job.device_name,
        target_batch=job.target_batch,
        world_size=job.world_size,
        budget_bytes=job.budget_bytes,
        seq_len=call.seq_len,
        strategy=call.strategy,
        plan=call.plan,
        activation_checkpointing=call.activation_checkpointing,
        objective=call.objective,
        mesh=_mesh(call.mesh).label(),
    )


def _probe(call: _Call, job: _Job, notes: list[str]) -> Profile:
    """The job probed here (:func:`autotune_client._local_probe.probe_locally`), its profile stamped with
    the job's fingerprint and length."""
    profile = probe_locally(
        job.model,
        job.batch_fn,
        loss=call.loss,
        optimizer=call.optimizer,
        precision=job.precision,
        tags=job.tags,
        device_spec=job.device_spec,
        budget_bytes=job.budget_bytes,
        target_batch=job.target_batch,
        world_size=job.world_size,
        strategy=call.strategy,
        plan_policy=call.plan,
        activation_checkpointing=call.activation_checkpointing,
        throughput=call.objective == "throughput",
    )
    if call.seq_len is not None:
        # Measured at the job's one length: stored as the sequence-aware setup's profile at it.
        profile.fingerprint, profile.seq_len = job.fingerprint, call.seq_len
    if profile.fingerprint != job.fingerprint:
        # Should not happen (same function, same inputs); if it does, an upload would be
        # stored under a key no job asks for, so say so rather than fill the store silently.
        notes.append(
            _warn(
                f"the probe's fingerprint {shown_fingerprint(profile.fingerprint)} differs from the job's "
                f"{shown_fingerprint(job.fingerprint)}"
            )
        )
    return profile


def _upload(profile: Profile, upload_to: TunerClient | None, notes: list[str]) -> int | None:
    """The stored profile's id, or None when there is nowhere to upload or the upload failed (warned)."""
    if upload_to is None:
        return None
    try:
        return upload_to.upload(profile)
    except AutotuneClientError as exc:
        notes.append(_warn(f"the probed profile was not uploaded: {exc}"))
        return None


def _target_in_sequences(
    target_batch: int | None, target_tokens: int | None, seq_len: int | None, world_size: int | None
) -> tuple[int, str | None]:
    """The target in sequences per update (``autotune.core.plan.target_in_sequences``)."""
    from autotune.core.plan import TargetError, target_in_sequences

    replicas = _resolve_world_size(world_size) if target_tokens is not None else 1
    try:
        batch, note = target_in_sequences(target_batch, target_tokens, seq_len, replicas)
    except TargetError as exc:
        raise AutotuneClientError(str(exc)) from None
    assert batch is not None  # required
    return batch, note


def _in_tokens(answer: Suggestion, seq_len: int | None, target_tokens: int | None, note: str | None) -> Suggestion:
    """The answer in tokens too, for a job with a length (as the server says it)."""
    from autotune.core.plan import in_tokens

    return in_tokens(answer, seq_len, target_tokens, note)


def _warn(message: str, *, stacklevel: int = 4) -> str:
    # 4: the frame that called suggest() (above _warn, the step that warns, and suggest itself).
    warnings.warn(message, TunerUnavailableWarning, stacklevel=stacklevel)
    return message


def _compilation(model: Any) -> dict[str, TagValue]:
    """The tag ``compile`` of a ``torch.compile``'d model (its mode), passed on instead of looked through; a
    warning where its compilation cannot be repeated (the model is then measured eager)."""
    from autotune.measure.meters.compiled import compiled_mode_of

    mode, why = compiled_mode_of(model)
    if why is not None:
        _warn(f"autotune: {why}", stacklevel=5)
    return {} if mode is None else {"compile": mode}


def _unwrap(model: Any) -> nn.Module:
    from torch import nn

    # DDP's module tree has a "module." prefix and torch.compile's an "_orig_mod.": the fingerprint is the
    # wrapped model's (a compiled model's mode is the tag compile: _compilation).
    for _ in range(4):
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    if not isinstance(model, nn.Module):
        raise AutotuneClientError(f"suggest() needs a torch.nn.Module, got {type(model).__name__}")
    return model


def _resolve_world_size(world_size: int | None) -> int:
    if world_size is not None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise AutotuneClientError(f"world_size must be a positive integer, got {world_size!r}")
        return world_size
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    env = os.environ.get("WORLD_SIZE", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise AutotuneClientError(f"WORLD_SIZE={env!r} is not a positive integer")
        return int(env)
    return 1


def _check_length(sample: Any, seq_len: int | None) -> None:
    """The job's length is a dimension of its example's sample: what a local probe measures, and what the
    store's profile at seq_len was made at. An example made at another length would be measured at that one and
    stored (and answered) as seq_len's.

    Raises:
        AutotuneClientError: no dimension of any tensor of the sample (past the batch one) is seq_len.
    """
    if seq_len is None:
        return
    from autotune.tasks.batches import tensors

    shapes = [tuple(t.shape[1:]) for t in tensors(sample)]
    if not any(seq_len in shape for shape in shapes):
        said = ", ".join(str(list(shape)) for shape in shapes)
        raise AutotuneClientError(
            f"seq_len {seq_len}: no dimension of the example's sample is {seq_len} (its shapes without the batch "
            f"dimension: {said}): make the example at the job's length, which is what is measured and answered"
        )


def _batch_factory(example: Any) -> tuple[Callable[[int], Any], Any]:
    """(batch(m), a batch of one sample) from what the caller gave."""
    import torch

    from autotune.tasks.batches import has_tensor, map_tensors

    if example is None:
        raise AutotuneClientError(
            "suggest() needs example=: a batch of inputs (its first sample is used) or a batch(m) "
            "callable, because the input shape decides memory as much as the model does"
        )
    if callable(example) and not isinstance(example, torch.Tensor):
        # The sample may be random; drawing it must not shift the job's seeded stream.
        with torch.random.fork_rng(devices=[]):
            one = example(1)
        if not has_tensor(one):
            raise AutotuneClientError("example(1) returned no tensor: batch(m) must return tensors")
        return example, one

    if not has_tensor(example):
        raise AutotuneClientError(f"example holds no tensor (got {type(example).__name__})")

    def first(t: torch.Tensor) -> torch.Tensor:
        # A CPU copy of sample 0: the probe makes batches on the CPU and moves them itself, and the
        # caller's tensor stays untouched.
        return (t[:1] if t.dim() > 0 else t).detach().to("cpu", copy=True)

    one = map_tensors(first, example)

    def batch(m: int) -> Any:
        return map_tensors(lambda t: t.repeat(m, *([1] * (t.dim() - 1))) if t.dim() > 0 else t.clone(), one)

    return batch, one


def _job_device(model: nn.Module, device: Any) -> str:
    import torch

    if device is not None:
        dev = torch.device(device) if not isinstance(device, torch.device) else device
    else:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        if first is not None and first.device.type == "cuda":
            dev = first.device
        elif torch.cuda.is_available():
            local_rank = os.environ.get("LOCAL_RANK", "").strip()
            index = int(local_rank) if local_rank.isdigit() else torch.cuda.current_device()
            dev = torch.device("cuda", index)
        else:
            dev = torch.device("cpu")
    if dev.type == "cuda":
        return f"cuda:{dev.index if dev.index is not None else torch.cuda.current_device()}"
    if dev.type == "cpu":
        return "cpu"
    raise AutotuneClientError(f"autotune measures CPU and CUDA devices, not {dev.type!r}")


def _device_name(device_spec: str) -> str:
    from autotune.measure.meters import describe_device

    return describe_device(device_spec).name
