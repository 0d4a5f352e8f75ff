"""The steps an emulated card's estimate predicts the time of, recorded in the child (``job: search`` with
``predict``): after the search, one fake trial at each size the profile's timings need (m_max and the plan's sizes)
runs with its ops and collectives counted (autotune/measure/op_counter.py), on a model built for it, so that no
search trial pays for the counting. The parent prices the records on the card (autotune/orchestrate/predicted.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from autotune.core.setup import JobSetup
from autotune.core.step_records import StepRecord, mesh_dim

__all__ = ["record_stage_steps", "record_steps", "sizes_to_record"]


def sizes_to_record(job: JobSetup, max_micro_batch: int, predict: dict[str, Any], multiple_of: int) -> list[int]:
    """m_max and the sizes of the plan the parent will make at m_max (``JobSetup.plan``, the one every reader makes).

    >>> sizes_to_record(JobSetup(world_size=2), 26, {"target_batch": 512, "plan_policy": "balanced"}, 1)
    [25, 26]
    >>> sizes_to_record(JobSetup(), 8, {"target_batch": None}, 1)
    [8]
    """
    sizes = {max_micro_batch}
    target = predict.get("target_batch")
    if target:
        try:
            plan = job.plan(max_micro_batch, int(target), multiple_of=multiple_of,
                            policy=predict.get("plan_policy") or "balanced")  # fmt: skip
            sizes.update(size for size, _ in plan.micro_batches)
        except ValueError:  # the parent says why there is no plan; m_max's timing stands
            pass
    return sorted(sizes)


def record_steps(task: Any, job: JobSetup, strategy: Any, device_name: str, sizes: Sequence[int],
                 budget_bytes: int, *, full_walk: bool = False) -> tuple[list[dict[str, Any]], str]:  # fmt: skip
    """Each size's StepRecord (as JSON) from a counted fake trial on a model of its own, inside the strategy's
    process group; a size whose trial ran out of the card's memory is left out (its timing is not predicted). A model
    of identical blocks is recorded cut to three depths and its record made at its own depth (autotune/search/
    depth_steps.py), unless ``full_walk``. The second item: the datasheet's line on how the depth was recorded
    (empty where the whole model was, as asked or too shallow to cut)."""
    from autotune.search.depth import plan_shortcut
    from autotune.search.depth_steps import NoRepetition, record_depths
    from autotune.search.depth_walks import cut_task

    planned = None if full_walk else plan_shortcut(task, strategy)
    depths = record_depths(planned[0].count, planned[1]) if isinstance(planned, tuple) else None
    line = ""
    if isinstance(planned, tuple) and depths is not None:
        blocks = planned[0]
        cuts = [_recorded(cut_task(task, blocks, d), job, strategy, device_name, sizes, budget_bytes) for d in depths]
        walked = ", ".join(map(str, depths))
        try:
            if not cuts[0].keys() == cuts[1].keys() == cuts[2].keys():
                raise NoRepetition("a cut ran out of the card's memory where another did not")
            made = [_made(job, [cut[size] for cut in cuts], depths, blocks.count) for size in cuts[0]]
        except NoRepetition as exc:
            line = f"depth: the recorded step walked every block (its cuts to {walked} blocks: {exc})"
        else:
            return (
                made,
                f"depth: the step whose time is predicted recorded from cuts to {walked} of the {blocks.count} blocks",
            )
    whole = _recorded(task, job, strategy, device_name, sizes, budget_bytes)
    return [_finished(job, *recorded) for recorded in whole.values()], line


def _made(job: JobSetup, trio: list[_Recorded], depths: Sequence[int], depth: int) -> dict[str, Any]:
    """One size's record at ``depth`` from its records at the three cuts, with the whole model's parameters and
    configured attention FLOPs grown as the blocks grow."""
    from autotune.search.depth_steps import extrapolate, grown

    record = extrapolate([recorded[0] for recorded in trio], depths, depth)
    parameters = None if trio[0][1] is None else grown([r[1] or 0 for r in trio], depths, depth)
    configured = None if trio[0][2] is None else grown([r[2] or 0 for r in trio], depths, depth)
    return _finished(job, record, parameters, configured, trio[0][3])


def _finished(job: JobSetup, record: StepRecord, parameters: int | None, configured: int | None,
              tokens: int) -> dict[str, Any]:  # fmt: skip
    """The record with its model FLOPs per token (torchtitan's: autotune/measure/op_counter.py), as JSON."""
    from autotune.measure.op_counter import attention_forward_flops, flops_per_token_of

    flops: float | None = None
    if record.tokens_per_sample and parameters is not None:
        attention = attention_forward_flops(record)
        flops = flops_per_token_of(parameters, configured, attention, tokens=tokens, tp=job.mesh.tp)
    return record.model_copy(update={"flops_per_token": flops}).model_dump(mode="json")


# A size's record (its FLOPs per token left out) and what they are made of: the model's non-embedding parameters
# (None: no model), its configured attention FLOPs (None: none configured), the rank's tokens of the micro-batch.
_Recorded = tuple[StepRecord, int | None, int | None, int]


def _recorded(task: Any, job: JobSetup, strategy: Any, device_name: str, sizes: Sequence[int],
              budget_bytes: int) -> dict[int, _Recorded]:  # fmt: skip
    """Each size's record (its FLOPs per token left out) with what they are made of: the model's non-embedding
    parameters, its configured attention FLOPs (None: none configured) and the rank's tokens of the micro-batch."""
    from autotune.measure.meters.fake import FakeMeter
    from autotune.measure.op_counter import (
        OpCounter,
        configured_attention_flops,
        ddp_buckets,
        non_embedding_parameters,
    )
    from autotune.measure.trial import TrialRunner

    meter = FakeMeter(budget_bytes, "cuda", device_name)
    runner = TrialRunner(task, meter, limit_bytes=budget_bytes, strategy=strategy)
    mesh = job.mesh
    tokens_per_sample = task.seq_len if task.seq_len is not None else _tagged_length(task)
    recorded: dict[int, _Recorded] = {}
    try:
        runner.build()
        for size in sizes:
            counter = OpCounter(meter, world_size=job.world_size, mesh=mesh)
            meter.release()
            with counter.counting():
                trial = runner(int(size))
            if trial.oom:
                continue
            record = counter.record(int(size), seq_len=task.seq_len)
            update: dict[str, Any] = {"tokens_per_sample": tokens_per_sample}
            model = runner.model
            if job.holds_ddp_buckets and model is not None:  # fake trials hold DDP's buckets and reduce nothing
                replicas = job.data_parallel * mesh.cp
                dim = mesh_dim(replicas, mesh.tp, world_size=job.world_size, tp=mesh.tp, cp=mesh.cp, pp=mesh.pp)
                update["ddp_buckets"] = ddp_buckets(model, replicas=replicas, stride=mesh.tp, dim=dim)
            parameters, configured = None, None
            if model is not None:
                parameters = non_embedding_parameters(model)
                attention = configured_attention_flops(model, record.seq_len)
                configured = None if attention is None else int(attention)
            tokens = int(size) * (tokens_per_sample or 0) // mesh.cp  # the rank's share of each sequence under cp
            step = StepRecord.model_validate({**record.model_dump(), **update})
            recorded[int(size)] = (step, parameters, configured, tokens)
    finally:
        runner.close()
    return recorded


def _tagged_length(task: Any) -> int | None:
    """The length a task that is not sequence-aware says its samples have (its ``seq_len`` tag), if any."""
    value = task.tags.get("seq_len")
    return value if isinstance(value, int) and value > 0 else None


def record_stage_steps(
    task: Any, job: JobSetup, meter: Any, sizes: Sequence[int], budget_bytes: int
) -> list[dict[str, Any]]:
    """Each pipeline stage's StepRecord (as JSON) at each size: the stage's replay of its schedule (K micro-batches,
    two updates: autotune/measure/pipeline.py) counted on the fake meter, inside its strategy's process group; the
    parent takes the slowest stage's. A size where a stage ran out of the card's memory is left out."""
    from autotune.measure.op_counter import OpCounter
    from autotune.measure.strategy_choice import make_strategy
    from autotune.search.pipelined import measured_microbatches, pipeline_trials

    mesh = job.mesh
    strategy = make_strategy(job.strategy, job.world_size, mesh)
    trials = pipeline_trials(task, meter, mesh, strategy, budget_bytes)
    k = measured_microbatches(mesh)
    tokens_per_sample = task.seq_len if task.seq_len is not None else _tagged_length(task)
    recorded: list[dict[str, Any]] = []
    try:
        with strategy.process_group(meter.device):
            for size in sizes:
                records = []
                for stage in range(mesh.pp):
                    counter = OpCounter(meter, world_size=job.world_size, mesh=mesh)
                    with counter.counting():
                        _, oom = trials.measure_stage(stage, int(size))
                    if oom:
                        break
                    record = counter.stage_record(int(size), stage=stage, microbatches=k, seq_len=task.seq_len)
                    records.append(record.model_copy(update={"tokens_per_sample": tokens_per_sample}))
                else:
                    flops = _stage_flops_per_token(task, records, int(size), k, tokens_per_sample, mesh.tp, mesh.cp)
                    recorded.extend(
                        record.model_copy(update={"flops_per_token": flops}).model_dump(mode="json")
                        for record in records
                    )
    finally:
        trials.close()
    return recorded


def _stage_flops_per_token(
    task: Any, records: list[StepRecord], size: int, k: int, length: int | None, tp: int, cp: int
) -> float | None:
    """torchtitan's model FLOPs per token of a pipeline's whole model: its parameters (the meta model's) and every
    stage's forward attention over its K micro-batches."""
    from autotune.measure.op_counter import (
        attention_forward_flops,
        configured_attention_flops,
        flops_per_token_of,
        non_embedding_parameters,
    )
    from autotune.measure.trial import build_on_meta

    model = build_on_meta(task)
    if model is None or not length:
        return None
    configured = configured_attention_flops(model, length)
    attention = sum(attention_forward_flops(record) for record in records)
    return flops_per_token_of(
        non_embedding_parameters(model), configured, attention, tokens=k * size * length // cp, tp=tp
    )
