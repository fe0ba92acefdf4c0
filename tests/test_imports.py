"""Imports point down the layers and close no circle: every import of the package, deferred ones included.

The source files are read with ``ast`` (nothing is imported), so an import inside a function or
under ``if TYPE_CHECKING:`` counts as much as one at the top: a deferred import still ties the two
modules together, and a type hint is still a dependency a reader has to follow.

``algorithms/`` and ``callbacks/`` install as ``composerjax.algorithms`` and ``composerjax.callbacks``
(pyproject's ``package-dir``) and are walked under those names. ``importlib.import_module`` with a
computed name (the registry's entry points) is not an import statement and is not followed.
"""

from __future__ import annotations

import ast
import importlib
import pickle
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: Where each installed package's source lives (pyproject: [tool.setuptools] package-dir).
PACKAGE_FOLDERS = {
    "composerjax": ROOT / "composerjax",
    "composerjax.algorithms": ROOT / "algorithms",
    "composerjax.callbacks": ROOT / "callbacks",
}

#: The floors of the house, lowest first: ``(modules, why they stand there)``. A name covers the module
#: and everything under it; ``"composerjax"`` alone is the package's ``__init__`` (its front door).
#: A module imports only its own floor or a lower one; a sideways import is fine while it closes no circle.
LAYERS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("composerjax.core", "composerjax.metrics", "composerjax.parallel", "composerjax.registry",
      "composerjax.console", "composerjax.xla_flags", "composerjax._version"),
     "the foundations: events, time, State, Engine; metrics; devices and processes; name registries; "
     "console lines; XLA flags; the version. Each needs only JAX and the standard library"),
    (("composerjax.data", "composerjax.loggers", "composerjax.optim", "composerjax.models"),
     "what a run is made of: data loaders, loggers, optimizers and schedules, models (on the foundations)"),
    (("composerjax.step", "composerjax.checkpoint"),
     "the compiled train/eval/predict steps, and checkpoints on disk: beside each other, neither uses the other"),
    (("composerjax.trainer",),
     "the Trainer: settings sections, the fit/eval/predict loops and the built-ins, over steps and checkpoints"),
    (("composerjax", "composerjax.explain", "composerjax.dist", "composerjax.launch", "composerjax.surgery"),
     "the package's front: its __init__ (the public names), explain (walks the trainer's lifecycle) and the "
     "old import paths kept as shims"),
    (("composerjax.cli", "composerjax.cli_common", "composerjax.cli_run", "composerjax.cli_export",
      "composerjax.cli_generate", "composerjax.cli_traces", "composerjax.__main__"),
     "the command line: drives the trainer and explain; its subcommand modules share cli_common and cli_run"),
    (("composerjax.algorithms", "composerjax.callbacks"),
     "the plugins: written against the public API (`composerjax`, `composerjax.core`) like any third party's; "
     "nothing in the core imports them"),
)

#: Imports the lead's trainer rebuild (issue 29) still has to turn around, ``(importer, imported)``.
#: Empty it as they go: the tests fail on anything else, and on an entry here that no longer exists.
KNOWN_UNTIL_LEAD_FIXES: set[tuple[str, str]] = set()


def module_files(folders: Mapping[str, Path] = PACKAGE_FOLDERS) -> dict[str, Path]:
    """``{dotted module name: source file}`` of every module under ``folders`` (a package is its ``__init__``)."""
    found = {}
    for package, folder in folders.items():
        for path in sorted(folder.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


def _imported_names(module: str, path: Path) -> Iterable[tuple[int, str, tuple[str, ...]]]:
    """``(line, base module, names taken from it)`` of each import statement; relative ones resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, ()
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            yield node.lineno, base, tuple(alias.name for alias in node.names)


def import_graph(modules: Mapping[str, Path]) -> dict[str, dict[str, int]]:
    """``{importer: {imported module of the package: first line}}``.

    ``from a import b`` points to ``a.b`` when that is a module, else to ``a`` (its ``__init__``);
    ``import a.b.c`` to the longest of ``a.b.c``, ``a.b``, ``a`` that is a module. Imports of other
    packages are left out.
    """

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges = graph.setdefault(module, {})
        for line, base, names in _imported_names(module, path):
            targets = [f"{base}.{name}" if f"{base}.{name}" in modules else known(base) for name in names] or [
                known(base)]
            for target in targets:
                if target is not None and target != module:
                    edges.setdefault(target, line)
    return graph


def cycles(graph: Mapping[str, Mapping[str, int]]) -> list[list[str]]:
    """The circles of ``graph``: each strongly connected group of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:  # Tarjan's algorithm, iterative (no recursion limit on a deep chain)
        work = [(start, iter(graph.get(start, ())))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, targets = work[-1]
            for target in targets:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(graph.get(target, ()))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def shortest_loop(graph: Mapping[str, Mapping[str, int]], group: list[str]) -> str:
    """One shortest loop through ``group``'s first module, as ``'a -> b:line -> ... -> a:line'``."""
    start, members = group[0], set(group)
    came_from: dict[str, str] = {}
    queue = [start]
    for node in queue:  # breadth first, inside the group only
        for target in sorted(graph.get(node, ())):
            if target == start:
                path = [node]
                while path[-1] != start:
                    path.append(came_from[path[-1]])
                path.reverse()
                steps = [f"{b}:{graph[a][b]}" for a, b in zip(path, [*path[1:], start])]
                return " -> ".join([start, *steps])
            if target in members and target not in came_from and target != start:
                came_from[target] = node
                queue.append(target)
    return start


def floor_of(module: str, layers: tuple[tuple[tuple[str, ...], str], ...] = LAYERS) -> int | None:
    """The index in ``layers`` of the longest name that covers ``module`` (None: no floor named)."""
    best: tuple[int, int] | None = None
    for floor, (names, _) in enumerate(layers):
        for name in names:
            covers = module == name if name.count(".") == 0 else module == name or module.startswith(name + ".")
            if covers and (best is None or len(name) > best[0]):
                best = (len(name), floor)
    return None if best is None else best[1]


def upward_imports(graph: Mapping[str, Mapping[str, int]], modules: Mapping[str, Path],
                   layers: tuple[tuple[tuple[str, ...], str], ...] = LAYERS) -> list[str]:
    """``'importer:line imports target (floor a -> floor b)'`` for each import that points up a floor."""
    found = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            here, there = floor_of(module, layers), floor_of(target, layers)
            if here is not None and there is not None and there > here:
                found.append(f"{module}:{line} imports {target} (floor {here + 1} -> floor {there + 1}, "
                             f"{modules[module].name})")
    return found


def _offenders(graph: Mapping[str, Mapping[str, int]], known: set[tuple[str, str]]) -> dict[str, dict[str, int]]:
    return {module: {target: line for target, line in edges.items() if (module, target) not in known}
            for module, edges in graph.items()}


# -- the package ------------------------------------------------------------------------------------
def test_every_module_of_the_package_stands_on_a_named_floor():
    homeless = [module for module in module_files() if floor_of(module) is None]
    assert homeless == [], f"add these modules to a floor of LAYERS in {Path(__file__).name}: {homeless}"


def test_no_import_points_up_a_floor():
    modules = module_files()
    upward = upward_imports(_offenders(import_graph(modules), KNOWN_UNTIL_LEAD_FIXES), modules)
    assert upward == [], "these imports point up (move what they need down, or the importer up):\n" + "\n".join(upward)


def test_no_modules_import_each_other_in_a_circle():
    graph = import_graph(module_files())
    circles = cycles(_offenders(graph, KNOWN_UNTIL_LEAD_FIXES))
    described = [f"{len(group)} modules, e.g. {shortest_loop(graph, group)}" for group in circles]
    assert circles == [], "these modules import each other (deferred and type-hint imports count):\n" + "\n".join(
        described)


def test_the_known_offenders_still_exist():
    graph = import_graph(module_files())
    gone = sorted(pair for pair in KNOWN_UNTIL_LEAD_FIXES if pair[1] not in graph.get(pair[0], {}))
    assert gone == [], f"fixed: take these out of KNOWN_UNTIL_LEAD_FIXES: {gone}"


def test_the_plugins_are_walked_under_their_installed_names():
    modules = module_files()
    graph = import_graph(modules)
    assert "composerjax.algorithms.mixup" in modules and "composerjax.callbacks.speed_monitor" in modules
    # `from composerjax import Algorithm` is the package's front door; `from .mixing import ...` resolves inside
    assert "composerjax" in graph["composerjax.algorithms.mixup"]
    assert floor_of("composerjax.algorithms.mixup") == len(LAYERS) - 1
    assert floor_of("composerjax") == floor_of("composerjax.explain") > floor_of("composerjax.trainer.trainer")
    assert floor_of("composerjax.core.time") == 0 and floor_of("composerjax.cli_run") == floor_of("composerjax.cli")


# -- what moved down keeps its old import paths --------------------------------------------------------
@pytest.mark.parametrize(("old", "new", "names"), [
    ("composerjax.core.time", "composerjax.core.timestamp", ("Timestamp", "TimestampCounts")),
    ("composerjax.core.time", "composerjax.core.time_value", ("Time", "TimeUnit", "TimeUnitError", "ensure_time",
                                                              "parse_time")),
    ("composerjax.step.batch_check", "composerjax.models.function_model", ("BatchError",)),
    ("composerjax.trainer.interrupt", "composerjax.models.function_model", ("BatchError",)),
    ("composerjax", "composerjax.models.function_model", ("BatchError",)),
    ("composerjax.models.hf", "composerjax.models.hf_names", ("hf_parameter_names",)),
    ("composerjax.models", "composerjax.models.hf_names", ("hf_parameter_names",)),
    ("composerjax.cli", "composerjax.cli_common", ("UsageError",)),
    ("composerjax.cli_export", "composerjax.cli_run", ("model_after_init",)),
    ("composerjax.cli_generate", "composerjax.cli_run", ("RECIPE_FILE", "load_model_weights")),
    ("composerjax", "composerjax._version", ("__version__",)),
])
def test_names_moved_down_are_the_same_objects_at_their_old_paths(old, new, names):
    shim, home = importlib.import_module(old), importlib.import_module(new)
    for name in names:
        assert getattr(shim, name) is getattr(home, name), f"{old}.{name} is not {new}.{name}"


def test_time_classes_still_name_their_public_module_in_tracebacks_and_pickles():
    from composerjax.core.time import Time, TimeUnit, TimeUnitError

    assert {cls.__module__ for cls in (Time, TimeUnit, TimeUnitError)} == {"composerjax.core.time"}
    # a fresh process reads back what this one pickled through the public path
    blob = pickle.dumps((Time(3, "ep"), TimeUnit.BATCH))
    script = "import pickle, sys; print(pickle.loads(bytes.fromhex(sys.argv[1])))"
    out = subprocess.run([sys.executable, "-c", script, blob.hex()], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(Time(3, TimeUnit.EPOCH), <TimeUnit.BATCH: 'ba'>)"


def test_the_version_has_one_home_that_imports_nothing_and_matches_pyproject():
    import composerjax
    from composerjax.trainer.settings import versions

    home = ROOT / "composerjax" / "_version.py"
    imports = [node for node in ast.walk(ast.parse(home.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))]
    assert imports == []
    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert composerjax.__version__ == declared.group(1) == versions()["composerjax"]


# -- the checker itself -----------------------------------------------------------------------------
def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, source in files.items():
        path = tmp_path / "pkg" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return module_files({"pkg": tmp_path / "pkg"})


PLANTED_LAYERS = ((("pkg.low",), "below"), (("pkg.high", "pkg"), "above"))


def test_the_checker_sees_a_circle_through_a_deferred_and_a_type_checking_import(tmp_path):
    modules = _plant(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from pkg.low import b\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "low/c.py": "from pkg.low.a import f\n",
        "low/d.py": "from pkg.low import c\n",  # leads into the circle, is not part of it
    })
    graph = import_graph(modules)
    assert graph["pkg.low.a"] == {"pkg.low.b": 2} and graph["pkg.low.b"] == {"pkg.low.c": 3}
    assert cycles(graph) == [["pkg.low.a", "pkg.low.b", "pkg.low.c"]]
    assert shortest_loop(graph, ["pkg.low.a", "pkg.low.b", "pkg.low.c"]) == (
        "pkg.low.a -> pkg.low.b:2 -> pkg.low.c:3 -> pkg.low.a:1")
    assert upward_imports(graph, modules, PLANTED_LAYERS) == []


def test_the_checker_sees_an_import_that_points_up_even_to_the_package_front(tmp_path):
    modules = _plant(tmp_path, {
        "__init__.py": "from pkg.high import run\n",
        "high.py": "from pkg.low.tool import tool\ndef run():\n    return tool()\n",
        "low/__init__.py": "",
        "low/tool.py": "def tool():\n    from pkg import high\n    return high\n",
        "low/version.py": "import pkg\n",
    })
    graph = import_graph(modules)
    upward = upward_imports(graph, modules, PLANTED_LAYERS)
    assert [line.split(" (")[0] for line in upward] == ["pkg.low.tool:2 imports pkg.high",
                                                       "pkg.low.version:1 imports pkg"]
    assert cycles(graph) == [["pkg.high", "pkg.low.tool"]]
    assert upward_imports(graph, modules, ((("pkg.low", "pkg.high", "pkg"), "one floor"),)) == []
