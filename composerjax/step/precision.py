"""Mixed precision inside the step: fp32 master weights, compute in the chosen dtype."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["PRECISIONS", "compute_dtype", "cast_floating"]

PRECISIONS = {"fp32": jnp.float32, "bf16": jnp.bfloat16}


def compute_dtype(precision: str) -> jnp.dtype:
    """The dtype the forward pass computes in for ``precision`` ('fp32' or 'bf16')."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    return PRECISIONS[precision]


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast the floating-point leaves of ``tree`` to ``dtype``; integers and keys are untouched."""
    if dtype == jnp.float32:
        return tree

    def cast(leaf: Any) -> Any:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(cast, tree)
