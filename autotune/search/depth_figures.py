"""What a walk's tokens read (autotune/search/depth_template.py): the trace the caching allocator's model replays,
the fake meter's figures and the breakdown, each computed as the meter, the card's search and the breakdown's
recorder compute them from the same events, so that a walk made for a deeper model reads what the whole walk of
that model would.

The tokens (made by autotune/search/depth_walks.py from a recorded fake trial):

- ``("A", bytes, stream, flag, category)``: an allocation on the stream (0 the default one, 1, 2, ... the others
  in their order of first use); flag ``"h"`` a storage held when the recording began, ``"s"`` a kernel's temporary
  (it raises the meter's peak, never its live bytes nor an OOM), ``"r"`` a storage resized from one size to another
  (its new bytes, which count with the release that follows), ``""`` any other; the breakdown's category of it
  (``""`` without a breakdown).
- ``("F", bytes, stream, flag)``: a release of the allocation its reference names (``"s"``: a temporary's; ``"p"``:
  the old bytes of a resize, released as the new ones count); ``("F0",)`` a release of a storage never seen.
- Marks: ``("H",)`` the end of the held storages; ``("K", phase)`` the meter takes its peak (``checkpoint(phase)``,
  or ``""``: the reset at a measured span's start); ``("E", on)`` the budget enforced from here or not
  (``unbounded()``); ``("P", phase)`` the breakdown's phase; ``("N", kind, op, backward)`` the breakdown's note of a
  place of the peak by the operator ``op``, after a counted allocation (``"c"``: the live bytes) or a kernel's
  temporaries (``"s"``: the meter's peak); ``("T", "+" | "-", module)`` a module enters or leaves the running set
  the place is named by (``{}`` in its name for the block index the walk's ``blocks`` gives), ``("T", "0")`` the set
  reset.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autotune.core.allocator import FREE
from autotune.search.depth_template import Walk

__all__ = ["MeterFigures", "events_of", "meter_figures", "peak_label", "phases_of", "replay_trace"]


@dataclass(frozen=True)
class MeterFigures:
    """The fake meter's reading of a walk under ``budget_bytes``: the peak, the forward-backward and step phases'
    (None after an OOM, as a trial reports them), and whether the live bytes crossed the budget (the trial stops
    there: its peak is the live bytes' when they crossed, over everything before)."""

    peak_bytes: int
    forward_backward_bytes: int | None
    step_bytes: int | None
    oom: bool
    crossed_before_measure: bool = False  # the crossing came before the measured span (the model's own build)


def events_of(walk: Walk) -> tuple[list[tuple[int, int]], list[tuple[int, int]], dict[int, int], list[str]]:
    """The walk as a recording holds it: held ``(key, bytes)``, events ``(key, bytes)`` / ``(key, FREE)``, the
    stream of each allocation off the default stream (by key) and every allocation's category (held first). Keys
    are token indices (a release of a storage never seen: key 0, which no allocation has, as ``renumbered`` says)."""
    held: list[tuple[int, int]] = []
    events: list[tuple[int, int]] = []
    streams: dict[int, int] = {}
    categories: list[str] = []
    for index, token in enumerate(walk.tokens):
        kind = token[0]
        if kind == "A":
            key = index + 1
            (held if token[3] == "h" else events).append((key, token[1]))
            if token[2]:
                streams[key] = token[2]
            categories.append(token[4])
        elif kind == "F":
            events.append((walk.refs[index] + 1, FREE))
        elif kind == "F0":
            events.append((0, FREE))
    return held, events, streams, categories


def replay_trace(walk: Walk, workspaces: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], dict[int, int]]:
    """The trace the card's search replays (autotune/search/reserved.py): the workspaces, the held storages, the
    events but releases of storages never seen; with each allocation's stream."""
    held, events, streams, _ = events_of(walk)
    return [*workspaces, *held, *((k, n) for k, n in events if k != 0)], streams


def meter_figures(walk: Walk, budget_bytes: int) -> MeterFigures:
    """The fake meter's reading of the walk (autotune/measure/meters/cpu.py, ``_StorageLedger`` and ``Meter``): live
    bytes change at each counted allocation and release, a kernel's temporaries raise the peak only, a resize counts
    its new bytes as it releases the old; each take of the peak closes its phase. An allocation that brings the live
    bytes past ``budget_bytes`` while the budget is enforced is the OOM: the trial's peak is every phase's up to it.
    """
    live = 0
    peak = 0
    scratch = 0
    pending = 0
    enforced = True
    measuring = False
    phases: dict[str, int] = {}
    crossed = False
    for token in walk.tokens:
        kind = token[0]
        if kind == "A":
            flag = token[3]
            if flag == "h":
                live += token[1]
                continue
            if flag == "s":
                scratch += token[1]
                peak = max(peak, live + scratch)
                continue
            if flag == "r":
                pending = token[1]
                continue
            live += token[1]
            peak = max(peak, live)
            if enforced and live > budget_bytes:
                crossed = True
                break
        elif kind == "F":
            flag = token[3]
            if flag == "s":
                scratch -= token[1]
            elif flag == "p":
                live += pending - token[1]
                pending = 0
                peak = max(peak, live)
                if enforced and live > budget_bytes:
                    crossed = True
                    break
            else:
                live -= token[1]
        elif kind == "K":
            if token[1]:
                phases[token[1]] = max(phases.get(token[1], 0), peak)
            else:
                measuring = True
            peak = live
        elif kind == "E":
            enforced = bool(token[1])
    if crossed:
        phases["tail"] = max(phases.get("tail", 0), peak)
        return MeterFigures(max(phases.values()), None, None, True, crossed_before_measure=not measuring)
    return MeterFigures(
        max(phases.values()) if phases else 0, phases.get("forward_backward"), phases.get("step"), False
    )


def peak_label(walk: Walk) -> str:
    """The breakdown's place of the peak (``BreakdownRecorder.note_peak``): at each note that raises the best peak
    seen so far (the live bytes after a counted allocation, the meter's peak after a kernel's temporaries), the
    operator in the innermost running module (the longest name, then the last by name), forward or backward, or in
    the phase where none runs."""
    live = 0
    peak = 0
    scratch = 0
    pending = 0
    best = -1
    label = ""
    running = {"Global"}
    phase = "model"
    for index, token in enumerate(walk.tokens):
        kind = token[0]
        if kind == "A":
            flag = token[3]
            if flag == "s":
                scratch += token[1]
                peak = max(peak, live + scratch)
            elif flag == "r":
                pending = token[1]
            else:
                live += token[1]
                peak = max(peak, live)
        elif kind == "F":
            flag = token[3]
            if flag == "s":
                scratch -= token[1]
            elif flag == "p":
                live += pending - token[1]
                peak = max(peak, live)
            else:
                live -= token[1]
        elif kind == "K":
            peak = live
        elif kind == "P":
            phase = token[1]
        elif kind == "T":
            if token[1] == "0":
                running = {"Global"}
                continue
            block = walk.blocks[index]
            name = token[2] if block is None else token[2].replace("{}", str(block))
            if token[1] == "+":
                running.add(name)
            else:
                running.discard(name)
        elif kind == "N":
            figure = live if token[1] == "c" else peak
            if figure > best:
                best = figure
                inside = [name for name in running if name != "Global"]
                module = max(inside, key=lambda name: (len(name), name)) if inside else ""
                where = f"{module} {'backward' if token[3] else 'forward'}" if module else phase
                label = f"{token[2]} in {where}" if where else token[2]
    return label


def phases_of(walk: Walk) -> list[list[object]]:
    """The breakdown's phase marks, each at the count of events before it, after the recorder's own first one (the
    model's, at 0)."""
    phases: list[list[object]] = [[0, "model"]]
    events = 0
    held = True
    for token in walk.tokens:
        kind = token[0]
        if kind == "H":
            held = False
        elif kind in ("A", "F", "F0"):
            events += 0 if held else 1
        elif kind == "P":
            phases.append([events, token[1]])
    return phases
