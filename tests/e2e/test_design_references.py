"""The code's references to the design of record point into the project, at sections that exist.

Code and tests cite the design as ``docs/design.md, "The trial"`` (a comment, a docstring). The design once
lived outside the repository, so a citation sent a reader nowhere; a renamed section would do the same.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
CODE = ["autotune", "server", "client", "tests", "bench", "examples"]
# `docs/design.md, "The trial"`, `docs/design.md "Contracts"`, `docs/design.md's "Contracts"`; a comment may wrap
# the section's name onto its next line ("The\n# trial").
CITATION = re.compile(r"design\.md(?:'s)?,?\s+\"([^\"]{1,80})\"")


def _sources() -> list[Path]:
    """The project's Python files but this one (its own examples of a citation are not citations)."""
    here = Path(__file__).resolve()
    return sorted(
        p for folder in CODE for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts and p != here
    )


def _headings() -> set[str]:
    text = re.sub(r"```.*?```", "", DESIGN.read_text(), flags=re.DOTALL)
    return {h.strip() for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_no_citation_of_a_design_outside_the_project() -> None:
    stale = [
        f"{path.relative_to(REPO)}:{number}"
        for path in _sources()
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if "DESIGN.md" in line
    ]
    assert stale == [], "cite docs/design.md (the design of record in the project), not DESIGN.md"


def test_every_cited_section_exists() -> None:
    headings = _headings()
    cited: list[tuple[str, str]] = []
    for path in _sources():
        for match in CITATION.finditer(path.read_text()):
            name = " ".join(re.sub(r"\n\s*#", " ", match.group(1)).split())
            cited.append((f"{path.relative_to(REPO)}", name))
    assert len(cited) >= 5  # the accumulator, the Profile, probe(), the dashboard, the contract test cite it
    missing = [f"{where}: {name!r}" for where, name in cited if name not in headings]
    assert missing == [], f"docs/design.md has no such section; its headings: {sorted(headings)}"
