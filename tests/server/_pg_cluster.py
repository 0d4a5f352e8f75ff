"""A throw-away PostgreSQL cluster that a test (or bench/db_outage.py) can stop and start at will.

The shared test database cannot be stopped: other tests and developers use it. This one lives in a
temporary directory, listens on a free loopback port, and is made by the server binaries of the
installed PostgreSQL (``/usr/lib/postgresql/*/bin``, or ``$AUTOTUNE_PG_BIN``). PostgreSQL refuses
to run as root, so under root the binaries run as the ``postgres`` user.

    with ThrowawayPostgres.create() as pg:
        url = pg.url            # postgresql+psycopg://postgres@127.0.0.1:PORT/postgres
        pg.stop(); pg.start()
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from types import TracebackType

__all__ = ["ThrowawayPostgres", "postgres_bin"]


def postgres_bin() -> Path | None:
    """The folder with initdb and pg_ctl, or None when PostgreSQL's server binaries are not installed."""
    explicit = os.environ.get("AUTOTUNE_PG_BIN")
    candidates = [explicit] if explicit else sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if folder and (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    found = shutil.which("initdb")
    return Path(found).parent if found and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ThrowawayPostgres:
    """One cluster in a temporary directory; ``close`` stops it and deletes everything."""

    def __init__(self, bin_dir: Path, root: Path, port: int, user: str | None) -> None:
        self.bin_dir = bin_dir
        self.root = root
        self.port = port
        self._user = user
        self.data = root / "data"
        self.log = root / "postgres.log"

    @classmethod
    def create(cls) -> ThrowawayPostgres:
        """initdb and start a new cluster.

        Raises:
            RuntimeError: no PostgreSQL server binaries, or initdb/pg_ctl failed (the message says why).
        """
        bin_dir = postgres_bin()
        if bin_dir is None:
            raise RuntimeError("PostgreSQL server binaries (initdb, pg_ctl) not found; set AUTOTUNE_PG_BIN")
        user = None
        # The folder must be reachable by the postgres user (pytest's tmp_path is not, under root).
        root = Path(tempfile.mkdtemp(prefix="autotune-pg-"))
        if os.geteuid() == 0:
            user = "postgres"
            entry = pwd.getpwnam(user)
            os.chown(root, entry.pw_uid, entry.pw_gid)
        cluster = cls(bin_dir, root, _free_port(), user)
        try:
            cluster._run("initdb", "-D", str(cluster.data), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
            cluster.start()
        except BaseException:
            cluster.close()
            raise
        return cluster

    @property
    def url(self) -> str:
        """SQLAlchemy URL of the cluster's ``postgres`` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        """Start the server and wait until it accepts connections."""
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.log), "-w", "-t", "30", "start")

    def stop(self, mode: str = "fast") -> None:
        """Stop the server (``fast``: disconnect clients, clean shutdown; ``immediate``: like a crash)."""
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30", "stop")

    def running(self) -> bool:
        """Whether the server is up."""
        result = self._command("pg_ctl", "-D", str(self.data), "status")
        return subprocess.run(result, capture_output=True, check=False).returncode == 0

    def close(self) -> None:
        """Stop the server if it runs, and delete the cluster."""
        try:
            if self.data.exists() and self.running():
                self.stop("immediate")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> ThrowawayPostgres:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _command(self, tool: str, *args: str) -> list[str]:
        command = [str(self.bin_dir / tool), *args]
        return ["runuser", "-u", self._user, "--", *command] if self._user else command

    def _run(self, tool: str, *args: str) -> None:
        result = subprocess.run(self._command(tool, *args), capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = (result.stderr or result.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{tool} failed ({result.returncode}): {' / '.join(tail)}")
