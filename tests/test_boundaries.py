"""The trainer wing's hand-offs stay narrow: no ``trainer: Any``, nothing attached to a trainer, no private reads.

Read from the source with ``ast`` (nothing is imported), over every module of the package and its
plugins (``algorithms/``, ``callbacks/``).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = (ROOT / "composerjax", ROOT / "algorithms", ROOT / "callbacks")
#: NamedTuple's public API is spelled with an underscore.
NAMEDTUPLE_API = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})
#: Private names of other libraries read on purpose, each with its reason.
ALLOWED_PRIVATE = {
    "os._exit": "the standard library's exit without cleanup, for a child process that must not run atexit hooks",
    "compilation_cache._cache": "JAX keeps no public way to point an initialised persistent cache at a new folder",
    "compilation_cache._cache_initialized": "(the same JAX cache reset)",
    "compilation_cache._cache_initialized_mutex": "(the same JAX cache reset)",
}


def sources(folders=FOLDERS) -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text(), filename=str(path))
            for folder in folders for path in sorted(folder.rglob("*.py")) if "__pycache__" not in path.parts}


def own_names(tree: ast.Module) -> set[str]:
    """Names a module defines itself: functions, classes, module names and ``self.x``/``cls.x`` attributes."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            names.add(node.attr)
    return names


def private_reads(path: Path, tree: ast.Module) -> list[str]:
    """``obj._name`` uses whose ``_name`` the module does not define itself (another module's private)."""
    mine, found = own_names(tree), []
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
            continue
        if node.attr in NAMEDTUPLE_API or node.attr in mine:
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        text = ast.unparse(node)
        if text not in ALLOWED_PRIVATE:
            found.append(f"{shown}:{node.lineno}: {text}")
    return found


def test_no_module_reads_or_writes_another_modules_private_names():
    offending = [line for path, tree in sources().items() for line in private_reads(path, tree)]
    assert offending == []


def test_the_private_name_check_sees_reads_and_writes_of_another_objects_privates(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("class A:\n    def f(self, state):\n        self._mine = state._theirs\n"
                      "        state._flag = True\n        return self._mine, os._exit\n")
    found = private_reads(source, ast.parse(source.read_text()))
    assert sorted(line.split(": ", 1)[1] for line in found) == ["state._flag", "state._theirs"]


def test_no_trainer_is_typed_any():
    offending = []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            arguments = node.args.args + node.args.kwonlyargs if isinstance(
                node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            for argument in arguments:
                if argument.arg == "trainer" and argument.annotation is not None and ast.unparse(
                        argument.annotation) in ("Any", "typing.Any", "'Any'"):
                    offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}(trainer: Any)")
            if isinstance(node, ast.AnnAssign) and ast.unparse(node.annotation) == "Any" and "trainer" in ast.unparse(
                    node.target):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node.target)}: Any")
    assert offending == []


def test_nothing_outside_the_trainer_class_assigns_an_attribute_to_a_trainer():
    offending = []
    for path, tree in sources().items():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                for part in ast.walk(target):
                    if (isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store)
                            and not part.attr.startswith("__")
                            and "trainer" in ast.unparse(part.value).lower().split(".")[-1]):
                        offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(part)} = ...")
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args and "trainer" in (
                    ast.unparse(node.args[0])):
                offending.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert offending == []
