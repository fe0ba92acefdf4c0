"""A real text corpus on every machine, offline: the Python standard library's own ``.py`` source files.

The files are found at run time under ``sysconfig.get_paths()['stdlib']`` (about 12 MB of source
in some 730 files for CPython 3.11 without its tests), split into train and validation **by file**
with a fixed-seed shuffle, so no file is in both splits.

Example:
    >>> files = stdlib_files()
    >>> train, validation = split_files(files, validation_fraction=0.05, seed=0)
    >>> len(train) + len(validation) == len(files), len(validation) >= 1
    (True, True)
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from composerjax.data.array_loader import _check_int

__all__ = ["read_documents", "split_files", "stdlib_files"]

# Folders never read: installed third-party packages (not the standard library) and bytecode caches.
_ALWAYS_EXCLUDED = frozenset({"site-packages", "dist-packages", "__pycache__"})
# Folders of the standard library's own test suites (``test/``, ``lib2to3/tests/``, ``idlelib/idle_test/``, ...).
_TEST_FOLDERS = frozenset({"test", "tests", "idle_test"})


def _is_test_path(relative: Path) -> bool:
    folders = relative.parts[:-1]
    return bool(_TEST_FOLDERS & set(folders)) or relative.name.startswith("test_")


def stdlib_files(root: str | Path | None = None, exclude_tests: bool = True) -> list[Path]:
    """Return the standard library's ``.py`` files under ``root``, sorted by their path relative to ``root``.

    Excluded, always: anything under a ``site-packages``, ``dist-packages`` or ``__pycache__``
    folder (third-party code and caches), and files whose bytes are not valid UTF-8 (so every
    document is a ``str`` that a byte-level tokenizer round-trips exactly). Excluded with
    ``exclude_tests`` (the default): anything under a folder named ``test``, ``tests`` or
    ``idle_test`` (``test/``, ``lib2to3/tests/``, ``idlelib/idle_test/``, ``tkinter/test/``, ...) and
    files named ``test_*.py``. Files are found recursively; the sorted order does not depend on
    the file system, so the same Python install always gives the same list.

    Args:
        root: The folder to search; defaults to this interpreter's ``sysconfig.get_paths()['stdlib']``.
        exclude_tests: Leave out the standard library's test suites.

    Raises:
        ValueError: ``root`` is not a folder, or no ``.py`` file is left under it.

    Example:
        >>> files = stdlib_files()
        >>> len(files) > 500, any('test' in f.parts for f in files)
        (True, False)
    """
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    if not root.is_dir():
        raise ValueError(f"`root` must be a folder holding Python source files, got {str(root)!r}")
    found = []
    for path in root.rglob("*.py"):
        relative = path.relative_to(root)
        if _ALWAYS_EXCLUDED & set(relative.parts[:-1]) or not path.is_file():
            continue
        if exclude_tests and _is_test_path(relative):
            continue
        try:
            path.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        found.append((relative.as_posix(), path))
    if not found:
        raise ValueError(f"no .py file found under `root`={str(root)!r} (exclude_tests={exclude_tests})")
    return [path for _, path in sorted(found)]


def split_files(
    files: Sequence[Path], validation_fraction: float = 0.05, seed: int = 0
) -> tuple[list[Path], list[Path]]:
    """Split ``files`` into ``(train, validation)`` by file, with a shuffle fixed by ``seed``.

    The files are shuffled with ``numpy.random.default_rng(seed)``; the first
    ``max(1, round(validation_fraction * len(files)))`` of the shuffle are the validation split
    (none when ``validation_fraction`` is 0). Both splits are returned in the order of ``files``,
    so they are disjoint, together are exactly ``files``, and depend only on ``(files, seed)``.

    Args:
        files: The files to split (say :func:`stdlib_files`), without duplicates.
        validation_fraction: The share of files held out, in ``[0, 1)``.
        seed: A non-negative integer seeding the shuffle.

    Raises:
        ValueError: ``validation_fraction`` outside ``[0, 1)``, a negative or non-integer ``seed``,
            duplicate ``files``, or no file left for training.

    Example:
        >>> train, validation = split_files([Path(f'{i}.py') for i in range(10)], 0.2, seed=0)
        >>> len(train), len(validation), sorted(train + validation) == [Path(f'{i}.py') for i in range(10)]
        (8, 2, True)
    """
    if (isinstance(validation_fraction, bool) or not isinstance(validation_fraction, (int, float))
            or not 0 <= validation_fraction < 1):
        raise ValueError(f"`validation_fraction` must be a number in [0, 1), got {validation_fraction!r}")
    seed = _check_int("seed", seed, 0)
    files = list(files)
    if len(set(files)) != len(files):
        raise ValueError("`files` holds duplicates; each file must be listed once to be split by file")
    held_out = 0 if validation_fraction == 0 else max(1, round(validation_fraction * len(files)))
    if held_out >= len(files):
        raise ValueError(f"`files` has {len(files)} files: validation_fraction={validation_fraction!r} would leave "
                         "none for training; pass more files or a smaller validation_fraction")
    order = np.random.default_rng(seed).permutation(len(files))
    validation_indices = set(order[:held_out].tolist())
    train = [file for index, file in enumerate(files) if index not in validation_indices]
    validation = [file for index, file in enumerate(files) if index in validation_indices]
    return train, validation


def read_documents(files: Iterable[str | Path]) -> Iterator[str]:
    """Yield the text of each file, in order: one document per file, decoded as UTF-8 exactly.

    Bytes are decoded as they are (no newline translation), so ``document.encode('utf-8')`` equals
    the file's bytes.

    Example:
        >>> first = next(read_documents(stdlib_files()[:1]))
        >>> isinstance(first, str) and len(first) > 0
        True
    """
    for file in files:
        yield Path(file).read_bytes().decode("utf-8")
