"""A TCP proxy in front of PostgreSQL that can cut a connection at its COMMIT, once.

What a network failure does to a transaction at its worst moment: the COMMIT never reaches the
server (nothing stored), or the server commits and its answer never comes back (stored, and the
application cannot know). Either way the application sees a dead connection.

    with TcpProxy("127.0.0.1", pg_port) as proxy:
        proxy.cut_at_commit(after=True)    # the next COMMIT is committed, its answer lost
        proxy.silent = True                # new connections are accepted and never answered
"""

from __future__ import annotations

import socket
import threading
from types import TracebackType

__all__ = ["TcpProxy"]

# psycopg commits with a simple-query message: 'Q', int32 length (4 + len("COMMIT\0") = 11), the text.
_COMMIT = b"Q\x00\x00\x00\x0bCOMMIT\x00"


class _Pair:
    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.drop_next_answer = False

    def close(self) -> None:
        for sock in (self.client, self.server):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``host``:``target_port`` byte for byte, until told to cut."""

    def __init__(self, host: str, target_port: int) -> None:
        self.target = (host, target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._armed: bool | None = None  # None: pass everything; False: cut before; True: cut after
        self.cuts = 0
        self._pairs: list[_Pair] = []
        self._held: list[socket.socket] = []
        self._closed = False
        # A host that accepts connections and never answers (a hung server, a half-dead network path).
        self.silent = False
        threading.Thread(target=self._accept, daemon=True).start()

    def cut_at_commit(self, *, after: bool) -> None:
        """Cut the connection that sends the next COMMIT: before forwarding it, or after the server got it."""
        with self._lock:
            self._armed = after

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        self._listener.close()
        for pair in self._pairs:
            pair.close()
        for sock in self._held:
            sock.close()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.silent:
                self._held.append(client)
                continue
            server = socket.create_connection(self.target)
            pair = _Pair(client, server)
            self._pairs.append(pair)
            threading.Thread(target=self._upstream, args=(pair,), daemon=True).start()
            threading.Thread(target=self._downstream, args=(pair,), daemon=True).start()

    def _upstream(self, pair: _Pair) -> None:
        try:
            while data := pair.client.recv(65536):
                if _COMMIT in data:
                    with self._lock:
                        armed, self._armed = self._armed, None
                    if armed is False:
                        self.cuts += 1
                        pair.close()
                        return
                    if armed is True:
                        self.cuts += 1
                        pair.drop_next_answer = True
                pair.server.sendall(data)
        except OSError:
            pass
        pair.close()

    def _downstream(self, pair: _Pair) -> None:
        try:
            while data := pair.server.recv(65536):
                if pair.drop_next_answer:
                    pair.close()
                    return
                pair.client.sendall(data)
        except OSError:
            pass
        pair.close()
