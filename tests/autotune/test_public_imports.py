"""The docs and the examples import only the public surface, so internal modules may move freely.

A user's task file is written the way the pages and ``examples/`` show it. When those import
``autotune.tasks.task`` or ``autotune.loop.accumulate``, every internal move breaks the user's file (the
fourth wave's move did). So every ```python block of README.md and docs/*.md, and every examples/*.py,
may import only the public modules (``autotune``, ``autotune_client``, ``autotune_client.integrations``
and its trainer modules), and only names those modules export (their ``__all__``).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

import autotune
import autotune_client

REPO = Path(__file__).resolve().parents[2]
INTEGRATIONS = REPO / "client" / "autotune_client" / "integrations"
PROJECT_PACKAGES = {"autotune", "autotune_client", "autotune_server"}


def _declared_all(path: Path) -> list[str]:
    """A module's literal ``__all__``, read without importing it (the trainer modules import their trainers)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign):
            targets, value = [node.target], node.value
        else:
            continue
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets) and value is not None:
            return list(ast.literal_eval(value))
    raise AssertionError(f"{path} declares no literal __all__")


# Public module -> the names it exports.
PUBLIC: dict[str, set[str]] = {
    "autotune": set(autotune.__all__),
    "autotune_client": set(autotune_client.__all__),
    "autotune_client.integrations": {"lightning", "transformers"},
    "autotune_client.integrations.lightning": set(_declared_all(INTEGRATIONS / "lightning.py")),
    "autotune_client.integrations.transformers": set(_declared_all(INTEGRATIONS / "transformers.py")),
}


def _public_home(name: str) -> str | None:
    """The public module that exports ``name``, if any (the top packages first)."""
    return next((module for module, names in PUBLIC.items() if name in names), None)


def _python_blocks(page: Path) -> Iterator[tuple[int, str]]:
    """(line of the block's first line in the page, source) for every ```python block."""
    current: list[str] | None = None
    start = 0
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if current is None and line.startswith("```"):
            if line[3:].strip() in {"python", "py"}:
                current, start = [], number + 1
        elif current is not None and line.rstrip() == "```":
            yield start, "\n".join(current) + "\n"
            current = None
        elif current is not None:
            current.append(line)


def _sources() -> list[tuple[str, int, str]]:
    """(file relative to the repo, line offset, source) of every page block and every example."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    found = [(p.relative_to(REPO).as_posix(), start - 1, code) for p in pages for start, code in _python_blocks(p)]
    found += [(p.relative_to(REPO).as_posix(), 0, p.read_text()) for p in sorted((REPO / "examples").glob("*.py"))]
    return found


def _advice(names: list[str]) -> str:
    homes = {name: _public_home(name) for name in names}
    by_home: dict[str, list[str]] = {}
    for name, home in homes.items():
        if home:
            by_home.setdefault(home, []).append(name)
    public = [f"from {home} import {', '.join(found)}" for home, found in by_home.items()]
    missing = [name for name, home in homes.items() if not home]
    said = []
    if public:
        said.append("use " + "; ".join(public))
    if missing:
        said.append(f"{', '.join(missing)} not public yet: add to autotune/__init__.py's _PUBLIC")
    return "; ".join(said)


def private_imports(file: str, offset: int, code: str) -> list[str]:
    """One line per import of a non-public project module, or of a name a public module does not export."""
    try:
        tree = ast.parse(code)
    except SyntaxError as exc:
        return [f"{file}:{offset + (exc.lineno or 0)}: the block is not Python ({exc.msg})"]
    wrong: list[str] = []
    for node in ast.walk(tree):
        where = f"{file}:{offset + getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] not in PROJECT_PACKAGES:
                continue
            names = [alias.name for alias in node.names]
            if node.module not in PUBLIC:
                wrong.append(f"{where}: `from {node.module} import ...` is internal; {_advice(names)}")
            elif unknown := [n for n in names if n != "*" and n not in PUBLIC[node.module]]:
                wrong.append(f"{where}: {node.module} does not export {', '.join(unknown)}; {_advice(unknown)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PROJECT_PACKAGES and alias.name not in PUBLIC:
                    wrong.append(f"{where}: `import {alias.name}` is internal; import the names from autotune")
    return wrong


SOURCES = _sources()


def test_the_pages_and_examples_have_code_to_check() -> None:
    files = {file for file, _, _ in SOURCES}
    assert "examples/gpt.py" in files and "docs/accumulate.md" in files and "docs/client.md" in files


@pytest.mark.parametrize(("file", "offset", "code"), SOURCES, ids=[f"{f}:{o + 1}" for f, o, _ in SOURCES])
def test_imports_only_public_names(file: str, offset: int, code: str) -> None:
    wrong = private_imports(file, offset, code)
    assert not wrong, "\n".join(wrong)


def test_every_public_name_resolves() -> None:
    """What this test tells users to import exists: each public module imports and defines its names
    (the trainer modules are left to tests/client/test_integrations_public_api.py: they need their trainers)."""
    for module_name in ("autotune", "autotune_client"):
        module = importlib.import_module(module_name)
        assert [n for n in PUBLIC[module_name] if not hasattr(module, n)] == []


def test_the_check_names_file_line_and_public_name() -> None:
    """The checker itself: a deep import is caught with the line and the public name to use instead."""
    code = "import torch\n\nfrom autotune.loop.accumulate import Accumulator\nimport autotune.tasks.task\n"
    assert private_imports("docs/x.md", 10, code) == [
        "docs/x.md:13: `from autotune.loop.accumulate import ...` is internal; use from autotune import Accumulator",
        "docs/x.md:14: `import autotune.tasks.task` is internal; import the names from autotune",
    ]
    assert private_imports("x.py", 0, "from autotune import NotAThing\n") == [
        "x.py:1: autotune does not export NotAThing; NotAThing not public yet: add to autotune/__init__.py's _PUBLIC"
    ]
    assert private_imports("x.py", 0, "from autotune import ProbeTask\nfrom autotune_client import suggest\n") == []
