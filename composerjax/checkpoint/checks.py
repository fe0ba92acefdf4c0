"""What a checkpoint is checked against: the errors it raises, array checksums, saved-vs-expected comparison.

Used by :class:`~composerjax.checkpoint.checkpointer.Checkpointer`: a save records :func:`checksums` of
its arrays; a restore lists every difference between the saved arrays and the run's
(:func:`compare_named`, :func:`structure_problem`) before reading anything, and the checksums of
what it read back after. ``composerjax.checkpoint.checkpointer`` re-exports the errors and
:func:`checksums`.

Example:
    >>> import jax.numpy as jnp
    >>> checksums({"w": jnp.ones(2)}) == checksums({"w": jnp.ones(2)})
    True
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from composerjax.parallel.sharding import path_of

__all__ = [
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "CheckpointSaveError",
    "SaveFolderInUseError",
    "checksums",
    "compare_arrays",
    "compare_named",
    "first_line",
    "is_array",
    "structure_problem",
]

# What each train-state group is called in error messages.
_GROUP_NAMES = {
    "params": "model parameters",
    "rest": "model state (batch statistics, rng counters)",
    "opt_state": "optimizer state",
    "algorithm_state": "algorithm state",
    "clock": "step clock",
}


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model, optimizer or algorithms of the run that loads it."""


class CheckpointSaveError(RuntimeError):
    """A checkpoint was refused or failed to reach the disk: the save did not happen."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint on disk cannot be read back as it was written (missing item, unreadable file, bad checksum)."""


class SaveFolderInUseError(RuntimeError):
    """Another live run holds the save folder."""


def first_line(error: BaseException) -> str:
    """``'ValueError: the message'`` on one line (tensorstore and orbax errors run to many).

    Example:
        >>> first_line(ValueError("the message"))
        'ValueError: the message'
    """
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def _arrays_by_name(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{'params.layers.0.kernel': (shape, dtype)}`` for every array leaf, names as orbax writes them."""
    is_meta = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_meta)[0]:
        if is_meta(leaf):
            named[path_of(path, ".")] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return named


def compare_arrays(metadata: Any, target: Any) -> list[str]:
    """Every difference between the saved arrays and the run's (``target``'s groups only): missing, extra, shapes.

    Args:
        metadata: the saved tree's metadata (orbax's item metadata of ``state``), or any tree of
            objects with ``shape`` and ``dtype``.
        target: the run's train state as ``{group: tree}`` (``params``, ``opt_state``, ...).

    Returns:
        One line per difference, named by group (``model parameters: ...``); empty when they fit.

    Example:
        >>> import numpy as np
        >>> saved = {"params": {"w": np.zeros((2, 3))}}
        >>> compare_arrays(saved, {"params": {"w": np.zeros((2, 4))}})
        ['model parameters: params.w saved with shape (2, 3), this run expects (2, 4)']
    """
    groups = set(target)
    saved = {name: value for name, value in _arrays_by_name(getattr(metadata, "tree", metadata)).items()
             if name.split(".")[0] in groups}
    return compare_named(saved, _arrays_by_name(target))


def compare_named(saved: dict[str, tuple[Any, ...]], expected: dict[str, tuple[Any, ...]]) -> list[str]:
    """:func:`compare_arrays` on ``{'params.w': (shape, ...)}`` maps: the arrays offered against those expected.

    Example:
        >>> compare_named({"params.w": ((2,),)}, {"params.w": ((2,),), "params.b": ((1,),)})
        ['model parameters: the checkpoint has 1 arrays, this run has 2; missing from the checkpoint: params.b']
    """
    problems = []
    for group in dict.fromkeys(name.split(".")[0] for name in (*saved, *expected)):
        label = _GROUP_NAMES.get(group, group)
        saved_g = {n: v for n, v in saved.items() if n.split(".")[0] == group}
        expected_g = {n: v for n, v in expected.items() if n.split(".")[0] == group}
        missing = [n for n in expected_g if n not in saved_g]
        extra = [n for n in saved_g if n not in expected_g]
        if missing or extra:
            problems.append(
                f"{label}: the checkpoint has {len(saved_g)} arrays, this run has {len(expected_g)}"
                + (f"; missing from the checkpoint: {', '.join(missing[:5])}" if missing else "")
                + (f"; not in this run: {', '.join(extra[:5])}" if extra else ""))
        for name in expected_g:
            if name in saved_g and tuple(saved_g[name][0]) != tuple(expected_g[name][0]):
                problems.append(f"{label}: {name} saved with shape {tuple(saved_g[name][0])}, this run expects "
                                f"{tuple(expected_g[name][0])}")
    return problems


# -- checksums -------------------------------------------------------------------------------------
def _as_words(leaf: jax.Array) -> jax.Array:
    """The bits of ``leaf`` as a flat uint32 vector (any dtype: 8, 16, 32 or 64 bits, keys, bools)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if jax.numpy.iscomplexobj(leaf):
        leaf = jax.numpy.stack([leaf.real, leaf.imag])
    if leaf.dtype == bool:
        return leaf.astype(np.uint32).ravel()
    size = np.dtype(leaf.dtype).itemsize
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[size]
    return jax.lax.bitcast_convert_type(leaf, unsigned).astype(np.uint32).ravel()


def _leaf_checksum(leaf: jax.Array) -> jax.Array:
    # Odd position weights: a change to any bit of any word moves the sum (mod 2**32), and a swap of
    # two words does too. Integer sums are exact in any order, so every sharding gives the same value.
    words = _as_words(leaf)
    weights = jax.numpy.arange(words.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return jax.numpy.sum(words * weights, dtype=np.uint32)


_checksum_tree = jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree))


def checksums(tree: Any) -> dict[str, int]:
    """``{'params.layers.0.kernel': 123456789, ...}``: a position-weighted uint32 sum of each array's bits.

    Computed on the devices (one compiled call), so a sharded array is summed where it lives; the
    result is the same whatever the sharding or the number of processes.

    Example:
        >>> checksums({"w": jax.numpy.zeros(3)})
        {'w': 0}
    """
    on_device = lambda x: isinstance(x, jax.Array)  # noqa: E731
    arrays = jax.tree.map(lambda x: x if on_device(x) else None, tree, is_leaf=on_device)
    sums = _checksum_tree(arrays)
    named = {}
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
        named[path_of(path, ".")] = int(np.asarray(value.addressable_data(0)))
    return named


def structure_problem(metadata: Any, target: Any) -> str:
    """How the saved tree's structure differs from the run's (e.g. adam's state against adamw's), or ''.

    Two trees are laid out alike when they have arrays and empty nodes (optax's ``EmptyState``,
    which orbax saves as None) at the same places; names and shapes are :func:`compare_arrays`'s.

    Example:
        >>> import numpy as np
        >>> adam, sgd = {"opt_state": (np.zeros(2), np.zeros(2))}, {"opt_state": (np.zeros(2),)}
        >>> "optimizer state is laid out differently" in structure_problem(adam, sgd)
        True
        >>> structure_problem(sgd, sgd)
        ''
    """
    saved = getattr(metadata, "tree", metadata)
    problems = []
    for group in target:
        if not isinstance(saved, dict) or group not in saved:
            continue
        if _layout(saved[group]) != _layout(target[group]):
            problems.append(f"{_GROUP_NAMES.get(group, group)} is laid out differently (saved "
                            f"{_outline(saved[group])}, this run {_outline(target[group])}); a different optimizer "
                            "or optimizer chain?")
    return "; ".join(problems)


def is_array(value: Any) -> bool:
    """Whether ``value`` is an array or array metadata (it has ``shape`` and ``dtype``)."""
    return hasattr(value, "shape") and hasattr(value, "dtype")


def _layout(tree: Any) -> set[tuple[str, bool]]:
    """``{(path, is_array)}``: where a tree has arrays and where empty nodes (None, ``EmptyState()``, ``{}``)."""
    def empty_or_array(node: Any) -> bool:
        return node is None or is_array(node) or not jax.tree.leaves(node, is_leaf=is_array)

    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=empty_or_array)[0]
    return {(path_of(path, "."), is_array(leaf)) for path, leaf in flat}


def _outline(tree: Any, depth: int = 2) -> str:
    """A short picture of a tree's top levels: ``(ScaleByAdamState, EmptyState)``."""
    if depth == 0:
        return "..."
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return "(" + ", ".join(_outline(item, depth - 1) for item in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k}: {_outline(v, depth - 1)}" for k, v in list(tree.items())[:6]) + "}"
    return type(tree).__name__

