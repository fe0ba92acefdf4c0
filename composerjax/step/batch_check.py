"""Check a batch against the step it failed in: name what is wrong with it (dtype, shape, structure)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from composerjax.models.function_model import BatchError  # raised by the model's own check_batch too

__all__ = ["BatchError", "describe_batch", "diagnose_batch", "note_batch"]


def _leaf_text(leaf: Any) -> str:
    if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
        return f"{np.dtype(leaf.dtype).name}{list(leaf.shape)}"
    return f"{type(leaf).__name__} {leaf!r:.40}"


def describe_batch(batch: Any) -> tuple[Any, tuple[tuple[str, str, tuple[int, ...] | None], ...]]:
    """``(treedef, ((path, dtype, shape), ...))``: what a batch looks like, for comparisons and messages.

    Example:
        >>> import numpy as np
        >>> describe_batch((np.zeros((2, 3), np.float32), np.zeros(2, np.int32)))[1]
        (('[0]', 'float32', (2, 3)), ('[1]', 'int32', (2,)))
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    leaves = []
    for path, leaf in flat:
        if hasattr(leaf, "shape") and hasattr(leaf, "dtype"):
            leaves.append((jax.tree_util.keystr(path), np.dtype(leaf.dtype).name, tuple(leaf.shape)))
        else:
            leaves.append((jax.tree_util.keystr(path), type(leaf).__name__, None))
    return treedef, tuple(leaves)


def _text(dtype: str, shape: tuple[int, ...] | None) -> str:
    return dtype if shape is None else f"{dtype}{list(shape)}"


def _format(description: Any) -> str:
    return "{" + ", ".join(f"batch{path}: {_text(dtype, shape)}" for path, dtype, shape in description[1]) + "}"


def diagnose_batch(batch: Any, index: int, expected: Any) -> BatchError | None:
    """A :class:`BatchError` naming what is wrong with train batch ``index``, or None if nothing is.

    Checks, in order: every leaf is an array; every leaf has the same leading (batch) dimension;
    the batch has the structure, dtypes and trailing shapes of the batch the step last compiled for
    (``expected``, from :func:`describe_batch`).

    Example:
        >>> import numpy as np
        >>> str(diagnose_batch((np.zeros((4, 3)), np.zeros(5)), 7, None)).split(":")[0]
        'train_dataloader batch 7'
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(batch)
    where = f"train_dataloader batch {index}"
    got = describe_batch(batch)
    if not flat:
        return BatchError(f"{where}: the batch is a {type(batch).__name__} with no arrays; expected a pytree "
                          "(tuple, list or dict) of arrays such as (inputs, targets)")
    for path, leaf in flat:
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")) or np.dtype(leaf.dtype).kind in "OSU":
            return BatchError(f"{where}: batch{jax.tree_util.keystr(path)} is {_leaf_text(leaf)}; expected a numeric "
                              f"numpy or jax array. The batch: {_format(got)}")
    leading = {jax.tree_util.keystr(path): (leaf.shape[0] if leaf.ndim else None) for path, leaf in flat}
    if None in leading.values() or len(set(leading.values())) > 1:
        sizes = ", ".join(f"batch{path}: {size}" for path, size in leading.items())
        return BatchError(f"{where}: the arrays disagree on the batch (leading) dimension ({sizes}); expected every "
                          "array to have the same number of samples in its first dimension")
    if expected is not None:
        if got[0] != expected[0]:
            return BatchError(f"{where} has a different structure from the batches before it: got {_format(got)}, "
                              f"expected {_format(expected)}")
        for (path, dtype, shape), (_, dtype_before, shape_before) in zip(got[1], expected[1]):
            if dtype != dtype_before or len(shape) != len(shape_before) or shape[1:] != shape_before[1:]:
                return BatchError(
                    f"{where}: batch{path} is {_text(dtype, shape)}, but the batches before it had "
                    f"{_text(dtype_before, shape_before)} (only the leading batch dimension may change). The batch: "
                    f"{_format(got)}")
    return None


def note_batch(error: BaseException, batch: Any, index: int) -> None:
    """Add the batch's structure to an error raised while compiling the step for it."""
    if hasattr(error, "add_note"):
        error.add_note(f"(composerjax) while compiling the train step for train_dataloader batch {index}: "
                       f"{_format(describe_batch(batch))}")
