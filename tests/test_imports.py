"""The package's import graph has no circles, deferred imports included.

A circle closed by an import inside a function works only because of the order in which things are
called; it hides which module builds on which. Imports under ``if TYPE_CHECKING:`` are left out (they
never run), and importing ``a.b.c`` counts as importing the packages ``a`` and ``a.b`` too (Python runs
their ``__init__`` first).
"""

import ast
from pathlib import Path

import turbogrpo

PACKAGE = Path(turbogrpo.__file__).parent


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _runs(tree: ast.AST):
    """The import statements that can run: all but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (n for child in node.orelse for n in [child, *_runs(child)])
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _runs(node)


def _with_parents(name: str, modules) -> set[str]:
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules.keys()


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in _runs(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            else:
                names = []
            for imported in names:
                if imported.startswith("turbogrpo"):
                    targets |= _with_parents(imported, modules)
        # A module's own packages run before it; importing them is no circle.
        graph[name] = targets - _with_parents(name, modules)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, found = {}, {}, [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_circles():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_deferred_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
