"""Ghost batch normalization: normalize small chunks of the batch with their own statistics.

Surgery at ``Event.INIT`` (Hoffer et al., 2017): every ``nnx.BatchNorm`` becomes a
:class:`GhostBatchNormLayer` that holds the original layer (its scale, bias and running statistics).
In training each chunk of ``ghost_batch_size`` samples is normalized with its own mean and variance,
which adds the noise of a small batch to a large-batch run; the running statistics move towards the
mean of the chunks' statistics. In evaluation it is the original batch norm.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = ["GhostBatchNorm", "GhostBatchNormLayer", "apply_ghost_batchnorm", "ghost_batch_norm"]


def ghost_batch_norm(x: jax.Array, ghost_batch_size: int, scale: jax.Array | None = None,
                     bias: jax.Array | None = None, epsilon: float = 1e-5
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalize each chunk of ``ghost_batch_size`` samples (axis 0) over all axes but the last.

    A batch of ``N`` samples is cut into ``ceil(N / ghost_batch_size)`` chunks as equal as possible.
    Statistics are computed in float32 as ``nnx.BatchNorm`` does (``var = E[x^2] - E[x]^2``).

    Returns:
        ``(y, mean, var)``: the normalized (then scaled and shifted) ``x``, and the mean over chunks
        of the chunks' means and variances, shape ``(C,)``, for the running statistics.

    Example:
        >>> x = jnp.array([[1.0], [3.0], [10.0], [30.0]])
        >>> y, mean, var = ghost_batch_norm(x, 2)
        >>> y[:, 0].round(3).tolist(), mean.tolist(), var.tolist()
        ([-1.0, 1.0, -1.0, 1.0], [11.0], [50.5])
    """
    size = x.shape[0]
    chunks = max(1, math.ceil(size / ghost_batch_size))
    if size % chunks == 0:
        grouped = x.reshape((chunks, size // chunks, *x.shape[1:]))
        y, means, variances = _normalize_groups(grouped, scale, bias, epsilon)
        y = y.reshape(x.shape)
    else:  # uneven chunks: a static loop, shapes are known while tracing
        bounds = np.cumsum([0] + [len(part) for part in np.array_split(np.arange(size), chunks)]).tolist()
        parts = [_normalize_groups(x[start:stop][None], scale, bias, epsilon)
                 for start, stop in zip(bounds, bounds[1:])]
        y = jnp.concatenate([part[0][0] for part in parts])
        means = jnp.concatenate([part[1] for part in parts])
        variances = jnp.concatenate([part[2] for part in parts])
    return y, jnp.mean(means, axis=0), jnp.mean(variances, axis=0)


def _normalize_groups(grouped: jax.Array, scale: jax.Array | None, bias: jax.Array | None, epsilon: float
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalize ``(G, n, ..., C)`` per group; return ``y`` and the ``(G, C)`` means and variances."""
    stats = grouped.astype(jnp.promote_types(grouped.dtype, jnp.float32))
    axes = tuple(range(1, grouped.ndim - 1))
    mean = stats.mean(axes)
    var = jnp.maximum(0.0, jnp.square(stats).mean(axes) - jnp.square(mean))
    shape = (grouped.shape[0],) + (1,) * (grouped.ndim - 2) + (grouped.shape[-1],)
    y = stats - mean.reshape(shape)
    multiplier = jax.lax.rsqrt(var.reshape(shape) + epsilon)
    if scale is not None:
        multiplier = multiplier * scale
    y = y * multiplier
    if bias is not None:
        y = y + bias
    dtypes = [grouped] + [p for p in (scale, bias) if p is not None]
    return y.astype(jnp.result_type(*dtypes)), mean, var


class GhostBatchNormLayer(nnx.Module):
    """An ``nnx.BatchNorm`` (kept as ``norm``) that normalizes ghost batches while training.

    ``model.train()`` / ``model.eval()`` set ``use_running_average`` as for ``nnx.BatchNorm``; with
    ``use_running_average=True`` this is exactly ``norm``.

    Args:
        norm: a batch norm over the last axis (``axis=-1``, the default).
        ghost_batch_size: the number of samples normalized together.

    Example:
        >>> layer = GhostBatchNormLayer(nnx.BatchNorm(3, rngs=nnx.Rngs(0)), ghost_batch_size=2)
        >>> layer(jnp.ones((4, 3))).shape
        (4, 3)
    """

    def __init__(self, norm: nnx.BatchNorm, ghost_batch_size: int = 32) -> None:
        if norm.axis not in (-1, (-1,)):
            raise ValueError(f"GhostBatchNormLayer: expected a BatchNorm over the last axis; got axis={norm.axis}")
        _check_ghost_batch_size(ghost_batch_size)
        self.norm = norm
        self.ghost_batch_size = ghost_batch_size
        self.use_running_average = norm.use_running_average

    def __call__(self, x: jax.Array, use_running_average: bool | None = None) -> jax.Array:
        use_running_average = use_running_average if use_running_average is not None else self.use_running_average
        if use_running_average:
            return self.norm(x, use_running_average=True)
        norm = self.norm
        scale = norm.scale[...] if norm.scale is not None else None
        bias = norm.bias[...] if norm.bias is not None else None
        x, scale, bias = norm.promote_dtype((x, scale, bias), dtype=norm.dtype)
        y, mean, var = ghost_batch_norm(x, self.ghost_batch_size, scale, bias, norm.epsilon)
        momentum = norm.momentum
        norm.mean[...] = jax.lax.stop_gradient(momentum * norm.mean[...] + (1 - momentum) * mean)
        norm.var[...] = jax.lax.stop_gradient(momentum * norm.var[...] + (1 - momentum) * var)
        return y


def apply_ghost_batchnorm(model: nnx.Module, ghost_batch_size: int = 32) -> int:
    """Replace every last-axis ``nnx.BatchNorm`` of ``model`` with a :class:`GhostBatchNormLayer`; return how many.

    Example:
        >>> from composerjax.models import SmallCNN
        >>> apply_ghost_batchnorm(SmallCNN(channels=4, rngs=nnx.Rngs(0)), ghost_batch_size=8)
        2
    """
    _check_ghost_batch_size(ghost_batch_size)
    already_wrapped = {id(module.norm) for _, module in nnx.iter_modules(model)
                       if isinstance(module, GhostBatchNormLayer)}
    replaced = 0

    def ghost(norm: nnx.BatchNorm) -> nnx.Module:
        nonlocal replaced
        if id(norm) in already_wrapped or norm.axis not in (-1, (-1,)):
            return norm
        replaced += 1
        return GhostBatchNormLayer(norm, ghost_batch_size)

    replace_modules(model, {nnx.BatchNorm: ghost})
    return replaced


class GhostBatchNorm(Algorithm):
    """Normalize chunks of ``ghost_batch_size`` samples separately in training (surgery at ``Event.INIT``).

    Args:
        ghost_batch_size: the samples per ghost batch. A batch no larger than this is plain batch norm.

    Example::

        trainer = Trainer(ComposerClassifier(SmallCNN(rngs=nnx.Rngs(0)), 10), loader, '1ep',
                          algorithms=[GhostBatchNorm(ghost_batch_size=32)])
    """

    required_modules = (nnx.BatchNorm,)

    def __init__(self, ghost_batch_size: int = 32) -> None:
        _check_ghost_batch_size(ghost_batch_size)
        self.ghost_batch_size = ghost_batch_size

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        replaced = apply_ghost_batchnorm(state.model, self.ghost_batch_size)
        logger.log_hyperparameters({"ghost_batchnorm/num_replaced": replaced})
        if replaced == 0:
            warnings.warn("GhostBatchNorm replaced no modules: the model has no nnx.BatchNorm over the last axis",
                          stacklevel=2)

    def __repr__(self) -> str:
        return f"GhostBatchNorm(ghost_batch_size={self.ghost_batch_size})"


def _check_ghost_batch_size(ghost_batch_size: int) -> None:
    if isinstance(ghost_batch_size, bool) or not isinstance(ghost_batch_size, int) or ghost_batch_size < 1:
        raise ValueError(f"ghost_batch_size={ghost_batch_size!r}: expected a positive integer")
