"""The package's modules import each other without a cycle, the runtime loads no build-time module,
and no module imports a later pipeline stage; function-level imports included.

A cycle kept alive only by imports inside functions still ties two modules into one: neither can
be read, tested or changed alone. The walk reads every module's source (no import is executed),
resolves each `import` / `from ... import` to the package modules it loads (a package's
`__init__` included), and looks for a strongly connected component with more than one module.
The same graph gives the runtime's import closure (what `import eagle_export.runtime.runtime` may load)
and the edges that point from a pipeline stage to a later one.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"eagle_export": ROOT / "eagle_export"}


def package_modules(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, Path]:
    """Module name -> source file, sub-folders included (folder a/b/c.py is module package.a.b.c)."""
    modules = {}
    for package, folder in package_dirs.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
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


def import_graph(package_dirs: dict[str, Path] = PACKAGE_DIRS) -> dict[str, set[str]]:
    modules = package_modules(package_dirs)
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


def import_paths(graph: dict[str, set[str]], start: str) -> dict[str, list[str]]:
    """Every module `start` loads, directly or through others, with one shortest import chain to it."""
    paths, queue = {start: [start]}, [start]
    for v in queue:  # breadth first: the queue grows as it is read
        for w in sorted(graph[v] - paths.keys()):
            paths[w] = paths[v] + [w]
            queue.append(w)
    return paths


def last_name(module: str) -> str:
    """`eagle_export.models.target` -> `target`: the tests name modules so, to hold across folder moves."""
    return module.rpartition(".")[2]


# What `import eagle_export.runtime` must not load: the recipe schema, the build manifest, the sample
# target's converter, the models' export wrappers, the exporter, the quantizer, and the torch models.
BUILD_TIME = {"recipe", "manifest", "sample", "unrolled", "export", "quantize", "target", "drafter"}


def build_time_imports(graph: dict[str, set[str]], start: str = "eagle_export.runtime") -> list[str]:
    """The import chains from `start` to each build-time module it loads."""
    return [" -> ".join(map(last_name, chain)) for module, chain in sorted(import_paths(graph, start).items())
            if last_name(module) in BUILD_TIME]


# The package's folders in pipeline order: a module may import the package root (errors, files, lazy,
# progress, cache, environment, output_dir: what every stage uses), its own folder and earlier
# folders, never a later one. Data (the prompt sets, the sample target, the shipped recipes) comes
# first: the quantizer calibrates on prompts and a recipe names the sample target. The sample
# drafters' training scripts use everything; the CLI comes last. The width-invariant kernels come
# before the models, which bind them.
FOLDERS = ("data", "recipes", "kernels", "models", "speculation", "passes", "export", "quantize", "engine", "runtime", "builder",
           "tools", "samples")


def stage_numbers(modules, package: str = "eagle_export") -> dict[str, int]:
    """Module -> its folder's place in the pipeline: 0 for the package root's modules, len(FOLDERS) + 1
    for the CLI. A folder missing from FOLDERS is a KeyError: every folder must have its place."""
    def stage(name: str) -> int:
        parts = name.split(".")
        if name == f"{package}.cli":
            return len(FOLDERS) + 1
        if len(parts) == 2 and not (ROOT / package / parts[1]).is_dir():
            return 0  # a module at the package root
        return 0 if len(parts) == 1 else FOLDERS.index(parts[1]) + 1
    return {name: stage(name) for name in modules}


def later_stage_imports(graph: dict[str, set[str]], stage: dict[str, int]) -> list[str]:
    """Edges `a -> b` where b's stage comes after a's."""
    return [f"{a} -> {b}" for a in sorted(graph) for b in sorted(graph[a]) if stage[b] > stage[a]]


def test_the_walk_sees_relative_absolute_and_function_level_imports():
    graph = import_graph()
    assert {"eagle_export.models.contract", "eagle_export.errors"} <= graph["eagle_export.runtime.backends"]
    assert "eagle_export.models.drafter" in graph["eagle_export.passes.eagle_models"]  # absolute import
    assert {"eagle_export.passes", "eagle_export.passes.base"} <= graph["eagle_export.export.loader"]  # a package's __init__ too
    assert "eagle_export.builder.build" in graph["eagle_export.cli"]  # imported inside a command function
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycle():
    assert cycles(import_graph()) == []


def test_the_walk_finds_modules_in_sub_folders(tmp_path):
    """Modules moved into sub-packages keep being seen, relative imports resolved from where they are."""
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "top.py").write_text("")
    (tmp_path / "pkg" / "sub" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "sub" / "mod.py").write_text("from ..top import x\nfrom . import other\n")
    (tmp_path / "pkg" / "sub" / "other.py").write_text("")
    graph = import_graph({"pkg": tmp_path / "pkg"})
    assert set(graph) == {"pkg", "pkg.top", "pkg.sub", "pkg.sub.mod", "pkg.sub.other"}
    assert graph["pkg.sub.mod"] == {"pkg.top", "pkg.sub.other"}


def test_the_closure_and_stage_checks_see_a_planted_edge():
    graph = {"p.runtime": {"p.backends"}, "p.backends": {"p.errors"}, "p.errors": set(), "p.models.target": set()}
    assert build_time_imports(graph, "p.runtime") == []
    graph["p.errors"] = {"p.models.target"}  # two steps away, in a sub-folder
    assert build_time_imports(graph, "p.runtime") == ["runtime -> backends -> errors -> target"]
    stage = {"p.errors": 0, "p.models.target": 1, "p.backends": 2, "p.runtime": 2}
    assert later_stage_imports(graph, stage) == ["p.errors -> p.models.target"]


def test_the_runtime_imports_no_build_time_module():
    """`import eagle_export.runtime` (a user's only import) loads none of the build's code."""
    chains = build_time_imports(import_graph())
    assert not chains, "the runtime loads build-time modules:\n" + "\n".join(chains)


def test_every_folder_has_its_place_in_the_pipeline():
    folders = {p.name for p in (ROOT / "eagle_export").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(FOLDERS)


def test_no_module_imports_a_later_folder():
    graph = import_graph()
    edges = later_stage_imports(graph, stage_numbers(graph))
    assert not edges, "imports of a later pipeline folder:\n" + "\n".join(edges)


def test_the_folder_order_check_fails_on_the_flat_layouts_edges():
    """The edges the flat layout had that no folder order allows (seen failing before the move):
    the environment probes in doctor (a tool) read by the manifest and the cost model, the quantizer
    running the backends, the engine module reading the manifest."""
    graph = {"eagle_export.builder.manifest": {"eagle_export.tools.doctor"},
             "eagle_export.quantize.quantize": {"eagle_export.runtime.backends"},
             "eagle_export.engine.engine": {"eagle_export.builder.manifest"}, "eagle_export.tools.doctor": set(),
             "eagle_export.runtime.backends": set()}
    assert later_stage_imports(graph, stage_numbers(graph)) == [
        "eagle_export.builder.manifest -> eagle_export.tools.doctor",
        "eagle_export.engine.engine -> eagle_export.builder.manifest",
        "eagle_export.quantize.quantize -> eagle_export.runtime.backends"]


def test_the_old_build_path_still_imports_for_one_release():
    """`eagle_export.build.X` (the folder's name until 0.1.x) is the very module `eagle_export.builder.X`,
    with a DeprecationWarning naming the new path; the folder itself is gone (a `build/` line in a
    .gitignore would drop it)."""
    import importlib
    import warnings

    assert not (ROOT / "eagle_export" / "build").is_dir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = importlib.import_module("eagle_export.build.build_dir")
    new = importlib.import_module("eagle_export.builder.build_dir")
    assert old is new and old.open_build is new.open_build
    assert any("eagle_export.builder.build_dir" in str(w.message) for w in caught)
