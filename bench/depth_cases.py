"""Every case of tests/autotune/test_depth.py (the suite runs three of them): the depth shortcut's search against the
whole walk's over the same small model, each trial's figures, the breakdown and the warnings compared to the byte,
with each walk's seconds (the shortcut pays from 8 blocks on; these models have 5 or 7, so it costs more here).

    nice .venv/bin/python bench/depth_cases.py            # all six cases, about 1 minute each
    nice .venv/bin/python bench/depth_cases.py --only cp  # the cases whose name holds "cp"

Figures only: "same" is the comparison the suite's test asserts.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from autotune.search import depth  # noqa: E402
from tests.autotune import test_depth  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="run the cases whose name holds this text")
    args = parser.parse_args()
    depth.MIN_BLOCKS = test_depth.BLOCKS  # as the test's fixture does: the shortcut from 5 blocks on
    print(f"{'case':<28} {'shortcut s':>10} {'whole s':>8}  same  m_max")
    differing = 0
    for case in test_depth.CASES:
        if args.only not in case:
            continue
        with tempfile.TemporaryDirectory() as where:
            arch, setup, config = test_depth.CASES[case]
            task = test_depth._task(Path(where), arch, setup, **config)
            started = time.perf_counter()
            short = test_depth._search(task, setup, shortcut=True)
            short_s = time.perf_counter() - started
            started = time.perf_counter()
            whole = test_depth._search(task, setup, shortcut=False)
            whole_s = time.perf_counter() - started
        same = test_depth._figures(short) == test_depth._figures(whole)
        differing += not same
        print(f"{case:<28} {short_s:>10.1f} {whole_s:>8.1f}  {'yes' if same else 'NO':<4}  {short.max_micro_batch}")
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
