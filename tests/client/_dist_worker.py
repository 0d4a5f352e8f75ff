"""The body of the one-decision-per-job tests, run in each spawned gloo process (importable by name)."""

from __future__ import annotations

import json
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import autotune.orchestrate.probe
from autotune_client import AutotuneClientError, suggest
from autotune_client._distributed import one_decision
from tests.client._factories import json_response, make_suggestion, mock_client

BUDGET = "512KiB"
TARGET = 256


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))


def _example(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(m, 64), torch.randint(0, 8, (m,))


def _counted_probe(calls: list[int]) -> Any:
    real = autotune.orchestrate.probe.probe

    def probe(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    return probe


def run(rank: int, world_size: int, rendezvous_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # two processes on a shared CPU: no oversubscription
    dist.init_process_group("gloo", init_method=f"file://{rendezvous_file}", rank=rank, world_size=world_size)
    result: dict[str, Any] = {}
    calls: list[int] = []
    autotune.orchestrate.probe.probe = _counted_probe(calls)  # suggest imports it from the module when it probes
    warnings.simplefilter("ignore")  # the local probe's "no tuner server" warning, on rank 0
    try:
        # 1. No server: rank 0 probes, the other rank receives its answer.
        s = suggest(_model(), TARGET, example=_example, budget=BUDGET, device="cpu")
        result["local"] = {"suggestion": s.model_dump(), "probes": len(calls)}

        # 2. distributed=False: every rank decides (and probes) on its own.
        calls.clear()
        s = suggest(_model(), TARGET, example=_example, budget=BUDGET, device="cpu", distributed=False)
        result["per_rank"] = {"suggestion": s.model_dump(), "probes": len(calls)}

        # 3. A store: only rank 0 asks it.
        requests: list[str] = []
        answer = make_suggestion(world_size=world_size, profile_id=rank + 100)

        def handler(request: Any) -> Any:
            requests.append(request.url.path)
            return json_response(200, answer.model_dump(mode="json"))

        with mock_client(handler) as client:
            s = suggest(_model(), TARGET, example=_example, client=client)
        result["store"] = {"suggestion": s.model_dump(), "requests": requests}

        # 4. Rank 0 fails: its own error there, one line naming rank 0 elsewhere.
        try:
            suggest(_model(), TARGET, example=_example, budget="not a size", device="cpu")
        except AutotuneClientError as exc:
            result["error"] = str(exc)

        # 5. Rank 0 too slow for the wait: the other rank gives up with a one-line error.
        def slow() -> Any:
            time.sleep(4.0)
            return answer

        try:
            one_decision(slow, wait_seconds=1.0)
            result["timeout"] = None
        except (AutotuneClientError, RuntimeError) as exc:
            result["timeout"] = f"{type(exc).__name__}: {exc}"
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result, default=str))
        dist.destroy_process_group()
