"""Human text for trials and profiles (the CLI's progress lines and the datasheet). Torch-free."""

from __future__ import annotations

from typing import Any

from autotune.core.plan import micro_batches_text
from autotune.core.schemas import (
    ATTENTION_NOTE,
    MEMORY_PART_LABELS,
    Device,
    LongestSeqLen,
    MemoryBreakdown,
    Profile,
    Throughput,
    Trial,
    shown_fingerprint,
)
from autotune.core.units import format_bytes
from autotune.measure.fragmentation import gap_advice

__all__ = [
    "datasheet",
    "device_text",
    "finetune_lines",
    "loss_lines",
    "lengths_datasheet",
    "longest_line",
    "offload_lines",
    "strategy_text",
    "trial_counts",
    "trial_line",
]


_POLICY_TEXT = {
    "none": "none",
    "every-2": "every-2 (every other block recomputes its forward)",
    "full": "full (every block recomputes its forward)",
    "op": "op (every block op by op, torchtitan's rule: matmul and attention outputs kept, every second matmul "
    "and the rest recomputed)",
}


def _policy_text(policy: str) -> str:
    if policy in _POLICY_TEXT:
        return _POLICY_TEXT[policy]
    if policy.startswith("every-"):
        k = policy.removeprefix("every-")
        return f"{policy} (the first block and every {k}th after it recompute their forward)"
    if policy.startswith("budget:"):
        return f"{policy} (the compiler's activation memory budget: its partitioner keeps {policy[7:]} of the min-cut)"
    return f"{policy} (every block op by op, keeping the outputs of {policy.removeprefix('op:').replace('/', ', ')})"


def trial_line(trial: Trial, limit_bytes: int | None = None, *, memory: str = "the budget") -> str:
    """One progress line: the length where a run over lengths reported it, m, peak, verdict, time.

    A fake trial that ran out of memory has neither a peak (what it records is the memory it was given, the card's
    on an emulated card) nor a time worth a column: it says only that it is over ``memory`` ("the card" for an
    estimate on a card).
    """
    length = "" if trial.reported_length is None else f"L={trial.reported_length:<6d} "
    if trial.fake and trial.oom:
        return f"trial {length}m={trial.micro_batch:<6d} over {memory} (a fake trial: out of memory)"
    verdict = "OOM" if trial.oom else ("fits" if trial.fits else "over limit")
    if verdict == "over limit" and limit_bytes and trial.peak_bytes <= limit_bytes and trial.host_peak_bytes:
        verdict = "over host budget"  # --host-budget (autotune/measure/offload.py)
    if trial.fake:
        verdict = f"fake {verdict}"
    share = f" ({100 * trial.peak_bytes / limit_bytes:5.1f}% of limit)" if limit_bytes and not trial.oom else ""
    host = "" if trial.host_peak_bytes is None else f"  host {format_bytes(trial.host_peak_bytes):>11}"
    return (
        f"trial {length}m={trial.micro_batch:<6d} peak {format_bytes(trial.peak_bytes):>11}{share}  "
        f"{verdict:<15} {trial.seconds:6.2f}s{host}"
    )


def device_text(device: Device) -> str:
    """The device as the datasheet names it: its name, and its kind and index where the name does not already say
    them ("NVIDIA H100 80GB HBM3 (cuda:0)", "cpu", "cpu (estimate)", never "cpu (estimate) (cpu)")."""
    where = f"{device.kind}{'' if device.index is None else f':{device.index}'}"
    says_kind = device.name.split(" ", 1)[0].lower() == device.kind
    return device.name if says_kind and device.index is None else f"{device.name} ({where})"


def _routing_text(profile: Profile, mesh: Any) -> str:
    """Under --ep, the routing the figures assume (autotune/measure/experts.py): a fake trial's busiest expert's
    share, or the router's own top-k on real trials."""
    if mesh.ep == 1:
        return ""
    if profile.moe_load_factor is None or profile.source != "estimate":
        return ", routed by the router's own top-k, every rank as rank 0"
    return f", routing: the busiest expert (rank 0's) takes {profile.moe_load_factor:g} x its fair share on every rank"


def strategy_text(profile: Profile) -> str:
    """How the probe held the model: 'ddp, world size 1', 'ddp over 4 replicas', 'fsdp over 8 ranks (...)'."""
    if profile.mesh:  # one rank of a mesh (autotune/core/mesh.py): W ranks, D replicas
        from autotune.core.mesh import Mesh

        mesh = Mesh.from_dict(profile.mesh)
        replicas = mesh.data_parallel(profile.world_size)
        # The cp ranks hold the same parameters: DDP all-reduces and FSDP2 shards over them too (dp_shard_cp).
        sharded = profile.strategy == "fsdp" and mesh.cp > 1
        over = f" (sharded over dp x cp = {replicas * mesh.cp} ranks)" if sharded else ""
        named = profile.tags.get("tp_plan")
        plan = f", {named}'s tp plan (sequence and loss parallel)" if named == "torchtitan" and mesh.tp > 1 else ""
        return (
            f"{profile.strategy} over {replicas} data-parallel replicas{over} of {profile.world_size} ranks, "
            f"{mesh.describe()}{plan}{_routing_text(profile, mesh)} (the figures are rank 0's, for this mesh only)"
        )
    if profile.strategy == "fsdp":
        return f"fsdp over {profile.world_size} ranks (the figures are one rank's, for this world size only)"
    if profile.world_size > 1:
        return f"ddp over {profile.world_size} replicas (DDP's gradient buckets counted)"
    return "ddp, world size 1"


def trial_counts(profile: Profile) -> str:
    """Real trials apart from fake ones: '3 real (1 OOM), 12 fake' ('0 real, 9 fake' for an estimate)."""
    real = [t for t in profile.trials if not t.fake]
    fake = len(profile.trials) - len(real)
    text = f"{len(real)} real" + (f" ({sum(t.oom for t in real)} OOM)" if real else "")
    return text + (f", {fake} fake" if fake else "")


def loss_lines(profile: Profile) -> list[str]:
    """The loss the trials computed (the tag lm_loss, autotune/tasks/losses.py) where it is not the plain one."""
    loss = profile.tags.get("lm_loss")
    if loss is None:
        return []
    if str(loss).startswith("chunked:"):
        tokens = str(loss).removeprefix("chunked:")
        return [f"  loss             {loss} (TRL's chunked NLL: the head in chunks of {tokens} tokens, recomputed)"]
    return [f"  loss             {loss} (Liger's fused linear cross entropy: the logits never whole)"]


def finetune_lines(profile: Profile) -> list[str]:
    """The head, weights' dtype and LoRA of a fine-tuning task (its tags, autotune/tasks/hf.py), one line
    each where they differ from a full fp32 causal LM; none otherwise."""
    tags = profile.tags
    lines = []
    if "hf_class" in tags:
        lines.append(f"  model            {tags['hf_class']} ({tags.get('hf_family', '-')})")
    if "quantize" in tags:  # the adapters and the rest are fp32 (peft), the base 4-bit: the dtype it came from
        dtype = tags.get("weights_dtype", "fp32")
        lines.append(f"  weights          {dtype} (the dtype the 4-bit base is quantized from)")
    elif tags.get("weights_dtype", "fp32") != "fp32":
        lines.append(f"  weights          {tags['weights_dtype']} (gradients and optimizer state in it too)")
    if "lora_rank" in tags:
        alpha = tags.get("lora_alpha")
        alpha_text = f"{alpha:g}" if isinstance(alpha, (int, float)) else str(alpha)
        lines.append(
            f"  lora             rank {tags['lora_rank']}, alpha {alpha_text}, dropout {tags.get('lora_dropout', 0)}, "
            f"targets {tags.get('lora_targets', '-')} (base frozen)"
        )
    if "quantize" in tags:
        lines.append(
            f"  quantize         {tags['quantize']}: linear layers in 4-bit (bitsandbytes), embeddings and norms fp32 "
            "(peft's k-bit preparation)"
        )
    return lines


# What each --offload keeps on the host (autotune/measure/offload.py).
_OFFLOADED = {
    "activations": "the blocks' saved activations in host memory (save_on_cpu)",
    "params": "FSDP2's CPUOffloadPolicy: shards, gradients and optimizer state on the host, the step on the CPU",
}


def offload_lines(profile: Profile) -> list[str]:
    """The datasheet's offload and host-memory lines (none for a job without offload)."""
    if profile.offload is None or profile.offload == "none":
        return []
    lines = [f"  offload          {profile.offload}: {_OFFLOADED[profile.offload]}; the device's bytes decide m"]
    if profile.host_peak_bytes is not None:
        budget = profile.host_budget_bytes
        lines.append(
            f"  host at m={profile.max_micro_batch:<6d} {format_bytes(profile.host_peak_bytes)}"
            + ("" if budget is None else f" (host budget {format_bytes(budget)})")
        )
    return lines


def breakdown_lines(profile: Profile) -> list[str]:
    """The peak of m_max and of the size above it by what holds it: one line per part that holds bytes in either,
    then where each peak happened (none for a profile without a breakdown)."""
    breakdowns = profile.breakdown or []
    if not breakdowns:
        return []
    heads = "".join(f"{f'm={b.micro_batch} ' + ('fits' if b.fits else 'over'):>22s}" for b in breakdowns)
    lines = [f"  memory at peak   {'':16s}{heads}"]
    lines += _part_rows([(b.parts, b.peak_bytes) for b in breakdowns], "total")
    lines += [
        f"    peak of m={b.micro_batch} at {b.peak_where}" + ("" if b.stage is None else f" (stage {b.stage})")
        for b in breakdowns
        if b.peak_where
    ]
    stages = {b.stage for b in breakdowns if b.stage is not None}
    if stages:
        lines.append(f"    the pipeline's most loaded stage: {', '.join(str(stage) for stage in sorted(stages))}")
    return lines + _host_part_lines(breakdowns)


def _host_part_lines(breakdowns: list[MemoryBreakdown]) -> list[str]:
    """Under --offload: the host's peak in the same trials by part, as the device's rows are (none without)."""
    if not any(b.host_parts for b in breakdowns):
        return []
    peaks = [(b.host_parts or {}, b.host_peak_bytes or 0) for b in breakdowns]
    return ["  host at its peak (--offload)", *_part_rows(peaks, "host total")]


def _part_rows(peaks: list[tuple[dict[str, int], int]], total_label: str) -> list[str]:
    """One line per part that holds bytes at one of the peaks ((parts, peak bytes) per size, side by side), its
    bytes and share of each peak, then the peaks themselves."""
    lines = []
    for part, label in MEMORY_PART_LABELS.items():
        if not any(parts.get(part) for parts, _ in peaks):
            continue
        cells = "".join(
            f"{format_bytes(parts.get(part, 0)):>14s} {100 * parts.get(part, 0) / max(1, peak):5.1f}%"
            for parts, peak in peaks
        )
        lines.append(f"    {label:<28s}{cells}")
    totals = "".join(f"{format_bytes(peak):>14s}{'':7s}" for _, peak in peaks)
    lines.append(f"    {total_label:<28s}{totals}".rstrip())
    return lines


def lever_lines(profile: Profile) -> list[str]:
    """What each change of the setup would buy, best first, then the changes left out with why (--levers)."""
    levers = profile.levers
    if levers is None:
        return []
    if not levers:
        return ["  levers           none: every change autotune knows is already applied to this job"]
    at = levers[0].at_micro_batch
    lines = [f"  levers           {'(at m=' + str(at) + ')':<30s}{'frees at the peak':>18s}  m_max"]
    for lever in levers:
        if lever.peak_bytes is None:
            lines.append(f"    {lever.flags:<46s}left out: {lever.note}")
            continue
        freed = lever.freed_bytes or 0
        sign = "-" if freed < 0 else ""
        lines.append(
            f"    {lever.flags:<42s}{sign + format_bytes(abs(freed)):>18s}  {lever.max_micro_batch}"
            + ("  (not even the smallest size)" if lever.max_micro_batch == 0 else "")
        )
    return lines


def datasheet(profile: Profile) -> str:
    """The profile as a page of text: plan, memory, fit, trials, warnings."""
    dev = profile.device
    lines = [
        f"autotune datasheet: {profile.task}",
        f"  fingerprint      {shown_fingerprint(profile.fingerprint)}",
        f"  device           {device_text(dev)}",
        f"  precision        {profile.precision}",
        *finetune_lines(profile),
        *([f"  compiled         torch.compile mode {profile.tags['compile']}"] if "compile" in profile.tags else []),
        *loss_lines(profile),
        f"  strategy         {strategy_text(profile)}",
        f"  checkpointing    {_policy_text(profile.activation_checkpointing)}",
        *offload_lines(profile),
        f"  source           {profile.source}"
        + (" (fake-tensor trials only, not a measurement on the device)" if profile.source == "estimate" else ""),
        f"  budget           {format_bytes(profile.budget_bytes)} (headroom {profile.headroom:.0%}, "
        f"limit {format_bytes(profile.limit_bytes)})",
        f"  max micro-batch  {profile.max_micro_batch}"
        + (f" (multiple of {profile.multiple_of})" if profile.multiple_of > 1 else ""),
    ]
    plan = profile.plan
    chosen = plan.micro_batch if plan else profile.max_micro_batch
    if plan is not None:
        verdict = f"(target {plan.target_batch}, {'exact' if plan.exact else 'NOT exact'})"
        if plan.uneven:  # balanced: the sizes of one update's micro-batches, count×size
            lines.append(f"  plan             {micro_batches_text(plan.micro_batches, plan.world_size)} {verdict}")
        else:
            lines.append(
                f"  plan             m={plan.micro_batch} x A={plan.accumulation_steps} x D={plan.world_size} "
                f"= {plan.effective_batch} {verdict}"
            )
    # A one-step plan (A = 1) above m_max was measured by the single-step trials, not the accumulating line.
    single = profile.single_step.trials if profile.single_step and plan and plan.accumulation_steps == 1 else []
    one_step = next((t.peak_bytes for t in single if t.micro_batch == chosen and t.fits), None)
    peak = one_step if one_step is not None else profile.peak_at(chosen)
    if peak is not None:
        lines.append(
            f"  peak at m={chosen:<6d} {format_bytes(peak)} ({100 * peak / profile.budget_bytes:.1f}% of budget"
            + (", estimated)" if profile.source == "estimate" else ", one step)" if one_step is not None else ")")
        )
    elif (predicted := profile.predicted_peak(chosen)) is not None:
        lines.append(f"  peak at m={chosen:<6d} ~{format_bytes(predicted)} (from the fit)")
    if profile.fit is not None:
        lines.append(
            f"  fit              {format_bytes(profile.fit.fixed_bytes)} + "
            f"{format_bytes(profile.fit.bytes_per_sample)} per sample (forward/backward)"
        )
    lines.extend(breakdown_lines(profile))
    lines.extend(lever_lines(profile))
    lines.append(
        f"  trials           {trial_counts(profile)} in {profile.seconds:.2f}s"
        + ("" if profile.compile_seconds is None else f" (compilation {profile.compile_seconds:.2f}s of it)")
    )
    for timing in profile.throughput or []:
        lines.extend(throughput_rows(timing, pipeline=profile.pipeline is not None))
    advice = gap_advice(profile)
    if advice is not None:
        lines.append(f"  fragmentation    {advice}")
    lines.extend(warning_rows(profile.warnings))
    return "\n".join(lines)


def throughput_rows(timing: Throughput, pipeline: bool = False) -> list[str]:
    """The datasheet's rows of one timed run (a pipeline's stage by stage, autotune/measure/pipeline/timing.py), or of
    one predicted update with its parts (says "predicted")."""
    sizes = " + ".join(f"{count}x{size}" for size, count in timing.micro_batches)
    if not timing.predicted:
        how = "each stage timed, median of {}; the bubble by the schedule" if pipeline else "timed, median of {}"
        return [
            f"  throughput       {timing.samples_per_second:.4g} samples/s, update {sizes} in "
            f"{timing.seconds_per_update:.4g}s ({how.format(timing.repeats)})"
        ]
    tokens = timing.tokens_per_second_per_gpu
    per_gpu = "" if tokens is None else f", {tokens:,.0f} tokens/s/GPU"
    mfu = "" if timing.mfu is None else f", MFU {timing.mfu:.1%}"
    rows = [
        f"  throughput       {timing.samples_per_second:.4g} samples/s{per_gpu}{mfu}, update {sizes} in "
        f"{timing.seconds_per_update:.4g}s (predicted)"
    ]
    parts = timing.parts
    if parts is not None:
        recompute = f" ({parts.recompute_seconds:.4g}s recomputing)" if parts.recompute_seconds else ""
        bubble = f", bubble {parts.bubble_seconds:.4g}s" if parts.bubble_seconds else ""
        rows.append(
            f"    parts          compute {parts.compute_seconds:.4g}s{recompute}, exposed communication "
            f"{parts.exposed_communication_seconds:.4g}s{bubble}, optimizer {parts.optimizer_seconds:.4g}s"
        )
    return rows


def warning_rows(warnings: list[str]) -> list[str]:
    """The datasheet's rows of a profile's notes: the attention kernel the trials ran as its own row (a fact of the
    setup, autotune/measure/trial.py: attention_line), every other note as a warning."""
    return [
        f"  attention        {warning.removeprefix(ATTENTION_NOTE)}"
        if warning.startswith(ATTENTION_NOTE)
        else f"  warning          {warning}"
        for warning in warnings
    ]


def _plan_text(profile: Profile) -> str:
    plan = profile.plan
    if plan is None:
        return "-"
    text = micro_batches_text(plan.micro_batches, plan.world_size)
    return text + ("" if plan.exact else f" (target {plan.target_batch}, not exact)")


def _longest_lengths_parts(group: list[Profile]) -> list[str]:
    """Under one heading per length: each length's predicted (or timed) updates, and the levers and the breakdown of
    the longest length that has each (every length's are in --json)."""
    with_levers = [p for p in group if p.levers is not None]
    broken_down = [p for p in group if p.breakdown]
    lines: list[str] = []
    for p in sorted(group, key=lambda p: p.seq_len or 0):
        rows = [row for timing in p.throughput or [] for row in throughput_rows(timing, p.pipeline is not None)]
        if with_levers and p is with_levers[-1]:
            rows += lever_lines(p)
        if broken_down and p is broken_down[-1]:
            rows += breakdown_lines(p)
        if rows:
            lines += [f"  at L={p.seq_len}:", *rows]
    return lines


# What stopped the longest-length search, as the datasheet says it.
_LIMITED_BY = {
    "memory": "memory: the next length does not fit",
    "cap": "the cap, --max-seq-len",
    "model": "the model: it takes no longer sequence",
}


def longest_line(longest: LongestSeqLen) -> str:
    """The longest length that fits at m = multiple_of, and what limited it."""
    return (
        f"  longest L at m={longest.micro_batch}: {longest.seq_len} "
        f"({format_bytes(longest.peak_bytes)}; limited by {_LIMITED_BY[longest.limited_by]})"
        + (f": {longest.note}" if longest.note else "")
    )


def lengths_datasheet(profiles: list[Profile]) -> str:
    """The profiles of one run over sequence lengths as one table (per memory policy where several
    ran): L, m_max, tokens per micro-batch, the plan, real and fake trials; then the longest length
    that fits at m = multiple_of, and the warnings once each."""
    first = profiles[0]
    dev = first.device
    lines = [
        f"autotune datasheet: {first.task} over sequence lengths",
        f"  fingerprint      {shown_fingerprint(first.fingerprint)} (every length)",
        f"  device           {device_text(dev)}",
        f"  precision        {first.precision}",
        *finetune_lines(first),
        *loss_lines(first),
        f"  strategy         {strategy_text(first)}",
        f"  source           {first.source}",
        f"  budget           {format_bytes(first.budget_bytes)} (headroom {first.headroom:.0%}, "
        f"limit {format_bytes(first.limit_bytes)})",
    ]
    policies = list(dict.fromkeys(p.activation_checkpointing for p in profiles))
    for policy in policies:
        group = [p for p in profiles if p.activation_checkpointing == policy]
        if len(policies) > 1 or policy != "none":
            lines.append(f"  activation checkpointing: {policy}")
        lines.append(f"  {'L':>8}  {'m_max':>6}  {'tokens/micro-batch':>18}  {'plan':<28}  trials")
        for p in group:
            tokens = p.max_micro_batch * (p.seq_len or 0)
            lines.append(
                f"  {p.seq_len or '-':>8}  {p.max_micro_batch:>6}  {tokens:>18}  {_plan_text(p):<28}  {trial_counts(p)}"
            )
        lines += _longest_lengths_parts(group)
        surface = group[0].surface
        if surface is not None and surface.longest is not None:
            lines.append(longest_line(surface.longest))
        if surface is not None:
            lines.append(
                f"  surface          {len(surface.pieces)} pieces over L {surface.covered[0]}..{surface.covered[1]}, "
                f"checked on a held-out trace at m={surface.held_out[0] if surface.held_out else '-'}, "
                f"L={surface.held_out[1] if surface.held_out else '-'}"
            )
    seconds = max(p.seconds for p in profiles)
    lines.append(f"  time             {seconds:.2f}s")
    warnings = list(dict.fromkeys(w for p in profiles for w in p.warnings))
    lines.extend(warning_rows(warnings))
    return "\n".join(lines)
