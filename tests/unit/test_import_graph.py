"""The import graph: no cycle among our modules, so each layer can be read on its own.

(``lint-imports`` holds the direction of the layers; this holds that, inside them,
no module needs another that needs it back — not even through a function-level import.)
"""

from __future__ import annotations

import sys

import pytest

grimp = pytest.importorskip("grimp")


def _cycles(graph: object, modules: set[str]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(module: str) -> None:
        index[module] = low[module] = counter[0]
        counter[0] += 1
        stack.append(module)
        on_stack.add(module)
        for imported in graph.find_modules_directly_imported_by(module):  # type: ignore[attr-defined]
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
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

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(modules):
        if module not in index:
            visit(module)
    return found


def test_no_module_of_ours_imports_one_that_imports_it_back():
    # An import under ``if TYPE_CHECKING:`` never runs: it names a type, it loads nothing.
    graph = grimp.build_graph("broker", "middleware", "periodic", "actors", exclude_type_checking_imports=True)
    assert _cycles(graph, set(graph.modules)) == []
