"""The package's import graph has no cycles, and no module is over the size a reader can hold.

The graph is read from the sources with :mod:`ast` (nothing is imported): a
node per module of ``capsulefs`` (``capsulefs/``, ``core/`` as
``capsulefs.core``, ``mount/`` as ``capsulefs.mount``: ``package_kit.modules``), an edge from a module
to each module of the package it imports. ``from pkg import name`` is an edge
to ``pkg.name`` when that is a module, else to ``pkg``; an import of a module
is an edge to that module only, not to the packages above it.

What counts as an import:
  * every import statement a module runs, at module level or inside a
    function or method: a function-level ("lazy") import is still one module
    needing the other, and a lazy import that only dodges a cycle at load time
    is the cycle this test is here to find. Lazy imports that only defer an
    expensive or optional dependency (the CLI's commands, numpy, the fleet
    clients) never form a cycle and are not affected.
  * not the imports under ``if TYPE_CHECKING:``: they never run, and they are
    how a module names another's types in annotations.
  * not ``importlib.import_module`` with a string (the CLI's command table).
"""

from __future__ import annotations

import ast
from pathlib import Path

from package_kit import modules

Graph = dict[str, set[str]]


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module ``name`` (at ``path``) imports."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str | None] = set()
    stack: list[ast.AST] = [ast.parse(path.read_text(), filename=str(path))]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            targets.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "capsulefs")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            if source.split(".")[0] == "capsulefs":
                targets.update(resolve(f"{source}.{a.name}") for a in node.names)
        stack.extend(ast.iter_child_nodes(node))
    return {t for t in targets if t and t != name}


def import_graph() -> Graph:
    known = modules()
    return {name: _imported(name, path, known) for name, path in known.items()}


def cycles(graph: Graph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module
    (Tarjan's algorithm, without recursion), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_cycles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d", "f"}, "f": {"e"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e", "f"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_each_kind_of_import() -> None:
    graph = import_graph()
    assert len(graph) > 100
    # a relative import of a module, one of a name, and an absolute one
    assert "capsulefs.core.journal.lines" in graph["capsulefs.core.journal.envelope_index"]
    assert "capsulefs.core.errors" in graph["capsulefs.core.journal.lines"]
    assert "capsulefs.core.move" in graph["capsulefs.move.source"]
    # a function-level import (the CLI imports its daemon when a command runs)
    assert any(t.startswith("capsulefs.daemon") for t in graph["capsulefs.cli.mount_cmds"])


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph()
    found = cycles(graph)
    described = [{m: sorted(graph[m] & set(c)) for m in c} for c in found]
    assert described == [], "import cycles (each module with what it imports of its cycle)"


#: Issue 29's size rule: a module says one thing a reader can hold in mind
#: ("no module over about 500 lines"); past this, split it along its concerns.
MAX_MODULE_LINES = 560


def test_no_module_is_over_the_size_a_reader_can_hold() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    assert {n: s for n, s in sizes.items() if s > MAX_MODULE_LINES} == {}
