"""Recomputation in the backward pass that XLA keeps where it belongs: after the gradient arrives.

``jax.checkpoint`` marks what the backward pass recomputes instead of keeping, but in a program
without a loop nothing orders that recomputation after the backward pass of the layers above, and
XLA may run it early, keeping what the checkpoint meant to drop (XLA:CPU does: its compiled memory
is the same with and without ``jax.checkpoint`` around each block of an unrolled model).
:func:`checkpoint_after_gradient` makes the saved residuals depend on the incoming gradient
(``residual + 0 * g``), so the recomputation cannot start before that gradient exists. Inside
``lax.scan`` the loop already orders it and plain ``jax.checkpoint`` is enough.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["REMAT", "checkpoint_after_gradient", "padded_initializer", "with_remat"]

#: The ``remat`` settings of the language models: what the backward pass recomputes.
REMAT = ("none", "dots", "full")


def checkpoint_after_gradient(function: Callable[..., Any], policy: Callable[..., bool] | None = None
                              ) -> Callable[..., Any]:
    """``function`` under ``jax.checkpoint(policy=policy)``, its recomputation ordered after the incoming gradient.

    ``policy`` None keeps only the inputs (everything is recomputed); a ``jax.checkpoint_policies``
    policy keeps what it names. Values and gradients are ``function``'s. A non-finite incoming
    gradient makes the gradients non-finite, as it would anyway.

    Example:
        >>> layer = checkpoint_after_gradient(lambda w, x: jnp.tanh(x @ w))
        >>> w, x = jnp.ones((3, 3)), jnp.ones((2, 3))
        >>> bool(jnp.allclose(jax.grad(lambda w: layer(w, x).sum())(w),
        ...                   jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)))
        True
    """
    checkpointed = jax.checkpoint(function, policy=policy)

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        return checkpointed(*args)

    def forward(*args: Any) -> tuple[Any, Any]:
        return jax.vjp(checkpointed, *args)

    def backward(pullback: Any, grad: Any) -> Any:
        floating = [leaf for leaf in jax.tree.leaves(grad) if jnp.issubdtype(leaf.dtype, jnp.inexact) and leaf.size]
        if not floating:
            return pullback(grad)
        zero = floating[0].reshape(-1)[0] * 0
        pullback = jax.tree.map(
            lambda saved: saved + zero.astype(saved.dtype) if jnp.issubdtype(saved.dtype, jnp.inexact) else saved,
            pullback)
        return pullback(grad)

    run.defvjp(forward, backward)
    return run


def with_remat(function: Callable[..., Any], remat: str, scanned: bool = False) -> Callable[..., Any]:
    """``function`` (one block) under a model's ``remat`` setting: ``'none'``, ``'dots'`` or ``'full'``.

    ``'dots'`` saves the matmul outputs without batch dimensions (the projections and the MLP) and
    recomputes the rest; ``'full'`` saves nothing but the block's input. ``scanned``: the function
    is a ``lax.scan`` body, where the loop orders the recomputation and plain ``jax.checkpoint``
    is enough; unrolled, :func:`checkpoint_after_gradient` orders it after the incoming gradient.

    Example:
        >>> layer = with_remat(lambda x: jnp.tanh(x) * 2, "full")
        >>> float(jax.grad(lambda x: layer(x).sum())(jnp.zeros(3))[0])
        2.0
    """
    if remat == "none":
        return function
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable if remat == "dots" else None
    if scanned:
        return jax.checkpoint(function, policy=policy, prevent_cse=False)
    return checkpoint_after_gradient(function, policy)


def padded_initializer(initializer: Callable[..., Any], size: int, axis: int) -> Callable[..., Any]:
    """``initializer`` for the first ``size`` entries along ``axis`` (the real vocabulary); the padding is zero.

    Example:
        >>> init = padded_initializer(jax.nn.initializers.ones, 2, 0)
        >>> init(jax.random.key(0), (4, 1)).ravel().tolist()
        [1.0, 1.0, 0.0, 0.0]
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        real = list(shape)
        real[axis] = size
        pad = [(0, 0)] * len(shape)
        pad[axis] = (0, shape[axis] - size)
        return jnp.pad(initializer(key, tuple(real), dtype), pad)

    return init
