"""Ghost batch normalization: normalize small chunks of the batch with their own statistics.

Surgery at ``Event.INIT`` (Hoffer et al., 2017): every ``nnx.BatchNorm`` becomes a
:class:`GhostBatchNormLayer` that holds the original layer (its scale, bias and running statistics).
In training the batch is cut as Composer cuts it (``torch.chunk`` into ``ceil(N / ghost_batch_size)``
chunks) and each chunk is a separate batch norm call: normalized with its own mean and variance, and
updating the running statistics in turn with the momentum spread over the chunks. In evaluation it is
the original batch norm.
"""

from __future__ import annotations

import math
import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "GhostBatchNorm",
    "GhostBatchNormLayer",
    "apply_ghost_batchnorm",
    "chunk_sizes",
    "ghost_batch_norm",
    "ghost_batch_sizes",
    "update_running_stat",
]


def chunk_sizes(size: int, num_chunks: int) -> list[int]:
    """The sizes ``torch.chunk`` cuts ``size`` rows into when asked for ``num_chunks`` chunks.

    Every chunk has ``ceil(size / num_chunks)`` rows but the last, which holds what is left; so
    there can be fewer chunks than asked.

    Example:
        >>> chunk_sizes(10, 3), chunk_sizes(6, 4)
        ([4, 4, 2], [2, 2, 2])
    """
    if size < 1 or num_chunks < 1:
        raise ValueError(f"chunk_sizes(size={size!r}, num_chunks={num_chunks!r}): expected positive integers")
    step = math.ceil(size / num_chunks)
    return [min(step, size - start) for start in range(0, size, step)]


def ghost_batch_sizes(batch_size: int, ghost_batch_size: int) -> list[int]:
    """The ghost batches a batch of ``batch_size`` samples is cut into, as Composer cuts it.

    ``num_chunks = ceil(batch_size / ghost_batch_size)``, then :func:`chunk_sizes`: every ghost
    batch but the last has ``ceil(batch_size / num_chunks)`` samples.

    Raises:
        ValueError: ``batch_size`` is smaller than ``ghost_batch_size`` (Composer refuses it too).

    Example:
        >>> ghost_batch_sizes(10, 4), ghost_batch_sizes(40, 32)
        ([4, 4, 2], [20, 20])
    """
    _check_ghost_batch_size(ghost_batch_size)
    if batch_size < ghost_batch_size:
        raise ValueError(f"GhostBatchNorm: the batch has {batch_size} samples, fewer than ghost_batch_size="
                         f"{ghost_batch_size}; use a ghost_batch_size of at most the per-step (micro)batch size")
    return chunk_sizes(batch_size, math.ceil(batch_size / ghost_batch_size))


def ghost_batch_norm(x: jax.Array, ghost_batch_size: int, scale: jax.Array | None = None,
                     bias: jax.Array | None = None, epsilon: float = 1e-5
                     ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normalize each ghost batch of ``x`` (axis 0) over all axes but the last, with its own statistics.

    The ghost batches are :func:`ghost_batch_sizes`. Statistics are computed in float32 as
    ``nnx.BatchNorm`` does (``var = E[x^2] - E[x]^2``).

    Returns:
        ``(y, means, variances)``: the normalized (then scaled and shifted) ``x``, and each ghost
        batch's mean and variance, shape ``(num_ghost_batches, C)``, in batch order.

    Example:
        >>> x = jnp.array([[1.0], [3.0], [10.0], [30.0]])
        >>> y, means, variances = ghost_batch_norm(x, 2)
        >>> y[:, 0].round(3).tolist(), means[:, 0].tolist(), variances[:, 0].tolist()
        ([-1.0, 1.0, -1.0, 1.0], [2.0, 20.0], [1.0, 100.0])
    """
    size = x.shape[0]
    step = ghost_batch_sizes(size, ghost_batch_size)[0]
    full = size // step * step  # rows in ghost batches of the full size; the rest is one smaller batch
    parts = [_normalize_groups(x[:full].reshape((full // step, step, *x.shape[1:])), scale, bias, epsilon)]
    if full < size:
        parts.append(_normalize_groups(x[full:][None], scale, bias, epsilon))
    y = jnp.concatenate([part[0].reshape((-1, *x.shape[1:])) for part in parts])
    return y, jnp.concatenate([part[1] for part in parts]), jnp.concatenate([part[2] for part in parts])


def update_running_stat(running: jax.Array, ghost_stats: jax.Array, momentum: float, num_chunks: int) -> jax.Array:
    """Move ``running`` towards each ghost batch's statistic in turn, as Composer's sequential batch norm calls do.

    Composer divides the torch momentum (``1 - momentum`` here, flax's convention) by
    ``num_chunks`` and runs one batch norm call per ghost batch, so with
    ``rate = (1 - momentum) / num_chunks`` each ghost batch ``k`` does
    ``running = (1 - rate) * running + rate * ghost_stats[k]``. Computed in closed form.

    Example:
        >>> update_running_stat(jnp.array([0.0]), jnp.array([[4.0], [8.0]]), momentum=0.0, num_chunks=2).tolist()
        [5.0]
    """
    rate = (1.0 - momentum) / num_chunks
    count = ghost_stats.shape[0]
    kept = (1.0 - rate) ** jnp.arange(count - 1, -1, -1, dtype=ghost_stats.dtype)  # (1 - rate)^(K-1-k)
    return (1.0 - rate) ** count * running + rate * jnp.tensordot(kept, ghost_stats, axes=1)


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

    In training, each ghost batch (:func:`ghost_batch_sizes`) is normalized with its own statistics
    and moves the running statistics in turn (:func:`update_running_stat`), as Composer's one batch
    norm call per ghost batch does; a batch smaller than ``ghost_batch_size`` raises ValueError.
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
        y, means, variances = ghost_batch_norm(x, self.ghost_batch_size, scale, bias, norm.epsilon)
        num_chunks = math.ceil(x.shape[0] / self.ghost_batch_size)
        norm.mean[...] = jax.lax.stop_gradient(update_running_stat(norm.mean[...], means, norm.momentum, num_chunks))
        norm.var[...] = jax.lax.stop_gradient(update_running_stat(norm.var[...], variances, norm.momentum, num_chunks))
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
        ghost_batch_size: the samples per ghost batch (Composer's cut: ``ceil(N / ghost_batch_size)``
            chunks of ``ceil(N / num_chunks)`` samples, the last one smaller). A training batch equal to
            it is plain batch norm; a smaller one raises ValueError, as in Composer. Default: ``32``.

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
