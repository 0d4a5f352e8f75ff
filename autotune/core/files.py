"""Files that the probe and the fleet write: never half a file on disk.

Torch-free; the command modules (``autotune.cli``) and the fleet's sink (``autotune.fleet.sink``)
both write profiles through here.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_atomically"]


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` and a newline to ``path``: beside it first, then renamed over it.

    A reader (or a Ctrl-C) never sees a half-written profile; the parent folder is created.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n")
    tmp.replace(path)
