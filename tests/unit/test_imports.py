"""The package's imports form no circle and never run back up its layers: read from the source,
and checked by importing every module with no other module of ps_bench loaded."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from ps_bench.runtime.preload import PRELOAD

PACKAGE = Path(__file__).resolve().parents[2] / "ps_bench"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(node: ast.AST, importer: str) -> set[str]:
    """The ps_bench modules an import statement loads (``from pkg import sub`` loads ``pkg.sub``)."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in MODULES}
    if not isinstance(node, ast.ImportFrom) or node.level or not (node.module or "").startswith("ps_bench"):
        return set()
    found = {node.module} if node.module in MODULES else set()
    found |= {f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in MODULES}
    return found - {importer}


def import_graph() -> dict[str, set[str]]:
    return {name: set().union(*(imported_modules(node, name) for node in ast.walk(ast.parse(path.read_text()))))
            for name, path in MODULES.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[name] = 2
        path.pop()
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


def test_no_import_circle_in_the_package():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def folder(module: str) -> str:
    """The first-level package a module lies in, or the module itself at the package's root."""
    return ".".join(module.split(".")[:2])


def folder_graph() -> dict[str, set[str]]:
    """The import graph with each first-level package one node and each root module its own."""
    graph: dict[str, set[str]] = {}
    for importer, targets in import_graph().items():
        graph.setdefault(folder(importer), set()).update(
            folder(target) for target in targets if folder(target) != folder(importer))
    return graph


def test_no_import_circle_between_folders():
    """Read folder by folder, the imports show the layers: no package needs one that needs it."""
    cycle = find_cycle(folder_graph())
    assert cycle is None, " -> ".join(cycle)


# The package's layers, bottom first (docs/development.md, "Layers"). A module may import from its own
# layer and the ones below, never from a layer above. A module belongs to the layer of the longest
# name here that it is or lies inside.
LAYERS = [
    # what every piece stands on: options, registries, a job's ranks, a rank's failure, the forkserver
    ("ps_bench", "ps_bench.config", "ps_bench.places", "ps_bench.registry", "ps_bench.runfiles",
     "ps_bench.runtime"),
    ("ps_bench.metrics", "ps_bench.models"),  # measuring, and the workloads measured
    ("ps_bench.servers",),
    ("ps_bench.strategies",),
    ("ps_bench.trainers",),
    ("ps_bench.job", "ps_bench.options"),  # a whole job checked; the run's flags
    ("ps_bench.results",),  # the books of a run, and its files
    ("ps_bench.processes",),  # the processes of a job
    ("ps_bench.cluster",),  # the engines past one machine
    ("ps_bench.plots", "ps_bench.points", "ps_bench.sweep", "ps_bench.report", "ps_bench.compare",
     "ps_bench.predict"),  # subcommands
    ("ps_bench.cli", "ps_bench.__main__"),
]


def layer(module: str) -> int:
    """The index in LAYERS of the longest name that ``module`` is or lies inside."""
    matches = [(len(name), index) for index, names in enumerate(LAYERS) for name in names
               if module == name or module.startswith(name + ".")]
    if not matches:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return max(matches)[1]


def test_no_import_runs_back_up_the_layers():
    upward = [f"{importer} (layer {layer(importer)}) imports {target} (layer {layer(target)})"
              for importer, targets in import_graph().items() for target in sorted(targets)
              if layer(target) > layer(importer)]
    assert upward == []


def test_the_layer_check_finds_an_import_that_runs_up():
    assert layer("ps_bench.metrics.wire") < layer("ps_bench.strategies.base") < layer("ps_bench.results.record")
    assert layer("ps_bench.runtime.topology") < layer("ps_bench.processes.launch")


def test_the_layers_are_the_folders():
    """Each layer is made of whole first-level packages and root modules, so the folders show the
    layers; and every one of them is in a layer."""
    named = [name for names in LAYERS for name in names]
    assert [name for name in named if name != folder(name)] == []
    assert len(named) == len(set(named))
    assert sorted(set(folder_graph()) - set(named)) == []


def test_no_module_of_ours_is_imported_inside_a_function():
    """Imports of ps_bench modules stand at the top of each module, where the graph above sees them."""
    late = []
    for name, path in MODULES.items():
        for function in ast.walk(ast.parse(path.read_text())):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                late += [f"{name}.{function.name}: {sorted(found)}" for node in ast.walk(function)
                         if (found := imported_modules(node, name))]
    assert late == []


def test_only_the_forkserver_imports_the_module_that_ties_it_to_its_launcher():
    """Importing ps_bench.runtime.forkserver sets the parent-death signal on the importing process."""
    assert [name for name, targets in import_graph().items() if "ps_bench.runtime.forkserver" in targets] == []
    assert PRELOAD[0] == "ps_bench.runtime.forkserver"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_module_imports_alone():
    """Each module imported first, in an interpreter of its half of the modules (the halves side
    by side, a core each), with every module of ps_bench unloaded before the next: a circle that
    only shows with another import order fails here."""
    names = sorted(MODULES)
    probes = [subprocess.Popen([sys.executable, "-c", (
        "import importlib, sys, torch\n"
        f"for name in {half!r}:\n"
        "    for loaded in [m for m in sys.modules if m == 'ps_bench' or m.startswith('ps_bench.')]:\n"
        "        del sys.modules[loaded]\n"
        "    importlib.import_module(name)\n")], cwd=PACKAGE.parent, stderr=subprocess.PIPE, text=True)
        for half in (names[::2], names[1::2])]
    for probe in probes:
        _, stderr = probe.communicate(timeout=300)
        assert probe.returncode == 0, stderr


def test_lines_of_the_package_are_at_most_100_characters():
    long = [f"{name}:{number}" for name, path in MODULES.items()
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 100]
    assert long == []
