"""A simulated fleet against the real store: does the loop from jobs' observations to /suggest pay?

    .venv/bin/python bench/drift.py                    # 200 jobs per scenario, both headrooms
    .venv/bin/python bench/drift.py --jobs 100 --seed 3

The profile is real: the probe of ``examples/gpt.py:task`` on this CPU at a 24 MiB budget (headroom
10 % and 2 %). The store is real too: ``create_app`` on a fresh SQLite file per run, driven
in-process (TestClient): every job asks ``GET /api/v1/suggest`` for a target of 256, runs, and in the
loop posts what it saw (its peak with ``autotune_client.observer``'s fields, or an OOM).

What a job really peaks at: the probe's peak at its micro-batch (the trial there, else the profile's
fit floored at the optimizer step, autotune_server.drift.Reference) times 1 + d, where d is the job's
drift. **The distribution of d**: per scenario a systematic drift s of the setup (0.25 %: the H200
six-update run of issue 20, 9 MiB over 3.6 GiB; 4 %; 8 %; 16 %), plus per-job noise N(0, 1.5 %), and
2 % of jobs are strays at +40 % (a neighbour process on the card). A job runs out of memory when its
peak passes the budget (the card), not the probe's limit (budget less headroom).

Modes: **none** (jobs report nothing), **oom** (jobs report only their OOMs: what the store used before
issue 20), **loop** (jobs report their peaks and OOMs: the drift rule of autotune_server/drift.py).
Per mode: the share of jobs that ran out of memory, the mean m_max answered and the mean micro-batch
of the plan a job ran (the largest of its balanced plan for 256), and the m_max given up against
``none`` (a job's samples per second fall with m, so that is the throughput given up); beside them
the m_max the store would answer if it knew the setup's drift s exactly (``oracle``).
Figures only: never part of the test run's pass/fail.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient

from autotune.core.schemas import Profile
from autotune.orchestrate.probe import ProbeConfig, probe
from autotune.tasks.load import load_task
from autotune_server import Settings, create_app
from autotune_server.drift import Reference, fitting_micro_batch
from autotune_server.migrate import upgrade_head

TOKEN = "bench-drift-token"
WRITE = {"Authorization": f"Bearer {TOKEN}"}
MiB = 1 << 20
SYSTEMATIC = (0.0025, 0.04, 0.08, 0.16)
NOISE = 0.015
STRAY_SHARE, STRAY_DRIFT = 0.02, 0.40
MODES = ("none", "oom", "loop")
TARGET_BATCH = 256


@dataclass
class Outcome:
    mode: str
    jobs: int
    ooms: int
    micro_batches: list[int]
    max_micro_batches: list[int]

    @property
    def oom_share(self) -> float:
        return self.ooms / self.jobs

    @property
    def mean_m(self) -> float:
        return statistics.fmean(self.micro_batches)

    @property
    def mean_m_max(self) -> float:
        return statistics.fmean(self.max_micro_batches)


def reference(profile: Profile) -> Reference:
    deciding = profile.deciding_trials
    return Reference(
        trials=tuple((t.micro_batch, t.peak_bytes, t.fits, t.oom) for t in deciding),
        fit=profile.fit,
        step_floor=profile.step_floor_bytes,
    )


def job_drifts(rng: random.Random, systematic: float, jobs: int, stray_share: float = STRAY_SHARE) -> list[float]:
    return [
        STRAY_DRIFT if rng.random() < stray_share else max(-0.05, rng.gauss(systematic, NOISE)) for _ in range(jobs)
    ]


def run_fleet(profile: Profile, drifts: list[float], mode: str, workdir: Path) -> Outcome:
    url = f"sqlite:///{workdir / f'{mode}.db'}"
    upgrade_head(url)
    settings = Settings(database_url=url, api_tokens=(f"bench={TOKEN}",), access_log=False, suggest_cache_seconds=1.0)
    ref = reference(profile)
    ooms, sizes, caps = 0, [], []
    with TestClient(create_app(settings)) as http:
        created = http.post("/api/v1/profiles", json=profile.model_dump(mode="json"), headers=WRITE)
        assert created.status_code == 201, created.text
        profile_id = created.json()["id"]
        query: dict[str, Any] = {
            "fingerprint": profile.fingerprint,
            "device_name": profile.device.name,
            "target_batch": TARGET_BATCH,
        }
        for drift in drifts:
            answer = http.get("/api/v1/suggest", params=query)
            assert answer.status_code == 200, answer.text
            m = int(answer.json()["micro_batch"])
            sizes.append(m)
            caps.append(int(answer.json()["max_micro_batch"]))
            base = ref.peak_at(m)
            assert base is not None
            peak = round(base * (1.0 + drift))
            oom = peak > profile.budget_bytes
            ooms += oom
            body: dict[str, Any] | None = None
            if oom and mode in ("oom", "loop"):
                body = {"micro_batch": m, "oom": True, "note": "bench/drift.py"}
            elif not oom and mode == "loop":
                body = {"micro_batch": m, "peak_bytes": peak, "device_name": profile.device.name, "world_size": 1}
            if body is not None:
                posted = http.post(f"/api/v1/profiles/{profile_id}/observations", json=body, headers=WRITE)
                assert posted.status_code == 201, posted.text
    return Outcome(mode=mode, jobs=len(drifts), ooms=ooms, micro_batches=sizes, max_micro_batches=caps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--headrooms", default="0.10,0.02")
    parser.add_argument("--stray-share", type=float, default=STRAY_SHARE, help="share of jobs at +40 %%")
    args = parser.parse_args(argv)

    task = load_task("examples/gpt.py:task")
    print(
        f"fleet: {args.jobs} jobs per scenario, target {TARGET_BATCH}; drift per job = s + N(0, {NOISE:.1%}), "
        f"{args.stray_share:.0%} strays at +{STRAY_DRIFT:.0%}; seed {args.seed}",
        file=sys.stderr,
    )
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for headroom in (float(h) for h in args.headrooms.split(",")):
            profile = probe(
                task, ProbeConfig(device="cpu", budget_bytes=24 * MiB, headroom=headroom, target_batch=TARGET_BATCH)
            )
            ref = reference(profile)
            for s in SYSTEMATIC:
                drifts = job_drifts(random.Random(args.seed * 1000 + round(s * 1e4)), s, args.jobs, args.stray_share)
                oracle = fitting_micro_batch(
                    ref, s, max_micro_batch=profile.max_micro_batch, limit=profile.limit_bytes, multiple_of=1
                )
                outcomes = {}
                for mode in MODES:
                    workdir = Path(tmp) / f"h{headroom}-s{s}"
                    workdir.mkdir(exist_ok=True)
                    outcomes[mode] = run_fleet(profile, drifts, mode, workdir)
                rows.append((headroom, s, profile.max_micro_batch, oracle, outcomes))

    print(
        "| headroom | setup drift s | probe m_max | oracle m_max | OOM none | OOM oom-only | OOM loop "
        "| m_max none | m_max oom-only | m_max loop | plan m none / oom-only / loop | m_max given up by the loop |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for headroom, s, m_max, oracle, out in rows:
        none, oom_only, loop = out["none"], out["oom"], out["loop"]
        given_up = (none.mean_m_max - loop.mean_m_max) / none.mean_m_max
        print(
            f"| {headroom:.2f} | {s:+.2%} | {m_max} | {oracle} | {none.oom_share:.1%} | {oom_only.oom_share:.1%} "
            f"| {loop.oom_share:.1%} | {none.mean_m_max:.2f} | {oom_only.mean_m_max:.2f} | {loop.mean_m_max:.2f} "
            f"| {none.mean_m:.2f} / {oom_only.mean_m:.2f} / {loop.mean_m:.2f} | {given_up:+.1%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
