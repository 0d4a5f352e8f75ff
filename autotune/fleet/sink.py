"""Where the fleet's profiles go: the server, and JSON files for what the server did not take.

Uploads go through the client (``TunerClient.upload``): the server keys profiles by content, so an
upload repeated after a lost answer, or a directory uploaded twice, stores each profile once.
A profile that cannot be uploaded (the server down, a refused token) is kept as a JSON file, for
``autotune profiles upload DIR`` later; with ``--output DIR`` every profile is written there too.
Files are written beside their name and renamed over it, so a Ctrl-C never leaves half a profile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from autotune.core.files import write_atomically
from autotune.core.schemas import Profile

__all__ = ["DEFAULT_UNSENT_DIR", "ProfileSink", "Stored", "profile_file_name"]

DEFAULT_UNSENT_DIR = Path("autotune-fleet-unsent")
"""Where profiles the server did not take are kept when no ``--output`` was given."""


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower() or "x"


def profile_file_name(profile: Profile) -> str:
    """``gpt-small-nvidia-h100-80gb-hbm3-25769803776-0123456789ab.json``: task, device, budget in
    bytes and fingerprint, so that the files of one run never collide and a rerun replaces its own; a
    length (``-L512``) and a memory policy other than none (``-full``) too, which the fingerprint leaves
    out (one run over lengths or policies makes a profile of each)."""
    setup = f"{_slug(profile.task)}-{_slug(profile.device.name)}-{profile.budget_bytes}"
    if profile.seq_len is not None:
        setup += f"-L{profile.seq_len}"
    if profile.activation_checkpointing != "none":
        setup += f"-{_slug(profile.activation_checkpointing)}"
    return f"{setup}-{profile.fingerprint[:12]}.json"


@dataclass(frozen=True)
class Stored:
    """Where one profile went: its id on the server, its file, and why it was not uploaded."""

    profile_id: int | None
    path: Path | None
    upload_error: str | None


class ProfileSink:
    """Keeps finished profiles: uploads them to ``server`` and/or writes them to ``output_dir``.

    Args:
        server: the autotune server's URL, or None for files only.
        token: a write token (None: the client reads ``$AUTOTUNE_TOKEN``).
        output_dir: every profile is written here as JSON; also where failed uploads are kept.
        unsent_dir: where failed uploads are kept when there is no ``output_dir``.
    """

    def __init__(
        self,
        *,
        server: str | None,
        token: str | None,
        output_dir: Path | None,
        unsent_dir: Path = DEFAULT_UNSENT_DIR,
    ) -> None:
        self.server = server
        self.token = token
        self.output_dir = output_dir
        self.unsent_dir = unsent_dir
        self._client: Any = None

    def keep(self, profile: Profile) -> Stored:
        """Store one profile; never raises for the server's sake (its error is in the result)."""
        path = self._write(profile, self.output_dir) if self.output_dir is not None else None
        if self.server is None:
            return Stored(None, path, None)
        from autotune_client.errors import AutotuneClientError

        try:
            if self._client is None:
                from autotune_client import TunerClient

                self._client = TunerClient(base_url=self.server, token=self.token)
            return Stored(int(self._client.upload(profile)), path, None)
        except AutotuneClientError as exc:
            error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if path is None:
            path = self._write(profile, self.unsent_dir)
        return Stored(None, path, error)

    @staticmethod
    def _write(profile: Profile, directory: Path) -> Path:
        path = directory / profile_file_name(profile)
        write_atomically(path, profile.model_dump_json(indent=2))
        return path

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __enter__(self) -> ProfileSink:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
