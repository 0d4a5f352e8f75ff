"""The README (a front page) and the pages of docs/ say what the code does.

- the README's probe block runs as written and prints the datasheet the README shows (times aside),
  and its ``autotune suggest`` block answers as shown from the profile that probe stored;
- the README's ``suggest`` excerpt is lines of ``examples/train_with_suggest.py``, the script that
  docs/client.md carries and ``test_launch_path`` runs against a live server;
- the map in docs/README.md is the one ``autotune/__init__.py``'s docstring draws;
- every relative link resolves (file and heading), and every module path (``autotune.core.plan``,
  ``autotune/search/lanes.py``, ``autotune_server/drift.py``, ...) names something in the tree.

The integration blocks of docs/client.md run in ``tests/client/test_docs_integrations.py``.
"""

from __future__ import annotations

import glob
import re
import shlex
import subprocess
import textwrap
from pathlib import Path

import autotune
from tests import warm_cli
from tests.e2e.conftest import REPO, LiveServer, autotune_command

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
# Pages other developers are writing: linked already, and checked like the others once they exist.
PENDING = {DOCS / "fine-tuning.md", DOCS / "length-batching.md", DOCS / "cuda-estimates.md"}
PROCESS_TIMEOUT_SECONDS = 300
ROOTS = {
    "autotune": REPO / "autotune",
    "autotune_server": REPO / "server" / "autotune_server",
    "autotune_client": REPO / "client" / "autotune_client",
}


def section(path: Path, heading: str) -> str:
    """The text under ``heading`` (a whole heading line) up to the next heading of the same or a higher level."""
    text = path.read_text()
    assert f"\n{heading}\n" in text, f"{path.name} has no section {heading!r}"
    level = heading.split(" ", 1)[0]
    rest = text.split(f"\n{heading}\n", 1)[1]
    ends = [rest.find(f"\n{'#' * n} ") for n in range(2, len(level) + 1)]
    ends = [e for e in ends if e >= 0]
    return rest[: min(ends)] if ends else rest


def blocks(text: str, language: str = "") -> list[str]:
    """The fenced blocks of ``language`` (``""``: bare fences, output) in ``text``, in order."""
    found: list[str] = []
    current: list[str] | None = None
    lang = ""
    for line in text.splitlines(keepends=True):
        if current is None and line.startswith("```"):
            current, lang = [], line[3:].strip()
        elif current is not None and line.rstrip() == "```":
            if lang == language:
                found.append("".join(current))
            current = None
        elif current is not None:
            current.append(line)
    return found


def normalized(output: str) -> list[str]:
    """Output lines with what varies from run to run (seconds, samples per second, timed repeats) blanked."""
    lines = []
    for line in output.splitlines():
        line = re.sub(r"\d+(\.\d+)?s\b", "Ns", line)
        line = re.sub(r"[\d.]+ samples/s", "N samples/s", line)
        line = re.sub(r"median of \d+", "median of N", line)
        lines.append(" ".join(line.split()))
    return lines


def run(args: list[str], env: dict[str, str]) -> str:
    """What the command prints, stdout and stderr in the order a terminal shows them."""
    done = warm_cli.run(
        args,
        cwd=REPO,
        env={**env, "PYTHONUNBUFFERED": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=PROCESS_TIMEOUT_SECONDS,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    return done.stdout


def test_the_two_commands_come_first() -> None:
    first = blocks(README.read_text(), "bash")[0]
    assert re.search(r"^make run\b", first, re.MULTILINE) and re.search(r"^make test\b", first, re.MULTILINE)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.MULTILINE) and re.search(r"^test:", makefile, re.MULTILINE)
    assert len(README.read_text().splitlines()) <= 250  # a front page; the reference lives in docs/


def test_the_readme_probe_and_suggest_answer_as_shown(live_server: LiveServer) -> None:
    probe_section = section(README, "## One probe, its datasheet")
    (command,) = blocks(probe_section, "bash")
    (shown,) = blocks(probe_section, "")
    args = shlex.split(command.strip())
    assert args[0] == "autotune"
    out = run([*autotune_command(), *args[1:], "--server", live_server.url], live_server.env())
    printed = [line for line in normalized(out) if not line.startswith("uploaded as profile")]
    assert printed == normalized(shown), out
    # docs/probing.md shows the same probe's output (issue 62: its copy had gone stale).
    (probing_shown,) = [
        b for b in blocks(section(DOCS / "probing.md", "## Probe a job"), "") if b.startswith("probing gpt-small")
    ]
    assert normalized(probing_shown) == normalized(shown)

    answers = [b for b in blocks(section(README, "## `/suggest` from a job"), "") if b.startswith("$ autotune suggest")]
    assert len(answers) == 1
    first, *expected = answers[0].strip().splitlines()
    suggest_args = shlex.split(first.removeprefix("$ "))
    suggest_args[suggest_args.index("--server") + 1] = live_server.url
    out = run([*autotune_command(), *suggest_args[1:]], live_server.env())
    assert out.strip().splitlines() == expected


def test_the_readme_suggest_excerpt_is_the_tested_script() -> None:
    (excerpt,) = blocks(section(README, "## `/suggest` from a job"), "python")
    script = (REPO / "examples" / "train_with_suggest.py").read_text().splitlines()
    for line in excerpt.strip().splitlines():
        assert line in script, f"the README's line {line!r} is not in examples/train_with_suggest.py"
    client_script = blocks(section(DOCS / "client.md", "## Use it from a training script"), "python")[0]
    assert client_script.splitlines() == script


def test_the_docs_map_is_the_package_docstring() -> None:
    doc = autotune.__doc__ or ""
    lines = doc.split("The map", 1)[1].split("\n", 1)[1].split("\n")
    drawn = []
    for line in lines[1:] if not lines[0].strip() else lines:
        if line and not line.startswith("    "):
            break
        drawn.append(line)
    docstring_map = textwrap.dedent("\n".join(drawn)).strip("\n")
    (docs_map,) = blocks(section(DOCS / "README.md", "## The map"), "")
    assert docs_map.strip("\n") == docstring_map


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, re.MULTILINE)}


def test_every_relative_link_resolves() -> None:
    missing = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            if not path.exists():
                if path not in PENDING:
                    missing.append(f"{page.name}: {target}")
                continue
            if anchor and path.suffix == ".md" and anchor not in anchors(path):
                missing.append(f"{page.name}: {target} (no such heading)")
    assert not missing


def resolves(dotted: str) -> bool:
    """``pkg.module[.name]``: a package or module of the tree, and at most one name defined in it."""
    parts = dotted.split(".")
    where = ROOTS[parts[0]]
    rest = parts[1:]
    while rest and ((where / rest[0]).is_dir() or (where / f"{rest[0]}.py").exists()):
        where = where / rest[0] if (where / rest[0]).is_dir() else where / f"{rest[0]}.py"
        rest = rest[1:]
    if not rest:
        return True
    if len(rest) > 1:
        return False
    source = (where / "__init__.py" if where.is_dir() else where).read_text()
    name = re.escape(rest[0])
    defined = rf"^\s*(def|class) {name}\b|^{name}\s*[:=]|\bimport .*\b{name}\b|^\s+{name},$|\"{name}\""
    return bool(re.search(defined, source, re.MULTILINE))


def test_every_module_path_names_something_in_the_tree() -> None:
    stale = []
    for page in PAGES:
        text = page.read_text()
        for dotted in set(re.findall(r"(?<![\w/.])autotune(?:_server|_client)?(?:\.[A-Za-z_]\w*)+", text)):
            if not resolves(dotted):
                stale.append(f"{page.name}: {dotted}")
        for path in set(re.findall(r"(?<![\w/.])((?:autotune|autotune_server|autotune_client)/[\w/.*]*)", text)):
            root, _, rest = path.partition("/")
            if not glob.glob(str(ROOTS[root] / rest)):
                stale.append(f"{page.name}: {path}")
        for path in set(re.findall(r"(?<![\w/.])((?:bench|tests|examples|scripts|docs)/[\w/.*-]*\w)", text)):
            if not glob.glob(str(REPO / path)) and (REPO / path) not in PENDING:
                stale.append(f"{page.name}: {path}")
    assert not stale
