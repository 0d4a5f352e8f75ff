"""TunerClient.capacity: the capacity a length-aware sampler fills, from what a real server stores."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from autotune.core.capacity import capacity
from autotune.core.schemas import Profile
from autotune_client import AutotuneClientError
from tests.client.conftest import WRITE_TOKEN
from tests.factories import make_profile, surface_gpt_payloads


def test_the_stored_run_gives_the_local_capacity(in_process_server: Callable[..., Any]) -> None:
    payloads = surface_gpt_payloads()
    tuner = in_process_server(token=WRITE_TOKEN)
    for body in payloads:
        tuner.upload(Profile.model_validate(body))
    fingerprint, device = payloads[0]["fingerprint"], payloads[0]["device"]["name"]
    stored = tuner.capacity(fingerprint=fingerprint, device_name=device)
    local = capacity(payloads)
    assert stored.covered == local.covered == (128, 2048)
    assert stored.measured == {128: 36, 256: 18, 512: 9}
    assert [stored(length) for length in range(1, 2049, 7)] == [local(length) for length in range(1, 2049, 7)]
    with pytest.raises(ValueError, match="longer than the profiles cover"):
        stored(4096)


def test_nothing_over_lengths_stored_is_one_line(in_process_server: Callable[..., Any]) -> None:
    tuner = in_process_server(token=WRITE_TOKEN)
    plain = make_profile()
    tuner.upload(plain)  # a setup that is not sequence-aware
    with pytest.raises(AutotuneClientError) as caught:
        tuner.capacity(fingerprint=plain.fingerprint, device_name=plain.device.name)
    assert "no profile over sequence lengths" in str(caught.value) and "--seq-len" in str(caught.value)
    with pytest.raises(AutotuneClientError, match="no profile over sequence lengths"):
        tuner.capacity(fingerprint="0" * 64, device_name="cpu", source="estimate")


def test_the_newest_run_answers(in_process_server: Callable[..., Any]) -> None:
    tuner = in_process_server(token=WRITE_TOKEN)
    older = surface_gpt_payloads()
    newer = surface_gpt_payloads()
    for body in newer:  # the same setup measured again, on a device that showed more above the surface
        body["surface"]["offset_bytes"] = 2_000_000
        body["seconds"] = 99.0
    for body in [*older, *newer]:
        tuner.upload(Profile.model_validate(body))
    stored = tuner.capacity(fingerprint=older[0]["fingerprint"], device_name="cpu")
    assert stored.offset_bytes == 2_000_000
    assert stored(384) == capacity(newer)(384) < capacity(older)(384)
