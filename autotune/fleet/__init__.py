"""`autotune fleet`: probe many job setups on every GPU kind of a Ray cluster and keep the store full.

One Ray task per pair (a task file × an accelerator kind or device × a budget) runs today's probe in
a worker; with ``--gpu`` (a task file × a catalog card × a budget) it runs the card's emulated estimate
on a CPU instead. The driver shows their progress, uploads each profile as it arrives and keeps what it
cannot upload on disk. The modules, one job each:

    pairs.py     what to probe: the pairs, their probe (or estimate) configs and the Ray resources they ask for
    worker.py    what runs in a Ray worker: load the task from its spec, probe or estimate, report one outcome
    progress.py  the live table of pending / running / done / failed pairs and the summary
    sink.py      where profiles go: the server (idempotent uploads) and/or a directory of JSON files
    runner.py    the driver: connect to (or start) Ray, submit, collect, cancel on Ctrl-C

Ray is an optional extra (`pip install 'autotune[fleet]'`): no module here imports it at import
time, only ``runner.run_fleet`` and the worker's code that runs under Ray.
"""

from autotune.fleet.pairs import EstimateOptions, Pair, make_pairs, parse_accelerators, parse_cards
from autotune.fleet.progress import PairState, Progress
from autotune.fleet.runner import run_fleet
from autotune.fleet.sink import ProfileSink, Stored
from autotune.fleet.worker import Board, Outcome, estimate_pair, probe_pair

__all__ = [
    "Board",
    "EstimateOptions",
    "Outcome",
    "Pair",
    "PairState",
    "ProfileSink",
    "Progress",
    "Stored",
    "estimate_pair",
    "make_pairs",
    "parse_accelerators",
    "parse_cards",
    "probe_pair",
    "run_fleet",
]
