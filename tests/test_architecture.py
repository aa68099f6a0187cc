"""The package's layering, proved from its source: the import graph is read with ``ast``
(nothing is imported), so a rule holds for every line, not only for the lines a test runs.

    plan          never imports the runtime
    transport     imports nothing from torch, torchdata or the rest of the package
    runtime/child/ and the shared runtime modules never import the main side
                  (runtime/main/, reading_service, explain), directly or through others
    the package   has no import cycle
    dataloader/   the class (loader.py) sits on top: no module of its package imports it

Imports under ``if TYPE_CHECKING:`` are left out (they never run); imports inside
functions count (they run when called). Each rule is also checked against a small made-up
graph that breaks it, so that a parser that saw nothing could not pass.

One test runs a fresh interpreter: the path to a loader's first item imports neither the
renderer nor the statistics report.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

import mprs_plus

PACKAGE = "mprs_plus"
ROOT = Path(mprs_plus.__file__).resolve().parent

MAIN_SIDE = ("mprs_plus.runtime.main", "mprs_plus.reading_service", "mprs_plus.explain")
NOT_IN_TRANSPORT = ("torch", "torchdata")

Graph = dict[str, set[str]]  # module -> what it imports (package modules by full name, others by top name)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(nodes: Iterable[ast.AST]) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement in ``nodes`` and below, except in ``if TYPE_CHECKING:`` bodies."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _import_nodes(node.orelse)
        else:
            yield from _import_nodes(ast.iter_child_nodes(node))


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name if alias.name.startswith(PACKAGE + ".") or alias.name == PACKAGE else alias.name.split(".")[0]
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    if not (target == PACKAGE or target.startswith(PACKAGE + ".")):
        yield target.split(".")[0]
        return
    for alias in node.names:
        submodule = f"{target}.{alias.name}"
        yield submodule if submodule in known else target


def package_graph() -> Graph:
    paths = sorted(ROOT.rglob("*.py"))
    known = {_module_name(p) for p in paths}
    graph: Graph = {}
    for path in paths:
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {t for n in _import_nodes(tree.body) for t in _resolve(module, is_package, n, known)} - {module}
    return graph


def _within(module: str, prefixes: Iterable[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _parents(module: str) -> list[str]:
    """The packages Python runs before ``module``: importing a.b.c runs a, then a.b."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def reached(graph: Graph, start: str) -> dict[str, str]:
    """Every package module that importing ``start`` runs, each with the module that imports it."""
    seen: dict[str, str] = {}
    stack = [start]
    while stack:
        module = stack.pop()
        for target in [*graph.get(module, ()), *_parents(module)]:
            if target in graph and target not in seen and target != start:
                seen[target] = module
                stack.append(target)
    return seen


def _chain(seen: dict[str, str], start: str, end: str) -> str:
    steps = [end]
    while steps[-1] != start:
        steps.append(seen[steps[-1]])
    return " -> ".join(reversed(steps))


def forbidden_reaches(graph: Graph, modules: Iterable[str], forbidden: Iterable[str]) -> list[str]:
    """For each of ``modules`` that runs a module within ``forbidden``, the import chain."""
    forbidden = tuple(forbidden)
    found = []
    for module in modules:
        seen = reached(graph, module)
        found += [_chain(seen, module, target) for target in sorted(seen) if _within(target, forbidden)]
    return found


def cycles(graph: Graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in sorted(graph[module]):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def child_and_shared(graph: Graph) -> list[str]:
    """Modules that run in a child: the runtime's, apart from its main side."""
    return [m for m in graph if _within(m, ["mprs_plus.runtime"]) and not _within(m, MAIN_SIDE)]


def transport_leaks(graph: Graph) -> list[str]:
    return [
        f"{module} imports {target}"
        for module in sorted(graph)
        if _within(module, ["mprs_plus.transport"])
        for target in sorted(graph[module])
        if target in NOT_IN_TRANSPORT or (_within(target, [PACKAGE]) and not _within(target, ["mprs_plus.transport"]))
    ]


@pytest.fixture(scope="module")
def graph() -> Graph:
    return package_graph()


def test_the_graph_is_read(graph: Graph) -> None:
    # A parser that found no imports would pass every rule below.
    assert "mprs_plus.runtime.child.worker" in graph["mprs_plus.runtime.main.service"]
    assert "mprs_plus.transport._wakeup" in graph["mprs_plus.transport.shm"]  # from . import _wakeup
    assert "mprs_plus.explain" in graph["mprs_plus.plan"]  # inside a method
    assert "mprs_plus.plan" not in graph["mprs_plus.explain"]  # only under TYPE_CHECKING
    assert len(child_and_shared(graph)) > 10


def test_child_code_never_imports_the_main_side(graph: Graph) -> None:
    assert forbidden_reaches(graph, child_and_shared(graph), MAIN_SIDE) == []


def test_plan_never_imports_the_runtime(graph: Graph) -> None:
    assert forbidden_reaches(graph, ["mprs_plus.plan"], ["mprs_plus.runtime", "mprs_plus.reading_service"]) == []


def test_transport_imports_nothing_from_torch_or_the_package(graph: Graph) -> None:
    assert transport_leaks(graph) == []


def test_no_import_cycle(graph: Graph) -> None:
    assert cycles(graph) == []


def importers_of(target: str, within: str) -> set[str]:
    """The modules under ``within`` whose source imports ``target``, under
    ``if TYPE_CHECKING:`` too: a type named there is a reach all the same."""
    paths = sorted((ROOT.parent / within.replace(".", "/")).rglob("*.py"))
    known = {_module_name(p) for p in ROOT.rglob("*.py")}
    found = set()
    for path in paths:
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
        if any(target in _resolve(module, path.name == "__init__.py", n, known) for n in nodes):
            found.add(module)
    return found


def test_the_dataloader_class_sits_on_top_of_its_epochs() -> None:
    """``mprs_plus.DataLoader`` (loader.py) uses the epoch (iterator.py), the workers'
    runtime, the stage and the states; none of them reaches back into the class. Only the
    package's ``__init__`` imports it (which also proves the parser saw that import)."""
    assert importers_of("mprs_plus.dataloader.loader", "mprs_plus.dataloader") == {"mprs_plus.dataloader"}


def test_each_rule_catches_a_graph_that_breaks_it() -> None:
    bad: Graph = {
        "mprs_plus": set(),
        "mprs_plus.plan": {"mprs_plus.graph"},
        "mprs_plus.graph": {"mprs_plus.runtime.segments"},
        "mprs_plus.runtime": set(),
        "mprs_plus.runtime.segments": {"mprs_plus.explain"},
        "mprs_plus.runtime.child": set(),
        "mprs_plus.runtime.child.worker": {"mprs_plus.runtime.mux"},
        "mprs_plus.runtime.mux": {"mprs_plus.runtime.main.gate"},
        "mprs_plus.runtime.main": set(),
        "mprs_plus.runtime.main.gate": {"mprs_plus.runtime.child.worker"},
        "mprs_plus.explain": {"mprs_plus.plan"},
        "mprs_plus.transport": {"torch", "mprs_plus.errors"},
        "mprs_plus.errors": set(),
    }
    assert "mprs_plus.runtime.child.worker -> mprs_plus.runtime.mux -> mprs_plus.runtime.main.gate" in (
        forbidden_reaches(bad, child_and_shared(bad), MAIN_SIDE)
    )
    assert forbidden_reaches(bad, ["mprs_plus.plan"], ["mprs_plus.runtime"])
    assert transport_leaks(bad) == ["mprs_plus.transport imports mprs_plus.errors", "mprs_plus.transport imports torch"]
    assert sorted(map(len, cycles(bad))) == [3, 4]


def test_a_child_module_is_reached_through_its_parent_packages() -> None:
    # Importing mprs_plus.runtime.child.worker runs mprs_plus/runtime/__init__.py first.
    graph: Graph = {
        "mprs_plus": set(),
        "mprs_plus.runtime": {"mprs_plus.runtime.main.service"},
        "mprs_plus.runtime.child": set(),
        "mprs_plus.runtime.child.worker": set(),
        "mprs_plus.runtime.main": set(),
        "mprs_plus.runtime.main.service": set(),
    }
    assert forbidden_reaches(graph, ["mprs_plus.runtime.child.worker"], MAIN_SIDE)


FIRST_ITEM = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("ignore")
    from torchdata.dataloader2 import DataLoader2
    from torchdata.datapipes.iter import IterableWrapper
    import mprs_plus

    pipe = IterableWrapper(range(10)).sharding_filter()
    loader = DataLoader2(pipe, reading_service=mprs_plus.MultiProcessingReadingService(num_workers=1))
    assert next(iter(loader)) == 0
    loaded = sorted(sys.modules)
    loader.shutdown()
    print(" ".join(loaded))
    """
)

NOT_ON_THE_FIRST_ITEM_PATH = ("mprs_plus.explain", "mprs_plus.stats", "mprs_plus._cli", "graphviz", "psutil")


@pytest.mark.timeout(180)
def test_the_first_item_imports_only_what_it_needs() -> None:
    done = subprocess.run(
        [sys.executable, "-c", FIRST_ITEM], capture_output=True, text=True, timeout=150, cwd=ROOT.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = done.stdout.split()
    assert "mprs_plus.runtime.main.service" in loaded  # the service did run
    assert [m for m in loaded if _within(m, NOT_ON_THE_FIRST_ITEM_PATH)] == []


def _runtime_map(text: str) -> set[str]:
    """The modules the map in ``runtime/__init__.py`` lists, by path from ``runtime/``: a
    room's heading ("main/", "child/", "(here)") starts a list of its files."""
    listed, room = set(), None
    for line in text.splitlines():
        words = line.split()
        if line.startswith("    ") and not line.startswith("      ") and words:
            room = "" if words[0] == "(here)" else words[0]
            words = words[1:]
        if room is not None and words and words[0].endswith(".py"):
            listed.add(room + words[0])
    return listed


def test_the_runtime_map_names_every_runtime_module_in_its_room() -> None:
    """The map in ``runtime/__init__.py`` is how a reader finds which process runs a module:
    a module missing from it, or listed in another room, sends the reader astray."""
    runtime = ROOT / "runtime"
    modules = {p.relative_to(runtime).as_posix() for p in runtime.rglob("*.py") if p.name != "__init__.py"}
    listed = _runtime_map((runtime / "__init__.py").read_text())
    assert {"main/service.py", "child/worker.py", "mux.py"} <= listed  # the map is read
    assert modules == listed, {"not in the map": modules - listed, "no such module": listed - modules}
