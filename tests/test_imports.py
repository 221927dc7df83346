"""The package's modules import each other without a cycle, function-level imports included.

A cycle kept alive only by imports inside functions still ties two modules into one: neither can
be read, tested or changed alone. The walk reads every module's source (no import is executed),
resolves each `import` / `from ... import` to the package modules it loads (a package's
`__init__` included), and looks for a strongly connected component with more than one module.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"eagle_export": ROOT / "eagle_export", "eagle_export.passes": ROOT / "passes"}


def package_modules() -> dict[str, Path]:
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted(folder.glob("*.py")):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules `name` imports anywhere in its source, with the packages they live in."""
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    # The packages `name` lives in are loaded before it: a path to them is no edge from it.
    enclosing = {name.rsplit(".", i)[0] for i in range(name.count(".") + 1)}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from pkg import name` loads pkg.name when that is a module, else pkg alone
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target:  # importing a.b.c runs a/__init__ and a/b/__init__ first
                if target in known and target not in enclosing:
                    found.add(target)
                target = target.rpartition(".")[0]
    return found


def import_graph() -> dict[str, set[str]]:
    modules = package_modules()
    return {name: imported_modules(name, path, set(modules)) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_walk_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert {"eagle_export.contract", "eagle_export.errors"} <= graph["eagle_export.backends"]
    assert "eagle_export.drafter" in graph["eagle_export.passes.eagle_models"]  # absolute import
    assert {"eagle_export.passes", "eagle_export.passes.base"} <= graph["eagle_export.loader"]  # a package's __init__ too
    assert "eagle_export.build" in graph["eagle_export.cli"]  # imported inside a command function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []
