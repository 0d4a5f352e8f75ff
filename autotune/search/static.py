"""The static confirmation of a compiled search's answer (docs/compile.md, "The static confirmation"): m_max and
m_max + 1 each built afresh and compiled on its own at its size, as a job at one m compiles, and measured on the
compiled meter (autotune/measure/meters/compiled.py); those trials decide.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import torch

from autotune.core.schemas import Trial
from autotune.measure.meters.compiled import CompiledCpuMeter, compiles_on, static_shapes
from autotune.measure.trial import TrialRunner
from autotune.search.boundary import NoFitError, SearchResult

__all__ = ["confirm_static"]


def _static_trial(
    task: Any,
    meter: Any,
    strategy: Any,
    micro_batch: int,
    limit_bytes: int,
    host: int | None,
    breakdowns: dict[int, Any] | None = None,
) -> Trial:
    """One trial of a model built afresh and compiled static at ``micro_batch`` (its warm-up runs there), by a
    fresh compiler: what a job that trains at that m compiles and runs. Its compilation is within the meter's
    ``compile_seconds``, apart from the trial's seconds. Broken down into ``breakdowns`` where given (in the place
    of the dynamic trial's at that size: this trial is the one the profile keeps)."""
    torch._dynamo.reset()  # nothing cached from the dynamic search or another size
    gc.collect()
    if isinstance(meter, CompiledCpuMeter):
        # Only this model's bytes are its base, as in a fresh process: the search's model, dying late, would take
        # its own out of this one's (a GPT-2 config read 917,508 B low at m_max so).
        meter.clear_base()
    runner = TrialRunner(task, meter, limit_bytes=limit_bytes, strategy=strategy, host_limit_bytes=host)
    runner.breakdowns = breakdowns
    with static_shapes():
        try:
            return runner(micro_batch)
        finally:
            runner.close()
            gc.collect()


def confirm_static(
    task: Any,
    meter: Any,
    config: Any,
    strategy: Any,
    limit_bytes: int,
    result: Any,
    warnings: list[str],
    on_trial: Callable[[Trial], None] | None = None,
    breakdowns: dict[int, Any] | None = None,
) -> Any:
    """The compiled search's answer confirmed by static compilations (docs/compile.md, "The static confirmation").

    The search's trials share one graph compiled with the micro-batch dimension dynamic; a job that trains at one m
    compiles a static graph at that m, whose peak can differ (a GPT-2 config: 1.9 % above the dynamic one at
    m_max). Here m_max and m_max + multiple_of are each built afresh, compiled static at their size and measured
    (:func:`_static_trial`); these trials decide: where m_max does not fit, the sizes below are tried until one
    does; where m_max + multiple_of fits, the sizes above until one does not (or the cap), in steps that double
    then bisect (:func:`_largest_fitting`).
    The dynamic trials at a size confirmed here leave the result (the warning keeps what they read).

    ``breakdowns``: where given, each static trial's breakdown replaces the dynamic trial's at its size.

    Returns ``result`` as it is where nothing compiles (an eager task, fake trials, a pipeline's stages), else a
    SearchResult with the static answer and trials.

    Raises:
        NoFitError: not even multiple_of fits compiled static.
    """
    if task.compile is None or not compiles_on(meter) or config.mesh.pp > 1:
        return result
    unit, cap = config.multiple_of, config.max_micro_batch
    confirmed: dict[int, Trial] = {}
    seconds_before = meter.compile_seconds or 0.0

    def fits(micro_batch: int) -> bool:
        if breakdowns is not None:
            breakdowns.pop(micro_batch, None)  # the dynamic trial's: this one decides
        trial = _static_trial(task, meter, strategy, micro_batch, limit_bytes, config.host_budget_bytes, breakdowns)
        confirmed[micro_batch] = trial
        if on_trial is not None:
            on_trial(trial)
        return trial.fits

    m_max = result.max_micro_batch
    if fits(m_max):
        m_max = _largest_fitting(fits, fitting=m_max, unit=unit, cap=cap)
    else:
        m_max = _largest_fitting(fits, failing=m_max, unit=unit, cap=cap)
        if m_max == 0:
            raise NoFitError(confirmed[unit], f"micro-batch {unit} does not fit (compiled static)")
    dynamic = {t.micro_batch: t for t in result.trials if t.micro_batch in confirmed}
    read = ", ".join(
        f"m={m} {t.peak_bytes:,} B {'fits' if t.fits else 'does not fit'}"
        + (f" (dynamic {dynamic[m].peak_bytes:,} B{', OOM' if dynamic[m].oom else ''})" if m in dynamic else "")
        for m, t in sorted(confirmed.items())
    )
    changed = "" if m_max == result.max_micro_batch else f"; the dynamic search's {result.max_micro_batch} -> {m_max}"
    seconds = (meter.compile_seconds or 0.0) - seconds_before
    warnings.append(
        f"static confirmation (each size built afresh and compiled with dynamic=False at it, as a job at one m "
        f"compiles): {read}{changed}; {len(confirmed)} compilations in {seconds:.1f}s of compile_seconds"
    )
    trials = [t for t in result.trials if t.micro_batch not in confirmed] + list(confirmed.values())
    return SearchResult(max_micro_batch=m_max, trials=trials, fit=result.fit)


def _largest_fitting(
    fits: Callable[[int], bool], *, unit: int, cap: int, fitting: int | None = None, failing: int | None = None
) -> int:
    """The largest multiple of ``unit`` (up to ``cap``) that fits, from a size known to fit (``fitting``: the sizes
    above are tried) or known not to (``failing``: the sizes below; 0 where even ``unit`` does not fit). The first
    step is one ``unit`` (where the dynamic search was right, m_max and m_max + unit are the only compilations), and
    each further step doubles until the answer is passed; the two sizes around it are then bisected, so that the
    answer fits and the size a unit above it was measured not to (unless it is the cap). A static trial is a
    compilation: the tiny Llama of bench/compositions.py with offloaded activations, whose dynamic trials read far
    from its static ones, walked 31 sizes one step at a time (10 this way)."""
    step = unit
    if fitting is not None:
        low, high = fitting, None
        while high is None and low + unit <= cap:
            candidate = min(low + step, cap - (cap - low) % unit)
            if fits(candidate):
                low, step = candidate, 2 * step
            else:
                high = candidate
        if high is None:
            return low
    else:
        assert failing is not None
        low, high = 0, failing
        while low == 0:
            candidate = max(unit, high - step)
            if candidate >= high:
                return 0
            if fits(candidate):
                low = candidate
            elif candidate == unit:
                return 0
            else:
                high, step = candidate, 2 * step
    while high - low > unit:
        middle = low + (high - low) // unit // 2 * unit
        if fits(middle):
            low = middle
        else:
            high = middle
    return low
