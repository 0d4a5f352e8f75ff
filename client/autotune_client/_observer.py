"""Jobs report what they saw without effort: ``Accumulator(observe=observer(suggestion))``.

A :class:`PeakObserver` posts the job's peak memory to the profile that answered it, so that the
store's drift (``autotune_server.drift``) tunes later answers:

- after the first ``first_report_after`` optimizer updates (3: the optimizer state exists, the
  allocator has seen a few steps), then at most once per ``min_interval_seconds`` (300) and only
  when the peak grew by more than ``min_growth`` (0.5 %) since the last report, and never more than
  ``max_reports`` (20) times: a job contributes a handful of observations, its running peak;
- an OOM the Accumulator recovers from (``oom_fallback=True``) is reported as it happens.

The peak is the device's: ``torch.cuda.max_memory_reserved`` on CUDA (what the caching allocator
held, the probe's figure less the memory outside it); elsewhere only what ``peak_bytes=`` returns (a
CPU job has no allocator statistics: pass the meter's peak, or leave it and report only OOMs).

Training never waits and never fails for it: reports go to a bounded queue that one daemon thread
posts from, with a short timeout and no retries; a full queue drops the report, a failed post is
swallowed; both are counted (:attr:`PeakObserver.sent`, ``dropped``, ``failed``, ``last_error``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from autotune.core.schemas import Observation, Suggestion
from autotune_client._client import TunerClient
from autotune_client.errors import UnprocessableEntityError

__all__ = [
    "FIRST_REPORT_AFTER",
    "MAX_REPORTS",
    "MIN_GROWTH",
    "MIN_INTERVAL_SECONDS",
    "PeakObserver",
    "REPORT_TIMEOUT_SECONDS",
    "observer",
]

log = logging.getLogger("autotune_client.observer")

FIRST_REPORT_AFTER = 3
MIN_INTERVAL_SECONDS = 300.0
MIN_GROWTH = 0.005
MAX_REPORTS = 20
REPORT_TIMEOUT_SECONDS = 2.0
_QUEUE_SIZE = 8


class PeakObserver:
    """``Accumulator(observe=...)``: reports the job's peak at a bounded rate, and its OOMs.

    Called with an Observation (the Accumulator's OOM report), it queues it; its ``after_update``
    (called by the Accumulator after every optimizer update) decides whether the peak is due.
    Build it with :func:`observer`; ``report`` is what posts one Observation (a TunerClient's
    ``observe`` bound to the profile, or any callable in tests).
    """

    def __init__(
        self,
        report: Callable[[Observation], object] | None,
        *,
        peak_bytes: Callable[[], int | None] | None = None,
        device_name: str | None = None,
        world_size: int | None = None,
        first_report_after: int = FIRST_REPORT_AFTER,
        min_interval_seconds: float = MIN_INTERVAL_SECONDS,
        min_growth: float = MIN_GROWTH,
        max_reports: int = MAX_REPORTS,
        clock: Callable[[], float] = time.monotonic,
        disabled_reason: str | None = None,
    ) -> None:
        self._report = report
        self._peak_bytes = peak_bytes
        self.device_name = device_name
        self.world_size = world_size
        self.first_report_after = first_report_after
        self.min_interval_seconds = min_interval_seconds
        self.min_growth = min_growth
        self.max_reports = max_reports
        self._clock = clock
        #: Why nothing is reported (no profile to report to, no server); None when reporting.
        self.disabled_reason = disabled_reason if report is not None else (disabled_reason or "no report target")
        #: Reports posted, dropped (queue full), failed (the post raised), and the last failure's text.
        self.sent = 0
        self.dropped = 0
        self.failed = 0
        self.last_error: str | None = None
        self._refusal_said = False
        self._reported_peak: int | None = None
        self._reported_at: float | None = None
        self._reports = 0
        self._queue: queue.Queue[Observation] = queue.Queue(maxsize=_QUEUE_SIZE)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- what the Accumulator calls ----------------------------------------------------------

    def __call__(self, observation: Observation) -> None:
        """Queue an observation (the Accumulator's OOM report), adding the job's device and world size."""
        self._enqueue(self._complete(observation))

    def after_update(self, updates: int, micro_batch: int) -> None:
        """After optimizer update number ``updates`` at micro-batch ``micro_batch`` (the largest of the
        job's micro-batches so far): queue the peak when it is due. Never raises."""
        if self._report is None or updates < self.first_report_after or self._reports >= self.max_reports:
            return
        now = self._clock()
        if self._reported_at is not None and now - self._reported_at < self.min_interval_seconds:
            return
        try:
            peak = self._peak_bytes() if self._peak_bytes is not None else None
        except Exception as exc:  # a peak that cannot be read is no reason to stop training
            self._count_failure(exc)
            return
        if peak is None or peak <= 0:
            return
        if self._reported_peak is not None and peak <= self._reported_peak * (1.0 + self.min_growth):
            return
        self._reported_peak, self._reported_at = peak, now
        self._reports += 1
        note = f"peak after {updates} update{'s' if updates != 1 else ''} of training (autotune_client.observer)"
        self._enqueue(self._complete(Observation(micro_batch=micro_batch, peak_bytes=peak, note=note)))

    # -- delivery ------------------------------------------------------------------------------

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        """Wait up to timeout_seconds for queued reports to be posted (for tests and job ends);
        returns whether the queue emptied."""
        deadline = time.monotonic() + timeout_seconds
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def _complete(self, observation: Observation) -> Observation:
        extra: dict[str, Any] = {}
        if self.device_name is not None and observation.device_name is None:
            extra["device_name"] = self.device_name
        if self.world_size is not None and "world_size" not in observation.model_fields_set:
            extra["world_size"] = self.world_size
        # model_copy(update=...) would not mark the fields as set: validate anew so that they are sent.
        return (
            Observation.model_validate({**observation.model_dump(exclude_unset=True), **extra})
            if extra
            else observation
        )

    def _enqueue(self, observation: Observation) -> None:
        if self._report is None:
            return
        try:
            self._queue.put_nowait(observation)
        except queue.Full:
            self.dropped += 1
            return
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._post_forever, name="autotune-observer", daemon=True)
                self._thread.start()

    def _post_forever(self) -> None:
        assert self._report is not None
        while True:
            observation = self._queue.get()
            try:
                self._report(observation)
                self.sent += 1
            except Exception as exc:  # the tuner down, a refused token, a 422: training goes on
                self._count_failure(exc)
            finally:
                self._queue.task_done()

    def _count_failure(self, exc: BaseException) -> None:
        self.failed += 1
        self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0]
        if isinstance(exc, UnprocessableEntityError) and not self._refusal_said:
            # The store refused the report itself (another device, another setup): no retry will change that, and
            # a job that believes it reports would never learn it. Said once; training goes on.
            self._refusal_said = True
            said = f"autotune observer: the store refused a report: {self.last_error}"
            warnings.warn(said, UserWarning, stacklevel=1)
        log.debug("autotune observer: %s", self.last_error)


def _cuda_peak(device: Any) -> Callable[[], int | None] | None:
    import torch

    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return lambda: int(torch.cuda.max_memory_reserved(dev))


def observer(
    suggestion: Suggestion,
    *,
    client: TunerClient | None = None,
    device: Any = None,
    peak_bytes: Callable[[], int | None] | None = None,
    **policy: Any,
) -> PeakObserver:
    """The observer of a job planned by ``suggestion``, for ``Accumulator(observe=...)``.

        plan = suggest(model, 512, example=batch)
        acc = Accumulator(model, optimizer, accumulation_steps=plan.accumulation_steps,
                          observe=observer(plan, device="cuda"))

    Args:
        suggestion: what ``suggest`` answered; its ``profile_id`` is where reports go. Without one
            (a local probe the server did not store) the observer reports nothing and says why in
            ``disabled_reason``.
        client: the TunerClient to post with; default one from ``$AUTOTUNE_URL`` / ``$AUTOTUNE_TOKEN``
            with a 2 s timeout and no retries (none configured: nothing is reported).
        device: the job's device; on CUDA the peak is ``torch.cuda.max_memory_reserved`` of it.
        peak_bytes: a callable returning the peak to report instead (on the CPU: the meter's peak).
        policy: ``first_report_after``, ``min_interval_seconds``, ``min_growth``, ``max_reports``.
    """
    peak = peak_bytes if peak_bytes is not None else _cuda_peak(device)
    common: dict[str, Any] = {
        "peak_bytes": peak,
        "device_name": suggestion.device_name,
        "world_size": suggestion.world_size,
        **policy,
    }
    if suggestion.profile_id is None:
        reason = f"suggestion from {suggestion.source} has no stored profile to report to"
        return PeakObserver(None, disabled_reason=reason, **common)
    if client is None:
        try:
            client = TunerClient(timeout=REPORT_TIMEOUT_SECONDS, max_retries=0)
        except Exception as exc:  # no server configured: the job runs, nothing is reported
            return PeakObserver(None, disabled_reason=str(exc), **common)
    profile_id = suggestion.profile_id
    post = client.observe
    return PeakObserver(lambda observation: post(profile_id, observation), **common)
