"""The package's shape: moved modules keep their old import paths, core/ never imports loggers/, no module is huge.

The import and size checks read the source files with ``ast`` (nothing is imported), so an import
under ``if TYPE_CHECKING:`` or inside a function counts as much as one at the top.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "composerjax"
MAX_MODULE_LINES = 600

MAX_TRAINER_LINES = 500


def modules(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*.py") if "__pycache__" not in path.parts)


def relative(path: Path, package: Path = PACKAGE) -> str:
    return path.relative_to(package.parent).as_posix()


def imported_modules(path: Path, package_folder: Path = PACKAGE) -> list[tuple[int, str]]:
    """``(line, dotted module)`` of every import statement in ``path``, relative ones resolved."""
    package = relative(path, package_folder)[: -len(".py")].replace("/", ".")
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            # `from composerjax import loggers` imports composerjax.loggers too
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
            found.append((node.lineno, base))
    return found


def test_no_module_in_core_imports_loggers_even_for_type_hints():
    offending = [f"{relative(path)}:{line} imports {name}"
                 for path in modules(PACKAGE / "core")
                 for line, name in imported_modules(path)
                 if name == "composerjax.loggers" or name.startswith("composerjax.loggers.")]
    assert offending == [], "core/ must not import loggers/ (use composerjax.core.logger.Logger):\n" + "\n".join(
        offending)


def test_the_import_check_sees_type_checking_and_relative_imports(tmp_path):
    source = tmp_path / "composerjax" / "core" / "example.py"
    source.parent.mkdir(parents=True)
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..loggers.logger import Logger\n"
                      "def f():\n    import composerjax.loggers\n")
    names = [name for _, name in imported_modules(source, tmp_path / "composerjax")]
    assert "composerjax.loggers.logger" in names and "composerjax.loggers" in names


def test_no_module_in_composerjax_is_over_600_lines():
    sizes = {relative(path): len(path.read_text().splitlines()) for path in modules(PACKAGE)}
    too_long = {name: lines for name, lines in sizes.items() if lines > MAX_MODULE_LINES}
    assert too_long == {}, f"split these modules (at most {MAX_MODULE_LINES} lines each): {too_long}"


def test_the_trainer_is_a_thin_event_loop_of_at_most_500_lines():
    lines = len((PACKAGE / "trainer" / "trainer.py").read_text().splitlines())
    assert lines <= MAX_TRAINER_LINES, f"composerjax/trainer/trainer.py has {lines} lines"


def test_only_step_touches_the_step_builders_caches():
    private = ("._train", "._multi", "._eval", "._predict")
    outside = [relative(path) for path in modules(PACKAGE) if path.parent.name != "step"
               and any(f"builder{name}" in path.read_text() for name in private)]
    assert outside == []


@pytest.mark.parametrize(("old", "new"), [
    ("composerjax.dist", "composerjax.parallel.dist"),
    ("composerjax.launch", "composerjax.parallel.launch"),
    ("composerjax.surgery", "composerjax.models.surgery"),
    ("composerjax.trainer.checkpoint", "composerjax.checkpoint.checkpointer"),
    ("composerjax.trainer.checkpoint_saver", "composerjax.checkpoint.saver"),
    ("composerjax.trainer.validation", "composerjax.core.validation"),
])
def test_old_import_paths_give_the_same_objects(old, new):
    shim, moved = importlib.import_module(old), importlib.import_module(new)
    assert shim.__all__, old
    for name in shim.__all__:
        assert hasattr(shim, name), f"{old}.{name} is missing"
    # Every public name of the moved module is still reachable from the old path, as the same object.
    for name in getattr(moved, "__all__", ()):
        assert getattr(shim, name) is getattr(moved, name), f"{old}.{name} is not {new}.{name}"


def test_old_launch_path_keeps_the_heartbeat_and_supervisor_names():
    from composerjax import launch as shim
    from composerjax.parallel import heartbeat, supervisor

    for name in heartbeat.__all__:
        assert getattr(shim, name) is getattr(heartbeat, name)
    assert shim.LAST_LINES == supervisor.LAST_LINES


def test_old_dist_path_is_what_the_package_exposes():
    import composerjax
    from composerjax.parallel import dist

    assert composerjax.dist.initialize is dist.initialize
    assert composerjax.dist.is_global_zero is dist.is_process_zero


def test_one_process_zero_helper():
    from composerjax.loggers import is_process_zero
    from composerjax.loggers.logger import is_process_zero as from_logger_module
    from composerjax.parallel.dist import is_global_zero
    from composerjax.parallel.dist import is_process_zero as helper

    assert is_process_zero is helper and from_logger_module is helper and is_global_zero is helper


def test_checkpoint_module_still_exports_what_it_did():
    from composerjax.checkpoint import checkpointer as checkpoint
    from composerjax.checkpoint import checks as checkpoint_checks
    from composerjax.checkpoint import writer as checkpoint_writer

    for name in ("CheckpointSaveError", "CheckpointCorruptError", "SaveFolderInUseError", "CheckpointMismatchError",
                 "checksums"):
        assert getattr(checkpoint, name) is getattr(checkpoint_checks, name)
    assert checkpoint.OWNER_FILE == checkpoint_writer.OWNER_FILE == ".composerjax-owner"
