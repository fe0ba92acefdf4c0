"""Gradient clipping: bound the gradient by its global norm, its values, or unit-wise against the weights.

The functional form is :func:`clip_gradients` (built on optax's ``clip_by_global_norm``, ``clip`` and
``adaptive_grad_clip``); :class:`GradientClipping` applies it to ``state.grads`` at
``AFTER_TRAIN_BATCH``, as Composer does: inside the compiled step, after the gradients of every
microbatch are accumulated and before the optimizer update, so the result is the same with or
without ``device_train_microbatch_size`` (clipping at ``AFTER_BACKWARD`` would clip each
microbatch's gradient instead).
"""

from __future__ import annotations

from typing import Any

import optax

from composerjax import Algorithm, Event, Logger, State

__all__ = ["CLIPPING_TYPES", "GradientClipping", "clip_gradients", "clipping_transform"]

#: The accepted ``clipping_type`` values.
CLIPPING_TYPES = ("norm", "value", "adaptive")


def _check_arguments(clipping_type: str, clipping_threshold: float) -> None:
    if clipping_type not in CLIPPING_TYPES:
        raise ValueError(f"clipping_type={clipping_type!r}: expected one of {', '.join(map(repr, CLIPPING_TYPES))}")
    if (isinstance(clipping_threshold, bool) or not isinstance(clipping_threshold, (int, float))
            or not clipping_threshold > 0):
        raise ValueError(f"clipping_threshold={clipping_threshold!r}: expected a positive number")


def clipping_transform(clipping_type: str = "norm", clipping_threshold: float = 1.0) -> optax.GradientTransformation:
    """Return the optax transform that clips gradients the way ``clipping_type`` names.

    * ``'norm'``: ``optax.clip_by_global_norm``: scale the whole gradient down so its global L2
      norm is at most ``clipping_threshold``.
    * ``'value'``: ``optax.clip``: clip every element to ``[-clipping_threshold, clipping_threshold]``.
    * ``'adaptive'``: ``optax.adaptive_grad_clip`` (AGC, Brock et al. 2021): scale each unit's
      gradient (a column of a dense kernel, an output channel of a conv kernel, a whole bias) down
      so its norm is at most ``clipping_threshold * max(norm of that unit's weights, 1e-3)``.

    Raises:
        ValueError: for an unknown ``clipping_type`` or a threshold that is not positive.

    Example:
        >>> import jax.numpy as jnp
        >>> clip = clipping_transform('value', 0.5)
        >>> clip.update(jnp.array([2.0, -0.1]), clip.init(None))[0]
        Array([ 0.5, -0.1], dtype=float32)
    """
    _check_arguments(clipping_type, clipping_threshold)
    if clipping_type == "norm":
        return optax.clip_by_global_norm(clipping_threshold)
    if clipping_type == "value":
        return optax.clip(clipping_threshold)
    return optax.adaptive_grad_clip(clipping_threshold)


def clip_gradients(grads: Any, params: Any, clipping_type: str = "norm", clipping_threshold: float = 1.0) -> Any:
    """Return ``grads`` clipped by ``clipping_type`` (see :func:`clipping_transform`); pure and jit-able.

    Args:
        grads: a pytree of gradients.
        params: the parameters ``grads`` belong to (same structure); only ``'adaptive'`` reads them.
        clipping_type: ``'norm'``, ``'value'`` or ``'adaptive'``.
        clipping_threshold: the global norm, the absolute value, or the gradient-to-weight norm
            ratio allowed.

    Example:
        >>> import jax.numpy as jnp
        >>> clip_gradients({'w': jnp.array([3.0, 4.0])}, None, 'norm', 1.0)['w']
        Array([0.6, 0.8], dtype=float32)
    """
    transform = clipping_transform(clipping_type, clipping_threshold)
    clipped, _ = transform.update(grads, transform.init(params), params)
    return clipped


class GradientClipping(Algorithm):
    """Clip the whole batch's gradient before every optimizer update.

    At ``AFTER_TRAIN_BATCH`` (traced, Composer's event) ``state.grads``, the whole batch's
    gradient, is replaced by its clipped value, which the optimizer then applies. It matches every
    batch, so the step compiles once; nothing runs per step on the host.

    Args:
        clipping_type: ``'norm'`` (clip the global L2 norm), ``'value'`` (clip each element) or
            ``'adaptive'`` (AGC: clip each unit's gradient norm relative to its weight norm).
            Default: ``'norm'``.
        clipping_threshold: the bound: the maximum global norm, the maximum absolute value, or
            the maximum gradient-to-weight norm ratio. Default: ``1.0``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.gradient_clipping import GradientClipping

        trainer = Trainer(model, train_loader, '10ep', optax.adam(1e-3),
                          algorithms=[GradientClipping(clipping_type='norm', clipping_threshold=1.0)])
        trainer.fit()
    """

    def __init__(self, clipping_type: str = "norm", clipping_threshold: float = 1.0) -> None:
        _check_arguments(clipping_type, clipping_threshold)
        self.clipping_type = clipping_type
        self.clipping_threshold = float(clipping_threshold)

    events = frozenset({Event.AFTER_TRAIN_BATCH})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Clip ``state.grads`` (traced) before the optimizer applies them."""
        state.grads = clip_gradients(state.grads, state.params, self.clipping_type, self.clipping_threshold)

    def __repr__(self) -> str:
        return f"GradientClipping(clipping_type={self.clipping_type!r}, clipping_threshold={self.clipping_threshold})"
