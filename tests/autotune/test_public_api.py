"""Every public module of autotune declares __all__, and every name in it exists."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
import autotune_client

ROOT = Path(autotune.__file__).parent
# The client package lives beside autotune/ (client/autotune_client); the layering covers it too.
CLIENT_ROOT = Path(autotune_client.__file__).parent
ROOTS = {"autotune": ROOT, "autotune_client": CLIENT_ROOT}
PUBLIC_MODULES = [
    "autotune",
    "autotune.tasks.load",
    "autotune.core.allocator",
    "autotune.core.capacity",
    "autotune.core.cards",
    "autotune.loop.sampler",
    "autotune.orchestrate.card_estimate",
    "autotune.orchestrate.estimated",
    "autotune.search.reserved",
    "autotune.emulation",
    "autotune.core.schemas",
    "autotune.core.plan",
    "autotune.core.split",
    "autotune.core.policy_names",
    "autotune.core.files",
    "autotune.search.diagnose",
    "autotune.search.boundary",
    "autotune.tasks.task",
    "autotune.tasks.fingerprint",
    "autotune.measure.meters",
    "autotune.measure.meters.base",
    "autotune.measure.meters.cpu",
    "autotune.measure.meters.cuda",
    "autotune.measure.trial",
    "autotune.orchestrate.probe",
    "autotune.loop.accumulate",
    "autotune.loop.verify",
    "autotune.core.errors",
    "autotune.measure.oom",
    "autotune.core.units",
    "autotune.cli.report",
    "autotune.cli",
    "autotune.cli.common",
    "autotune.cli.parser",
    "autotune.cli.probe",
    "autotune.cli.service",
    "autotune.cli.store",
    "autotune.cli.client_commands",
    "autotune.cli.fleet",
    "autotune.fleet",
    "autotune.fleet.pairs",
    "autotune.fleet.worker",
    "autotune.fleet.progress",
    "autotune.fleet.sink",
    "autotune.fleet.runner",
    "autotune.measure.policies",
    "autotune.core.recommend",
    "autotune.measure.throughput",
    "autotune.cli.policies",
]


@pytest.mark.parametrize("name", PUBLIC_MODULES)
def test_all_is_declared_and_resolves(name: str) -> None:
    module = importlib.import_module(name)
    exported = getattr(module, "__all__", None)
    assert exported, f"{name} has no __all__"
    missing = [symbol for symbol in exported if not hasattr(module, symbol)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"


def test_each_public_name_is_exported_by_its_home_module() -> None:
    """``from autotune import X`` is the surface users' task files import (docs/design.md, "The public
    surface"); each X stays in the ``__all__`` of the module that defines it, so a move of that module is
    one line of ``_PUBLIC``, not a break in users' files."""
    homes = autotune._PUBLIC
    assert set(autotune.__all__) == {"__version__", *homes}
    assert {"ProbeTask", "Accumulator", "PlanBatchSampler", "probe", "estimate", "with_options"} <= set(homes)
    stray = {name: home for name, home in homes.items() if name not in importlib.import_module(home).__all__}
    assert stray == {}


def test_importing_the_package_does_not_import_torch() -> None:
    code = (
        "import sys, autotune, autotune.core.schemas, autotune.core.plan, autotune.core.units; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_nothing_but_the_fleet_command_imports_ray() -> None:
    """Ray is the fleet extra's: the package, the parser of every command (fleet's included) and the
    fleet's own modules import it only when `autotune fleet` runs."""
    code = (
        "import sys, autotune, autotune.cli, autotune.fleet, autotune_client; "
        "autotune.cli.build_parser(); print('ray' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def _autotune_imports(path: Path, *, lazy: bool) -> set[str]:
    """The autotune and autotune_client modules a file imports at module level, and inside functions too when ``lazy``
    (imports under ``if TYPE_CHECKING:`` are for the type checker alone and left out)."""
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found: set[str] = set()
    for node in ast.walk(tree) if lazy else tree.body:
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ROOTS:
            # `from autotune.cli import probe` imports the submodule autotune.cli.probe, not only the package.
            package = ROOTS[node.module.split(".")[0]].parent / node.module.replace(".", "/")
            subs = {a.name for a in node.names if (package / f"{a.name}.py").is_file() or (package / a.name).is_dir()}
            found |= {f"{node.module}.{name}" for name in subs}
            if len(subs) < len(node.names):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.split(".")[0] in ROOTS}
    return found


def _module_graph(*, lazy: bool) -> dict[str, set[str]]:
    """Every module of autotune and of autotune_client -> the modules of either that it imports."""
    graph: dict[str, set[str]] = {}
    for root in ROOTS.values():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root.parent).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            graph[name] = _autotune_imports(path, lazy=lazy)
    return graph


# The floors of autotune (autotune/__init__.py draws them): a package imports its own floor and those below.
# docs/design.md, "The floors and the map": the fleet below the CLI (it imports no CLI module).
FLOORS = {
    "core": 0,
    "tasks": 1,
    "measure": 2,
    "loop": 2,
    "search": 3,
    "emulation": 3,
    "orchestrate": 4,
    "fleet": 6,
    "cli": 7,
}
# autotune_client, beside autotune/, sits between them: it imports autotune.core at import and, lazily for the
# local probe, tasks, measure and orchestrate; the fleet (the sink's uploads) and the CLI's commands
# (autotune/cli/client_commands.py) import it.
CLIENT_FLOOR = 5


def _floor(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "autotune_client":
        return CLIENT_FLOOR
    return FLOORS.get(parts[1]) if len(parts) > 1 else None


def test_arrows_point_down_only() -> None:
    """No module imports a package on a floor above its own, lazily or not (the top package's lazy
    public names excepted: they are what the floors offer, not what they use)."""
    upward = sorted(
        (module, imported)
        for module, imports in _module_graph(lazy=True).items()
        for imported in imports
        if module != "autotune"
        and imported != "autotune"
        and (mine := _floor(module)) is not None
        and (theirs := _floor(imported)) is not None
        and theirs > mine
    )
    assert upward == []
    entries = {p.stem for p in Path(autotune.__file__).parent.iterdir() if p.name != "__pycache__"}
    assert entries == set(FLOORS) | {"__init__"}
    assert len(FLOORS) + 1 <= 12  # at most 12 entries at the top of autotune/


def test_the_client_and_autotune_meet_only_where_the_floors_say() -> None:
    """autotune_client imports no module of the CLI or the fleet (its command code is autotune.cli's,
    autotune/cli/client_commands.py: it once lived in the client package, a circle with the CLI),
    and of autotune only the CLI and the fleet import the client."""
    graph = _module_graph(lazy=True)
    client_up = sorted(
        (module, imported)
        for module, imports in graph.items()
        if module.split(".")[0] == "autotune_client"
        for imported in imports
        if imported.startswith(("autotune.cli", "autotune.fleet"))
    )
    assert client_up == []
    client_users = {
        module
        for module, imports in graph.items()
        if module.split(".")[0] == "autotune" and any(i.split(".")[0] == "autotune_client" for i in imports)
    }
    assert client_users, "no autotune module imports autotune_client: the check reads nothing"
    assert {m for m in client_users if _floor(m) not in (FLOORS["cli"], FLOORS["fleet"])} == set()
    assert "autotune.cli.client_commands" in client_users


def test_the_torch_free_floor_imports_only_itself() -> None:
    core = {m: imports for m, imports in _module_graph(lazy=True).items() if m.startswith("autotune.core")}
    assert core, "no autotune.core modules found"
    assert {m: sorted(i) for m, i in core.items() if any(not x.startswith("autotune.core") for x in i)} == {}


def test_no_circle_of_imports_at_run_time() -> None:
    """Lazy imports included: two modules that import each other inside functions are a circle too."""
    graph = _module_graph(lazy=True)
    # Imports of a package resolve to its __init__; strongly connected components by Tarjan's algorithm.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in graph:
                continue
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    # The package's own lazy public names (autotune/__init__.py) point at every floor by design.
    assert [c for c in circles if "autotune" not in c] == []


def test_the_lower_floor_imports_nothing_above_it() -> None:
    """Each name has one home on the lower floor: the wire schemas import only the split arithmetic,
    which imports nothing of autotune (plan.py and schemas.py once imported each other), and the
    fleet writes files through autotune.core.files, not through a command module."""
    root = Path(autotune.__file__).parent
    # ... and the byte units (the headroom rule, Profile.limit_bytes), which import nothing of autotune either.
    # ... and the policy names' grammar (ActivationCheckpointing), which imports nothing of autotune either.
    # ... and the mesh (Profile.mesh, SuggestQuery.mesh), which imports only the errors, which import nothing.
    # ... and the losses' names' grammar (SuggestQuery.lm_loss), which imports nothing of autotune either.
    lower = {"autotune.core.split", "autotune.core.units", "autotune.core.policy_names"}
    lower |= {"autotune.core.mesh", "autotune.core.errors", "autotune.core.loss_names"}
    # ... and the composition table (SuggestQuery refuses what the CLI refuses), which imports only those.
    lower |= {"autotune.core.compositions"}
    table = _autotune_imports(root / "core" / "compositions.py", lazy=True)
    assert table <= {"autotune.core.mesh", "autotune.core.errors", "autotune.core.loss_names"}
    assert _autotune_imports(root / "core" / "schemas.py", lazy=True) <= lower
    assert _autotune_imports(root / "core" / "mesh.py", lazy=True) == {"autotune.core.errors"}
    assert _autotune_imports(root / "core" / "errors.py", lazy=True) == set()
    assert _autotune_imports(root / "core" / "policy_names.py", lazy=True) == set()
    assert _autotune_imports(root / "core" / "loss_names.py", lazy=True) == set()
    assert _autotune_imports(root / "core" / "units.py", lazy=True) == set()
    assert _autotune_imports(root / "core" / "split.py", lazy=True) == set()
    assert _autotune_imports(root / "core" / "files.py", lazy=True) == set()
    assert not any(m.startswith("autotune.cli") for m in _autotune_imports(root / "fleet" / "sink.py", lazy=True))


def test_no_two_modules_import_each_other_at_module_level() -> None:
    graph = _module_graph(lazy=False)
    pairs = sorted(
        (a, b)
        for a, imports in graph.items()
        for b in imports
        if a < b and a in graph.get(b, set()) and not b.startswith(a + ".") and not a.startswith(b + ".")
    )
    assert pairs == []
