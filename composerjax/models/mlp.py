"""MLP: a stack of dense layers with ReLU between them, for flat features."""

from __future__ import annotations

from collections.abc import Sequence

import jax
from flax import nnx

__all__ = ["MLP"]


class MLP(nnx.Module):
    """Dense layers of the given ``sizes`` (input features first, outputs last), ReLU between them.

    Inputs are flattened after the batch axis, so ``(N, 8, 8)`` images work with ``sizes[0] == 64``.

    Example:
        >>> import jax.numpy as jnp
        >>> MLP([64, 32, 10], rngs=nnx.Rngs(0))(jnp.zeros((2, 8, 8))).shape
        (2, 10)
    """

    def __init__(self, sizes: Sequence[int], *, rngs: nnx.Rngs) -> None:
        sizes = list(sizes)
        if len(sizes) < 2 or not all(isinstance(size, int) and not isinstance(size, bool) and size > 0
                                     for size in sizes):
            raise ValueError(f"MLP(sizes={sizes!r}): expected at least two positive integers "
                             "(input features, ..., outputs)")
        self.layers = nnx.List([nnx.Linear(n_in, n_out, rngs=rngs) for n_in, n_out in zip(sizes[:-1], sizes[1:])])

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.reshape(x.shape[0], -1)
        for layer in self.layers[:-1]:
            x = nnx.relu(layer(x))
        return self.layers[-1](x)
