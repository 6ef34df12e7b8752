"""The package's import graph has no circles, and the whole ``Config`` stops at the build.

Import circles: every ``import`` statement in a module counts, wherever it stands: at module level, inside
a function (a deferred import), and under ``if TYPE_CHECKING:``. A circle closed by a deferred import
works only because of the order in which things are called, and one closed by a type-only import works
only because annotations are not evaluated; either way it hides which module builds on which, and neither
module can be read (or type-checked) without the other. Importing ``a.b.c`` counts as importing the
packages ``a`` and ``a.b`` too (Python runs their ``__init__`` first).

The whole ``Config``: a function that takes it could depend on any setting, so only the few that turn a
config into a run's parts may (the CLI, ``train``, the build, the output folder's record of the inputs,
and config.py's own writer); every other function takes the settings or the section it reads.
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
    """Every import statement of a module: module-level, in functions and under ``if TYPE_CHECKING:``."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


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


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph of the package's folders and top-level modules (``turbogrpo.rollout`` stands for every
    module under it): an arrow between two of them is an import from any module of one to any of the other."""
    def unit(module: str) -> str:
        return ".".join(module.split(".")[:2])
    folders: dict[str, set[str]] = {unit(m): set() for m in graph}
    for module, targets in graph.items():
        folders[unit(module)] |= {unit(t) for t in targets if unit(t) not in (unit(module), "turbogrpo")}
    folders.pop("turbogrpo", None)  # the package's face (its __init__ hands the public names on)
    return folders


def test_no_folder_imports_one_that_imports_it():
    """Folders are layers: a lower one never imports a higher one. Read as floors (a folder above all it imports),
    an import that runs back up closes a circle between folders, which this finds (the rollout engines imported
    the draft heads that import the rollout; the draft commands and config.py imported train/)."""
    assert circles(folder_graph(import_graph())) == []


def script_graph(folder: Path) -> dict[str, set[str]]:
    """The import graph of the scripts of ``folder`` (bench/, scripts/): which script imports which, by the
    names they are imported by (``sys.path`` holds the folder)."""
    scripts = {path.stem: path for path in folder.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        imported = set()
        for node in _runs(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            imported |= {n.split(".")[0] for n in names} & scripts.keys()
        graph[name] = imported - {name}
    return graph


def test_the_benchmarks_and_scripts_have_no_import_circles():
    for folder in ("bench", "scripts"):
        assert circles(script_graph(PACKAGE.parent / folder)) == [], folder


def test_the_folder_graph_finds_a_circle_between_folders():
    graph = {"turbogrpo.rollout.engines": {"turbogrpo.speculative.profiler"}, "turbogrpo.rollout.step": set(),
             "turbogrpo.speculative.profiler": {"turbogrpo.rollout.step"}, "turbogrpo.config": {"turbogrpo.rollout"}}
    assert circles(folder_graph(graph)) == [["turbogrpo.rollout", "turbogrpo.speculative"]]


def test_the_circle_finder_finds_a_deferred_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_a_type_only_import_closes_a_circle_too():
    """The run.py <-> state.py circle was closed by an import under ``if TYPE_CHECKING:``: it counts."""
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from turbogrpo.train.run import Run\n"
    assert [node.module for node in _runs(ast.parse(source))] == ["typing", "turbogrpo.train.run"]
    deferred = "def f():\n    from turbogrpo.algo import LOSSES\n"
    assert [node.module for node in _runs(ast.parse(deferred))] == ["turbogrpo.algo"]


# --- the whole Config ----------------------------------------------------------------------------------

# The functions that may take the whole Config, each with its reason.
TAKES_THE_WHOLE_CONFIG = {
    "turbogrpo.cli._train",                  # the CLI: `turbogrpo train | demo` hands a loaded config to train
    "turbogrpo.train.loop.train",            # the public entry point: runs the loop around the built parts
    "turbogrpo.train.run.build_run",         # the build: each part from its own section, once
    "turbogrpo.train.output_dir.run_record",  # the output folder's record of the inputs (config.json, inputs.json)
    "turbogrpo.config.dump_config",          # config.py's own writer of a whole config (public API)
}


def _is_config(annotation: ast.expr | None) -> bool:
    """An annotation naming the whole ``Config`` (``Config``, ``config.Config``, ``"Config"``, ``Config | None``)."""
    if annotation is None:
        return False
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        return _is_config(ast.parse(annotation.value, mode="eval").body)
    if isinstance(annotation, ast.BinOp):
        return _is_config(annotation.left) or _is_config(annotation.right)
    return (isinstance(annotation, ast.Name) and annotation.id == "Config"
            or isinstance(annotation, ast.Attribute) and annotation.attr == "Config")


def takers_of_the_whole_config(files: dict[str, Path]) -> set[str]:
    """Qualified names of the functions with a parameter annotated ``Config``, and of the classes with a
    field annotated ``Config`` (a part that carries the whole config hands it to everything it reaches)."""
    found = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = child.args
                every = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs,
                         *filter(None, [arguments.vararg, arguments.kwarg])]
                if any(_is_config(a.annotation) for a in every):
                    found.add(f"{prefix}.{child.name}")
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.ClassDef):
                if any(isinstance(item, ast.AnnAssign) and _is_config(item.annotation) for item in child.body):
                    found.add(f"{prefix}.{child.name}")
                visit(child, f"{prefix}.{child.name}")

    for name, path in files.items():
        visit(ast.parse(path.read_text()), name)
    return found


def test_only_the_build_and_its_callers_take_the_whole_config():
    assert len(TAKES_THE_WHOLE_CONFIG) <= 5
    assert takers_of_the_whole_config(module_files()) == TAKES_THE_WHOLE_CONFIG


def test_the_config_finder_finds_parameters_and_fields(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def a(config: Config): ...\n"
                      "def b(*, settings: 'Config | None' = None): ...\n"
                      "def c(section: AlgoConfig, n: int): ...\n"
                      "class Run:\n    config: config.Config\n    def step(self, algo: AlgoConfig): ...\n"
                      "class Parts:\n    algo: AlgoConfig\n    def load(self, whole: Config): ...\n")
    assert takers_of_the_whole_config({"m": module}) == {"m.a", "m.b", "m.Run", "m.Parts.load"}
