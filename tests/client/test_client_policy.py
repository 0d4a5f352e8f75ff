"""suggest(..., objective=, activation_checkpointing=): the policy reaches the server and comes back
in the Suggestion; a local probe runs under the job's policy and times its plan."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import Any

import pytest

from autotune_client import AutotuneClientError, TunerUnavailableWarning, suggest
from examples.gpt import GPT, GPTConfig, make_batch
from tests.client._factories import json_response, make_suggestion, mock_client, sequence

TINY = GPTConfig(vocab_size=64, seq_len=16, d_model=32, n_heads=2, n_layers=2)


def tiny_batch(m: int) -> dict:
    return make_batch(m, TINY)


@pytest.fixture(autouse=True)
def _no_ambient_server(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AUTOTUNE_URL", "AUTOTUNE_TOKEN", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_the_objective_and_the_policy_reach_the_server_and_come_back() -> None:
    answer = make_suggestion().model_copy(update={"activation_checkpointing": "full", "samples_per_second": 12.5})
    handler, seen = sequence(json_response(200, answer.model_dump(mode="json")))
    with mock_client(handler) as client:
        got = suggest(GPT(TINY), 128, example=tiny_batch, objective="throughput", client=client)
    params = seen[0].url.params
    assert params["objective"] == "throughput" and "activation_checkpointing" not in params  # none is left out
    assert (got.activation_checkpointing, got.samples_per_second) == ("full", 12.5)
    assert got.as_hf_training_args()["gradient_checkpointing"] is True


def test_a_local_probe_runs_under_the_jobs_policy_and_times_its_plan() -> None:
    with pytest.warns(TunerUnavailableWarning):
        got = suggest(
            GPT(TINY), 64, example=tiny_batch, budget="2MiB", activation_checkpointing="full", objective="throughput"
        )
    assert (got.source, got.activation_checkpointing) == ("probed", "full")
    assert got.samples_per_second is not None and got.samples_per_second > 0
    assert got.effective_batch == 64


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"objective": "speed"}, "objective must be one of memory, throughput"),
     ({"activation_checkpointing": "half"}, "activation_checkpointing: unknown policy 'half': choose from none"),
     ({"activation_checkpointing": "every-1"}, "every-1' checkpoints every block: that is full")],
)  # fmt: skip
def test_bad_policy_arguments_are_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(AutotuneClientError, match=match):
        suggest(GPT(TINY), 8, example=tiny_batch, budget="8MiB", **kwargs)


def test_the_suggest_command_asks_by_throughput_and_says_the_policy(in_process_server: Callable[..., Any]) -> None:
    from autotune.cli.client_commands import EXIT_OK, suggest_command, upload_profile
    from autotune.core.schemas import Throughput
    from tests.client._factories import make_profile
    from tests.client.conftest import IN_PROCESS_URL, WRITE_TOKEN

    def timed(size: int, seconds: float) -> list[Throughput]:
        return [
            Throughput(
                micro_batch=size,
                samples_per_second=size / seconds,
                seconds_per_update=seconds,
                micro_batches=[(size, 1)],
                micro_batch_seconds=[(size, seconds - 0.1)],
                step_seconds=0.1,
            )
        ]

    plain = make_profile(max_micro_batch=8).model_copy(update={"throughput": timed(8, 1.0)})
    full = make_profile(max_micro_batch=20).model_copy(
        update={"activation_checkpointing": "full", "throughput": timed(20, 1.5)}
    )
    for profile in (plain, full):
        upload_profile(profile, server=IN_PROCESS_URL, token=WRITE_TOKEN)
    out, err = io.StringIO(), io.StringIO()
    common: dict[str, Any] = {
        "server": IN_PROCESS_URL, "fingerprint": plain.fingerprint, "target_batch": 40, "world_size": 1,
        "device_name": plain.device.name, "budget_bytes": None, "headroom": None, "as_json": False,
    }  # fmt: skip
    assert suggest_command(**common, objective="throughput", out=out, err=err) == EXIT_OK
    # full: 2 steps of 20 at 1.4 s + 0.1 = 2.9 s (13.8/s); none: 5 of 8 at 0.9 s + 0.1 = 4.6 s (8.7/s).
    assert "activation checkpointing full" in out.getvalue() and "13.79 samples/s timed" in out.getvalue()
    out = io.StringIO()
    assert suggest_command(**common, activation_checkpointing="none", out=out, err=err) == EXIT_OK
    assert out.getvalue().startswith("micro_batch=8 accumulation_steps=5") and "checkpointing" not in out.getvalue()
