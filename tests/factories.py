"""Profiles for tests of every package: valid by construction, unique on demand.

from tests.factories import make_profile, profile_payload
profile = make_profile(device_name="NVIDIA H100 80GB HBM3", max_micro_batch=24)
body = profile_payload(seed=3)            # JSON-ready dict, distinct content per seed
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from autotune.core.schemas import Device, Fit, Plan, Profile, Trial

__all__ = [
    "DEFAULT_DEVICE",
    "FINGERPRINT",
    "fingerprint_for",
    "inconsistent_payloads",
    "make_profile",
    "make_run_payload",
    "profile_payload",
    "surface_gpt_payloads",
]

FINGERPRINT = "0123456789abcdef" * 4
DEFAULT_DEVICE = "NVIDIA A100-SXM4-80GB"
BASE_TIME = datetime(2026, 1, 1, tzinfo=timezone.utc)


def fingerprint_for(name: str) -> str:
    """A valid fingerprint (64 hex digits) derived from a readable name."""
    return hashlib.sha256(name.encode()).hexdigest()


def make_profile(
    *,
    fingerprint: str = FINGERPRINT,
    device_name: str = DEFAULT_DEVICE,
    device_kind: str = "cuda",
    task: str = "examples/gpt.py:task",
    precision: str = "bf16",
    budget_bytes: int = 80 * 2**30,
    headroom: float = 0.10,
    max_micro_batch: int = 24,
    fixed_bytes: float = 10 * 2**30,
    bytes_per_sample: float = 2.5 * 2**30,
    with_fit: bool = True,
    seed: int = 0,
    created_at: datetime | None = None,
    tags: dict[str, str | int | float | bool] | None = None,
    strategy: str = "ddp",
    world_size: int = 1,
    source: str = "measured",
    fake_micro_batches: tuple[int, ...] = (),
    multiple_of: int = 1,
) -> Profile:
    """A profile as the probe would produce it: trials that follow the affine fit.

    Consistent by construction (``autotune.core.consistency``): trials at multiples of ``multiple_of``
    up to ``max_micro_batch`` fit, and the one at ``max_micro_batch + multiple_of`` is over the limit
    (its peak is raised to just over the limit where the fit would put it within: the boundary a real
    search found). A ``max_micro_batch`` whose fitted peak is over the limit is a ValueError: such a
    profile cannot be measured.

    ``seed`` changes the content (and so the content hash) without changing any lookup key, and
    moves ``created_at`` by seed seconds so that "newest" is well defined. ``source="estimate"``
    makes every trial fake; ``fake_micro_batches`` adds fake pre-search trials before the real ones,
    at half the real peak and all fitting, so that a test sees when one is mistaken for a measurement.
    """

    def peak(m: int) -> int:
        return int(fixed_bytes + bytes_per_sample * m) + seed

    unit = multiple_of
    limit = int(budget_bytes * (1.0 - headroom))
    if max_micro_batch % unit or peak(max_micro_batch) > limit:
        raise ValueError(
            f"make_profile: max_micro_batch {max_micro_batch} with multiple_of {unit} and a peak of "
            f"{peak(max_micro_batch)} bytes against a limit of {limit} is not a profile a probe makes"
        )
    sizes = sorted({unit, 2 * unit, max(unit, max_micro_batch // 2 // unit * unit), max_micro_batch} - {0})
    sizes = [m for m in sizes if m <= max_micro_batch]
    trials = [Trial(micro_batch=m, peak_bytes=peak(m), fits=True, seconds=0.5) for m in sizes]
    above = max_micro_batch + unit
    trials.append(Trial(micro_batch=above, peak_bytes=max(peak(above), limit + 1), fits=False))
    if source == "estimate":
        trials = [t.model_copy(update={"fake": True}) for t in trials]
    pre_search = [Trial(micro_batch=m, peak_bytes=peak(m) // 2, fits=True, fake=True) for m in fake_micro_batches]
    trials = pre_search + trials
    return Profile(
        fingerprint=fingerprint,
        task=task,
        device=Device(kind=device_kind, name=device_name, index=0, total_bytes=budget_bytes),  # type: ignore[arg-type]
        precision=precision,  # type: ignore[arg-type]
        tags=tags if tags is not None else {"suite": "tests"},
        budget_bytes=budget_bytes,
        headroom=headroom,
        max_micro_batch=max_micro_batch,
        multiple_of=multiple_of,
        plan=Plan(
            micro_batch=max_micro_batch,
            accumulation_steps=1,
            world_size=world_size,
            effective_batch=max_micro_batch * world_size,
            target_batch=max_micro_batch * world_size,
            exact=True,
            max_micro_batch=max_micro_batch,
        ),
        world_size=world_size,
        strategy=strategy,  # type: ignore[arg-type]
        source=source,  # type: ignore[arg-type]
        trials=trials,
        fit=Fit(fixed_bytes=fixed_bytes, bytes_per_sample=bytes_per_sample) if with_fit else None,
        trial_count=len(trials),
        oom_count=0,
        seconds=3.0,
        created_at=created_at if created_at is not None else BASE_TIME + timedelta(seconds=seed),
    )


def profile_payload(**kwargs: Any) -> dict[str, Any]:
    """``make_profile(**kwargs)`` as the JSON body a client sends."""
    return make_profile(**kwargs).model_dump(mode="json")


MAKE_RUN_GPT = Path(__file__).parent / "data" / "make_run_gpt.json"


def make_run_payload() -> dict[str, Any]:
    """The gpt profile `make run` stored before strategy, source and balanced plans (CPU, 24 MiB):
    trials at m = 1, 2, 21, 26 (fit) and 27 (over the limit), m_max 26, plan 16 x 16 = 256."""
    return json.loads(MAKE_RUN_GPT.read_text())


SURFACE_GPT = Path(__file__).parent / "data" / "surface_gpt.json"


def surface_gpt_payloads() -> list[dict[str, Any]]:
    """One real surface probe of ``examples/gpt.py:task_seq`` on the CPU (64 MiB, 10 % headroom) at
    L = 128, 256, 512, as ``autotune probe --seq-len 128,256,512 --json`` printed it: m_max 36, 18, 9,
    one fingerprint, one surface covering L = 128 ... 2048 (tests/data/make_surface_gpt.py)."""
    payloads: list[dict[str, Any]] = json.loads(SURFACE_GPT.read_text())
    return payloads


def inconsistent_payloads() -> list[tuple[str, dict[str, Any], str, int | None]]:
    """One upload per consistency rule that breaks it: (rule, body, the field named, the trial named).

    Each starts from :func:`make_run_payload` (trials 0..4 at m = 1, 2, 21, 26, 27; limit
    22649241 bytes) and changes what the rule forbids.
    """
    cases: list[tuple[str, dict[str, Any], str, int | None]] = []

    def case(rule: str, field: str, trial: int | None, change: Callable[[dict[str, Any]], None]) -> None:
        body = make_run_payload()
        change(body)
        cases.append((rule, body, field, trial))

    def set_(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
        def change(body: dict[str, Any]) -> None:
            *parents, leaf = path.split(".")
            target: Any = body
            for part in parents:
                target = target[int(part)] if part.isdigit() else target[part]
            target[int(leaf) if leaf.isdigit() else leaf] = value

        return change

    def drop_trial(index: int) -> Callable[[dict[str, Any]], None]:
        return lambda body: body["trials"].pop(index)

    def several(*changes: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        def change(body: dict[str, Any]) -> None:
            for one in changes:
                one(body)

        return change

    over, within = 22_700_000, 20_000_000
    # The tampered upload: m_max raised to a million; trial 4 (m=27) went over the limit.
    case("tampered max_micro_batch", "max_micro_batch", 4, set_("max_micro_batch", 1_000_000))
    case("m_max not a multiple of multiple_of", "max_micro_batch", None, set_("multiple_of", 4))
    case("m_max above the cap", "max_micro_batch", None, set_("micro_batch_cap", 25))
    case("no trial at m_max", "max_micro_batch", None, drop_trial(3))
    case(
        "trial at m_max over the limit",
        "max_micro_batch",
        3,
        several(set_("trials.3.peak_bytes", over), set_("trials.3.fits", False)),
    )
    case(
        "trial at m_max ran out of memory",
        "max_micro_batch",
        3,
        several(set_("trials.3.oom", True), set_("trials.3.fits", False)),
    )
    case("no trial at m_max + multiple_of", "max_micro_batch", None, drop_trial(4))
    case(
        "trial at m_max + multiple_of fits",
        "max_micro_batch",
        4,
        several(set_("trials.4.peak_bytes", within), set_("trials.4.fits", True)),
    )
    case("a trial claims to fit over the limit", "trials.4.fits", 4, set_("trials.4.fits", True))
    case("a trial within the limit says it does not fit", "trials.1.fits", 1, set_("trials.1.fits", False))
    case(
        "an OOM trial claims to fit",
        "trials.4.fits",
        4,
        several(set_("trials.4.oom", True), set_("trials.4.fits", True)),
    )
    case(
        "fits above a failure, not declared",
        "non_monotone",
        5,
        lambda body: body["trials"].append(
            {"micro_batch": 30, "peak_bytes": within, "fits": True, "seconds": 0.2}
        ),
    )
    case(
        "non-monotone, m_max not below the first failure",
        "max_micro_batch",
        4,
        several(
            lambda body: body["trials"].append(
                {"micro_batch": 30, "peak_bytes": within, "fits": True, "seconds": 0.2}
            ),
            set_("non_monotone", True),
            set_("max_micro_batch", 30),
            set_("plan.max_micro_batch", 30),
        ),
    )
    case("plan's m above m_max", "plan.micro_batch", None, set_("plan.micro_batch", 32))
    case("plan's m x A x D is not its effective batch", "plan.effective_batch", None, set_("plan.effective_batch", 255))
    case("plan says exact when it is not", "plan.exact", None, set_("plan.target_batch", 250))
    case(
        "plan's micro-batches disagree with its steps",
        "plan.accumulation_steps",
        None,
        set_("plan.micro_batches", [[16, 15]]),
    )
    case("plan made for another m_max", "plan.max_micro_batch", None, set_("plan.max_micro_batch", 25))
    case("negative fit", "fit.fixed_bytes", None, set_("fit.fixed_bytes", -1.0))
    case("budget over the device's memory", "budget_bytes", None, set_("device.total_bytes", 2**24))
    case(
        "headroom that leaves nothing",
        "headroom",
        None,
        several(set_("budget_bytes", 1), set_("headroom", 0.5)),
    )
    case("device kind against its name", "device.kind", None, set_("device.kind", "cuda"))
    case(
        "a listed device's kind against its name",
        "devices.0.kind",
        None,
        set_("devices.0.name", "NVIDIA H100 80GB HBM3"),
    )
    case(
        "the trial at m_max is a fake pre-search point",
        "max_micro_batch",
        None,
        set_("trials.3.fake", True),
    )
    return cases
