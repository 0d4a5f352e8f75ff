"""suggest(..., objective=, activation_checkpointing=): the policy reaches the server and comes back
in the Suggestion; a local probe runs under the job's policy and times its plan."""

from __future__ import annotations

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
     ({"activation_checkpointing": "half"}, "activation_checkpointing must be one of none, every-2, full")],
)  # fmt: skip
def test_bad_policy_arguments_are_one_line_errors(kwargs: dict, match: str) -> None:
    with pytest.raises(AutotuneClientError, match=match):
        suggest(GPT(TINY), 8, example=tiny_batch, budget="8MiB", **kwargs)
