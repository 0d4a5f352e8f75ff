"""Write tests/slow_tests.txt from a junit XML of a whole `make test` run (var/junit.xml): the tests that took
more than SECONDS there, one `path::name` a line. tests/conftest.py marks them ``slow``, so `make test-fast`
leaves them out; `make test` runs them all. Regenerate after a run: `make slow-list`."""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# A test over this many seconds (setup, call and teardown: a module's first test carries its fixtures) is slow.
SECONDS = 2.0
ROOT = Path(__file__).resolve().parents[1]


def main(junit: str) -> int:
    slow: list[tuple[float, str]] = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        seconds = float(case.get("time") or 0)
        path = case.get("classname", "").replace(".", "/") + ".py"
        if seconds > SECONDS:
            slow.append((seconds, f"{path}::{case.get('name')}"))
    header = (
        f"# Tests over {SECONDS:g} s in a whole run (scripts/slow_tests.py from var/junit.xml): marked slow by\n"
        "# tests/conftest.py, left out by make test-fast. Regenerate with make slow-list.\n"
    )
    lines = sorted(key for _, key in slow)
    (ROOT / "tests" / "slow_tests.txt").write_text(header + "".join(f"{line}\n" for line in lines))
    print(f"{len(lines)} slow tests, {sum(s for s, _ in slow):.0f} s of {junit}'s time")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "var" / "junit.xml")))
