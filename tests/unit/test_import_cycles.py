"""No import cycles among `rollart`'s modules (docs/architecture.md): each module can be read and loaded after the
modules it imports, and never half-initialised by one of them.

The graph has an edge from a module to every `rollart` module it imports when it is itself imported: imports at module
level and in class bodies, inside top-level `if`/`try` blocks too, and the packages above each imported module (Python
runs their `__init__` first), except the packages that hold the importer (a package's `__init__` importing its own
modules, which import their siblings, is no cycle: the package is being imported already; a module importing a name from
its own package's `__init__` is an edge like any other). Two kinds of import are left out, since they run later or
never: imports inside functions, and imports under `if TYPE_CHECKING:`. Those may close a cycle only where
`DEFERRED_CYCLES` names the edge with the reason it has to be deferred; any other cycle fails the test.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "rollart"

DEFERRED_CYCLES: dict[tuple[str, str], str] = {
    ("rollart.envs.registry", "rollart.tasks"): (
        "the built-in tasks register as a user's env module does, by being imported, and they import the env API: "
        "the registry imports them at its first use"
    ),
    # Names for the type checker only (`if TYPE_CHECKING:`): a module whose functions take an object of the module
    # that imports it. Never run, so never half-initialised.
    ("rollart.protocol.tls", "rollart.protocol.framing"): "TLS wraps the framing's TcpConnection, which dials with TLS",
    (
        "rollart.envexec.process_runner",
        "rollart.envexec.pool",
    ): "a worker env's runner submits to the pool that made it",
    ("rollart.topology.checks", "rollart.topology"): "the topology's checks take the Topology they check",
    ("rollart.topology.exposure", "rollart.topology"): "the topology's checks take the Topology they check",
    ("rollart.topology.gpus", "rollart.topology"): "the topology's checks take the Topology they check",
    ("rollart.topology.trainers", "rollart.topology"): "the topology's checks take the Topology they check",
    ("rollart.nodes.admin", "rollart.nodes.base"): "the admin endpoint serves the NodeDaemon that starts it",
    ("rollart.nodes.metrics", "rollart.nodes.base"): "the metrics collector reads the NodeDaemon that registers it",
    ("rollart.launch.terminal", "rollart.launch.local"): "the terminal draws the launcher's NodeProcess states",
    ("rollart.launch.slurm_hosts", "rollart.launch.slurm"): "host placement fills in the Slurm script's Placement",
}
"""(importer, imported) -> why that deferred import closes a cycle."""


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    deferred: bool
    """Inside a function or under `if TYPE_CHECKING:`: it runs later, or only for the type checker."""


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST, deferred: bool) -> list[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import under `node`, with whether it is deferred (in a function, or for the type checker)."""
    found: list[tuple[ast.Import | ast.ImportFrom, bool]] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append((child, deferred))
        elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            found += _imports(child, True)
        elif isinstance(child, ast.If) and _is_type_checking(child.test):
            for statement in child.body:
                found += _imports(ast.Module(body=[statement], type_ignores=[]), True)
            for statement in child.orelse:
                found += _imports(ast.Module(body=[statement], type_ignores=[]), deferred)
        else:
            found += _imports(child, deferred)
    return found


def edges_of(module: str, path: Path, modules: dict[str, Path]) -> list[Edge]:
    """The `rollart` modules `module` imports, each with its parent packages."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node, deferred in _imports(ast.parse(path.read_text(), filename=str(path)), False):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            submodules = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules]
            names = len(submodules) < len(node.names)  # names defined in `source` itself, not only its modules
            targets = [*([source] if names or not module.startswith(source + ".") else []), *submodules]
        for target in targets:
            parts = target.split(".")
            for depth in range(1, len(parts) + 1):  # a module's packages are imported before it...
                name = ".".join(parts[:depth])
                inside = module.startswith(name + ".")  # ...but those holding the importer are under way already
                if name in modules and name != module and (name == target or not inside):
                    edges.append(Edge(module, name, node.lineno, deferred))
    return edges


def graph(root: Path) -> dict[str, list[Edge]]:
    modules = module_names(root)
    return {module: edges_of(module, path, modules) for module, path in modules.items()}


def components(edges: dict[str, list[Edge]], *, include_deferred: bool) -> list[set[str]]:
    """The strongly connected components of the graph (Tarjan's algorithm, iterative: the package is deep enough to
    pass the recursion limit), those with a cycle only: more than one module, or one that imports itself."""
    out = {m: [e.imported for e in es if include_deferred or not e.deferred] for m, es in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start, imports in out.items():
        if start in index:
            continue
        enter(start)
        work = [(start, iter(imports))]
        while work:
            node, children = work[-1]
            target = next(children, None)
            if target is not None:
                if target not in index:
                    enter(target)
                    work.append((target, iter(out[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while (member := stack.pop()) != node:
                    on_stack.discard(member)
                    component.add(member)
                on_stack.discard(node)
                component.add(node)
                if len(component) > 1 or node in out[node]:
                    found.append(component)
    return found


def path(
    edges: dict[str, list[Edge]], start: str, goal: str, within: set[str], *, include_deferred: bool
) -> list[Edge]:
    """The shortest chain of imports from `start` to `goal` inside `within` (breadth-first)."""
    paths: dict[str, list[Edge]] = {start: []}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for edge in edges[node]:
            if (edge.deferred and not include_deferred) or edge.imported not in within:
                continue
            if edge.imported == goal:
                return [*paths[node], edge]
            if edge.imported not in paths:
                paths[edge.imported] = [*paths[node], edge]
                queue.append(edge.imported)
    raise AssertionError(f"no path from {start} to {goal}")


def describe(cycle: list[Edge]) -> str:
    hops = [f"{e.importer}:{e.line}{' (deferred)' if e.deferred else ''}" for e in cycle]
    return " -> ".join([*hops, cycle[0].importer])


def unexcused(edges: dict[str, list[Edge]]) -> list[str]:
    """Every cycle of imports that run when a module is imported, and every deferred import that closes a cycle
    (its module is reachable back from what it imports) unless `DEFERRED_CYCLES` lists it."""
    problems = []
    for component in components(edges, include_deferred=False):
        start = min(component)
        problems.append(f"import cycle: {describe(path(edges, start, start, component, include_deferred=False))}")
    for component in components(edges, include_deferred=True):
        for module in sorted(component):
            for edge in edges[module]:
                if edge.deferred and edge.imported in component and (module, edge.imported) not in DEFERRED_CYCLES:
                    back = path(edges, edge.imported, module, component, include_deferred=True)
                    cycle = describe([edge, *back])
                    problems.append(f"import cycle closed by a deferred import not in DEFERRED_CYCLES: {cycle}")
    return problems


def test_import_cycles_none_among_rollart_modules() -> None:
    problems = unexcused(graph(ROOT))
    assert not problems, "\n".join(problems)


def test_import_cycle_check_finds_planted_cycles(tmp_path: Path) -> None:
    """Two modules importing each other at module level, and a cycle a function's import closes, in a copy of the
    package: both are found; listing the deferred edge in `DEFERRED_CYCLES` excuses only the second."""
    package = tmp_path / PACKAGE
    package.mkdir()
    (package / "__init__.py").write_text('"""root"""\n')
    (package / "a.py").write_text("from rollart import b\n")
    (package / "b.py").write_text("from rollart.a import thing\n")
    (package / "c.py").write_text("from rollart import d\n")
    (package / "d.py").write_text("def later():\n    from rollart import c\n")
    (package / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rollart import e2\n")
    (package / "e2.py").write_text("from rollart import e\n")
    problems = unexcused(graph(tmp_path))
    assert problems == [
        "import cycle: rollart.a:1 -> rollart.b:1 -> rollart.a",
        "import cycle closed by a deferred import not in DEFERRED_CYCLES: "
        "rollart.d:2 (deferred) -> rollart.c:1 -> rollart.d",
        "import cycle closed by a deferred import not in DEFERRED_CYCLES: "
        "rollart.e:3 (deferred) -> rollart.e2:1 -> rollart.e",
    ]
    DEFERRED_CYCLES[("rollart.d", "rollart.c")] = "a planted reason"
    try:
        assert len(unexcused(graph(tmp_path))) == 2
    finally:
        del DEFERRED_CYCLES[("rollart.d", "rollart.c")]


def test_import_cycle_exceptions_each_name_a_deferred_import_that_closes_one() -> None:
    """`DEFERRED_CYCLES` holds no stale entry: each is a deferred import that still closes a cycle."""
    edges = graph(ROOT)
    cyclic = {m: c for c in components(edges, include_deferred=True) for m in c}
    for importer, imported in DEFERRED_CYCLES:
        deferred = [e for e in edges.get(importer, []) if e.imported == imported and e.deferred]
        assert deferred, f"{importer} has no deferred import of {imported}: remove it from DEFERRED_CYCLES"
        assert cyclic.get(importer) is not None and imported in cyclic[importer], (
            f"{importer} -> {imported} closes no cycle any more: remove it from DEFERRED_CYCLES"
        )
