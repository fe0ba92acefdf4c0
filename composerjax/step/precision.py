"""Mixed precision inside the step, with Composer's precision names.

* ``'fp32'``: everything in float32.
* ``'amp_bf16'``: float32 master weights and optimizer state; the forward and backward passes
  compute in bfloat16 (the parameters and floating batch leaves are cast inside the step).
* ``'bf16'``: the weights, the optimizer state and the computation are all bfloat16 (half the
  memory of ``'amp_bf16'``, with bf16 rounding of every update).

``'amp_fp16'`` is refused: float16 needs dynamic loss scaling, which composerjax does not
implement; ``'amp_bf16'`` needs none (bfloat16 has float32's exponent range).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["PRECISIONS", "cast_floating", "compute_dtype", "parameter_dtype"]

PRECISIONS = {"fp32": jnp.float32, "amp_bf16": jnp.bfloat16, "bf16": jnp.bfloat16}
_REFUSED = {
    "amp_fp16": "float16 training needs dynamic loss scaling, which composerjax does not implement; use "
                "'amp_bf16' (bfloat16 keeps float32's exponent range, so it needs no loss scaling)",
    "fp16": "pure float16 training is not supported; use 'amp_bf16' or 'bf16'",
    "amp_fp8": "fp8 training is not supported; use 'amp_bf16'",
}


def compute_dtype(precision: str) -> jnp.dtype:
    """The dtype the forward pass computes in for ``precision``.

    Raises:
        ValueError: naming the value and the accepted precisions (and, for ``'amp_fp16'``, why not
            and what to use instead).

    Example:
        >>> compute_dtype("amp_bf16")
        <class 'jax.numpy.bfloat16'>
    """
    if precision in _REFUSED:
        raise ValueError(f"precision={precision!r}: {_REFUSED[precision]}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {', '.join(map(repr, PRECISIONS))}")
    return PRECISIONS[precision]


def parameter_dtype(precision: str) -> jnp.dtype:
    """The dtype the weights and optimizer state are kept in: bfloat16 for ``'bf16'``, else float32.

    Example:
        >>> parameter_dtype("amp_bf16"), parameter_dtype("bf16")
        (<class 'jax.numpy.float32'>, <class 'jax.numpy.bfloat16'>)
    """
    compute_dtype(precision)
    return jnp.bfloat16 if precision == "bf16" else jnp.float32


def cast_floating(tree: Any, dtype: jnp.dtype) -> Any:
    """Cast the floating-point leaves of ``tree`` to ``dtype``; integers and keys are untouched."""
    if dtype == jnp.float32:
        return tree

    def cast(leaf: Any) -> Any:
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating):
            return leaf.astype(dtype)
        return leaf

    return jax.tree.map(cast, tree)
