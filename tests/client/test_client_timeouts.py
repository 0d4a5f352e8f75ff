"""Timeouts against a real socket: a server that accepts connections and never answers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from autotune_client import APIConnectionError, APITimeoutError, TunerClient

TIMEOUT_SECONDS = 2.0
# Scheduling slack on a shared, loaded machine; still far below "a job hangs".
# Generous: the property is "bounded by the timeout, not by retries x timeout" on a loaded machine.
SLACK_SECONDS = 2.0


class BlackHole:
    """Accepts TCP connections on a loopback port, reads nothing, answers nothing."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.accepted.append(conn)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        for conn in self.accepted:
            conn.close()
        self.sock.close()


@pytest.fixture
def black_hole() -> Iterator[BlackHole]:
    server = BlackHole()
    try:
        yield server
    finally:
        server.close()


def test_a_silent_server_times_out_within_the_client_timeout(black_hole: BlackHole) -> None:
    url = f"http://127.0.0.1:{black_hole.port}"
    with TunerClient(base_url=url, timeout=TIMEOUT_SECONDS, max_retries=2) as client:
        started = time.monotonic()
        with pytest.raises(APITimeoutError) as info:
            client.suggest(fingerprint="ab" * 32, target_batch=8, world_size=1, device_name="cpu")
        elapsed = time.monotonic() - started
    # The timeout bounds the whole call, retries included: three attempts of 2 s each (6 s and more) would not.
    assert TIMEOUT_SECONDS * 0.9 <= elapsed < TIMEOUT_SECONDS + SLACK_SECONDS
    assert f"{TIMEOUT_SECONDS:g} s" in str(info.value)
    assert len(black_hole.accepted) >= 1  # it did connect: this is a read timeout, not a refusal


def test_a_closed_port_is_a_connection_error_not_a_timeout() -> None:
    with socket.socket() as probe_sock:  # a port that was free a moment ago, now closed
        probe_sock.bind(("127.0.0.1", 0))
        port = probe_sock.getsockname()[1]
    with TunerClient(base_url=f"http://127.0.0.1:{port}", timeout=5.0, max_retries=1) as client:
        client._sleep = lambda _seconds: None
        started = time.monotonic()
        with pytest.raises(APIConnectionError) as info:
            client.profiles()
        elapsed = time.monotonic() - started
    assert not isinstance(info.value, APITimeoutError)
    assert elapsed < 2.0  # a refusal is fast; nothing waits for the 5 s timeout
