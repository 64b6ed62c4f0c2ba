"""The application's imports form no cycle, counting every import a reader sees.

import-linter (``lint-imports``, in .ci/run and tox) checks the layers of ``setup.cfg``;
this checks the whole graph for cycles, which no import-linter contract covers. grimp
(import-linter's graph) counts imports under ``TYPE_CHECKING`` and inside functions too:
a cycle the interpreter does not see is still one for a reader.
"""

from __future__ import annotations

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def _chain(graph: grimp.ImportGraph, component: list[str]) -> list[str]:
    """Each import within ``component``, as ``importer -> imported (line)``."""
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"{importer} -> {imported} (line {detail['line_number']})")
    return lines


def test_no_import_cycle_among_application_modules() -> None:
    graph = grimp.build_graph("plugserve", include_external_packages=False)
    assert len(graph.modules) > 100  # the whole application, not an empty walk
    cycles = _cycles(graph)
    assert not cycles, "\n\n".join("\n".join(_chain(graph, c)) for c in cycles)


def test_a_cycle_is_found() -> None:
    """The check itself: a cycle of three modules, one import under ``TYPE_CHECKING``."""
    graph = grimp.ImportGraph()
    for module in ("p", "p.a", "p.b", "p.c", "p.d"):
        graph.add_module(module)
    graph.add_import(importer="p.a", imported="p.b")
    graph.add_import(importer="p.b", imported="p.c")
    graph.add_import(importer="p.c", imported="p.a")
    graph.add_import(importer="p.d", imported="p.a")
    assert _cycles(graph) == [["p.a", "p.b", "p.c"]]
