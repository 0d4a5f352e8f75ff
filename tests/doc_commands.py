"""Every command README.md and docs/*.md show, as a user would type it: found, set up, and checked without a trial.

A page's commands live in its shell blocks (fenced ``bash``/``console``/bare blocks, and blocks indented four
spaces): a statement is a line, its ``\\`` continuations and a here-document's lines; a ``$ `` prompt starts one
in an output block, and the lines after it up to the next prompt are what the page shows it printing (in a bare
block without prompts, the lines after an ``autotune`` command are its output). Each statement is

- ``autotune``: an ``autotune`` command (after ``NAME=value`` prefixes; what follows a shell operator, ``> file``,
  ``; echo $?``, ``&``, is the shell's, kept in ``after``);
- ``setup``: what makes the files and variables the commands after it need (``mkdir``, ``cat > FILE <<'EOF'``,
  ``export NAME=value``, ``NAME=value``, ``cd``): run as written, in the block's folder;
- ``other``: any other program (``make``, ``pip``, ``ray``, ``python``, ``openssl``): named, not run here (the
  scripts have their own tests; installing or starting a cluster is not a test's to do).

:func:`stop_before_trial` is the check mode of a command run in the test's process (``autotune.cli.main``):
everything up to the first trial runs as in a real command (the parser, the CLI's input checks, the task loaded, the
model's shape asked of the composition table, the config validated), and the command ends there
(:class:`StoppedBeforeTrial`). The boundary is the one every job path passes before its
first trial: ``ProbeConfig.applied_to`` (probe, estimate, a card's estimate, a run over lengths); and for the
commands without one, where their work would start: ``verify_cli``, the fleet's ``run_fleet`` (each pair's task
loaded first), the server's ``serve``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal
from unittest import mock

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# The CLI's commands: `autotune datasheet: ...` and `autotune: error: ...` are output, not commands.
COMMANDS = ("probe", "verify", "estimate", "gpus", "fleet", "recommend", "serve", "db", "suggest", "profiles")
_SHELL_LANGUAGES = ("", "bash", "sh", "shell", "console")
_SETUP_PROGRAMS = ("mkdir", "cat", "export", "cd")
_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_HEREDOC = re.compile(r"<<-?\s*'?\"?([A-Za-z_]+)'?\"?")
_OPERATORS = frozenset(";&|<>")

Kind = Literal["autotune", "setup", "other"]


@dataclass(frozen=True)
class Step:
    """One statement of a documented block (the module docstring says what each kind is)."""

    page: str
    line: int
    text: str
    kind: Kind
    # autotune: its arguments after ``autotune`` (variables as written), its NAME=value prefixes, and what the shell
    # does after it (``> estimate.json``, ``; echo $?``, ``&``).
    argv: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    after: str = ""
    # The lines the page shows the command printing ($ prompts, or a bare block's lines after the command).
    shown: tuple[str, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def arguments(self, env: dict[str, str]) -> list[str]:
        """argv with the shell's variables expanded from env, as bash would."""
        return [_expand(word, env) for word in self.argv]


@dataclass(frozen=True)
class Block:
    """One shell block of a page: its first line, language, the heading it sits under, and its statements."""

    page: str
    line: int
    language: str
    heading: str
    steps: tuple[Step, ...] = field(default_factory=tuple)


def documented_blocks(pages: list[Path] | None = None) -> list[Block]:
    """Every shell block of the pages that holds an ``autotune`` command, in page order."""
    found = []
    for page in pages or PAGES:
        for block in _blocks(page):
            if any(step.kind == "autotune" for step in block.steps):
                found.append(block)
    return found


def documented_commands(pages: list[Path] | None = None) -> list[Step]:
    """Every ``autotune`` command the pages show."""
    return [step for block in documented_blocks(pages) for step in block.steps if step.kind == "autotune"]


def _blocks(page: Path) -> Iterator[Block]:
    name = str(page.relative_to(REPO))
    lines = page.read_text().splitlines()
    heading = ""
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            heading = line
        if line.startswith("```"):
            language = line[3:].strip()
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), len(lines))
            if language in _SHELL_LANGUAGES:
                body = list(enumerate(lines[i + 1 : end], start=i + 2))
                steps = tuple(_statements(name, body, prompted=language != "bash"))
                yield Block(name, i + 1, language, heading, _with_output_block(steps, lines, end + 1))
            i = end + 1
            continue
        if line.startswith("    autotune ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and lines[end].startswith("    "):
                end += 1
            body = [(n, text[4:]) for n, text in enumerate(lines[i:end], start=i + 1)]
            yield Block(name, i + 1, "indented", heading, tuple(_statements(name, body, prompted=False)))
            i = end
            continue
        i += 1


def _with_output_block(steps: tuple[Step, ...], lines: list[str], after: int) -> tuple[Step, ...]:
    """A bash block's steps, its last ``autotune`` command given the lines of the bare block that follows it (the
    page's output of the block) as what it shows, where one follows and the command shows none of its own."""
    j = after
    while j < len(lines) and not lines[j].strip():
        j += 1
    commands = [k for k, step in enumerate(steps) if step.kind == "autotune"]
    if not commands or j >= len(lines) or lines[j].rstrip() != "```" or steps[commands[-1]].shown:
        return steps
    end = next((k for k in range(j + 1, len(lines)) if lines[k].rstrip() == "```"), len(lines))
    last = commands[-1]
    shown = dataclasses.replace(steps[last], shown=tuple(lines[j + 1 : end]))
    return (*steps[:last], shown, *steps[last + 1 :])


def _is_command(text: str) -> bool:
    words = text.split()
    while words and _ASSIGNMENT.match(words[0]):
        words = words[1:]
    return len(words) >= 2 and words[0] == "autotune" and words[1] in COMMANDS


def _statements(page: str, body: list[tuple[int, str]], *, prompted: bool) -> Iterator[Step]:
    """The statements of a block's lines (numbered); in an output block (prompted), the lines between them are
    the output the page shows."""
    has_prompts = prompted and any(text.startswith("$ ") for _, text in body)
    i = 0
    while i < len(body):
        number, text = body[i]
        if has_prompts:
            if not text.startswith("$ "):
                i += 1
                continue
            text = text[2:]
        elif prompted and not _is_command(text):  # a bare block: output lines between commands
            i += 1
            continue
        if not text.strip() or text.lstrip().startswith("#"):
            i += 1
            continue
        parts = [text]
        while parts[-1].rstrip().endswith("\\") and i + 1 < len(body):
            i += 1
            parts[-1] = parts[-1].rstrip()[:-1]
            parts.append(body[i][1])
        statement = " ".join(part.strip() for part in parts)
        heredoc = _HEREDOC.search(statement)
        if heredoc is not None:
            tag = heredoc.group(1)
            while i + 1 < len(body) and body[i + 1][1].strip() != tag:
                i += 1
                statement += "\n" + body[i][1]
            i += 1
            statement += "\n" + tag
        i += 1
        shown: list[str] = []
        if prompted:
            while i < len(body) and not (body[i][1].startswith("$ ") if has_prompts else _is_command(body[i][1])):
                shown.append(body[i][1])
                i += 1
        yield _step(page, number, statement, tuple(shown))


def _step(page: str, number: int, statement: str, shown: tuple[str, ...]) -> Step:
    if _HEREDOC.search(statement) or not _is_command(statement.split("\n", 1)[0]):
        words = statement.split("\n", 1)[0].split(" #", 1)[0].split()
        first = words[0] if words else ""
        assignment = bool(_ASSIGNMENT.match(first)) and len(words) == 1
        setup = (first in _SETUP_PROGRAMS or assignment) and "$(" not in statement
        return Step(page, number, statement, "setup" if setup else "other", shown=shown)
    lexer = shlex.shlex(statement, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    words = list(lexer)
    cut = next((k for k, word in enumerate(words) if word and set(word) <= _OPERATORS), len(words))
    command, after = words[:cut], " ".join(words[cut:])
    env = []
    while command and _ASSIGNMENT.match(command[0]):
        name, _, value = command.pop(0).partition("=")
        env.append((name, value))
    return Step(page, number, statement, "autotune", tuple(command[1:]), tuple(env), after, shown)


def _expand(word: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", lambda m: env.get(m.group(1), m.group(0)), word)


def run_setup(step: Step, folder: Path, env: dict[str, str]) -> None:
    """A setup statement in folder, as bash runs it; its assignments and exports into env (the commands after it
    see them as bash's would)."""
    import subprocess

    first = step.text.split()[0]
    if first == "export" or _ASSIGNMENT.match(first):
        name, _, value = step.text.removeprefix("export ").split("#", 1)[0].strip().partition("=")
        env[name] = _expand(shlex.split(value)[0] if value.strip() else "", env)
        return
    subprocess.run(["bash", "-e", "-c", step.text], cwd=folder, env=env, check=True, timeout=60)


class StoppedBeforeTrial(BaseException):
    """Where check mode ends a command: a BaseException, so that the CLI's own handler of errors lets it through."""


@contextlib.contextmanager
def stop_before_trial() -> Iterator[None]:
    """Check mode (the module docstring), for commands run in this process (``autotune.cli.main``): the boundaries
    where a command's work starts raise :class:`StoppedBeforeTrial`, everything before them having run as in a real
    command."""
    import autotune.fleet
    import autotune.loop.verify
    import autotune_server.runner
    from autotune.orchestrate.config import ProbeConfig

    checked = ProbeConfig.applied_to

    def applied_then_stop(self: ProbeConfig, task: Any) -> Any:
        checked(self, task)  # the config's refusals and the model's rows, as every job path asks them
        raise StoppedBeforeTrial

    def fleet_stop(pairs: list[Any], **_: Any) -> Any:
        from autotune.tasks.load import load_task

        for pair in pairs:  # each pair's task resolves as a worker loads it
            load_task(pair.spec)
        raise StoppedBeforeTrial

    def stop(*_: Any, **__: Any) -> Any:
        raise StoppedBeforeTrial

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(ProbeConfig, "applied_to", applied_then_stop))
        patches.enter_context(mock.patch.object(autotune.fleet, "run_fleet", fleet_stop))
        patches.enter_context(mock.patch.object(autotune.loop.verify, "verify_cli", stop))
        patches.enter_context(mock.patch.object(autotune_server.runner, "serve", stop))
        yield
