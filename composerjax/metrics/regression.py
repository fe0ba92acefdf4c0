"""Regression metrics on metrax's MSE and MAE: mean squared and mean absolute error over every element."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import metrax
from flax import struct
from metrax.base import divide_no_nan

from composerjax.metrics.metric import Metric, config_field, logits_of, sample_mask

__all__ = ["MeanAbsoluteError", "MeanSquaredError"]


def _weights(mask: jax.Array | None, shape: tuple[int, ...]) -> jax.Array | None:
    """A boolean mask or float sample weights, shaped like a prefix of ``shape``, broadcast to it."""
    weights = sample_mask(mask, shape)
    return None if weights is None else (weights if weights.dtype != bool else weights.astype(jnp.int32))


@struct.dataclass(kw_only=True)
class MeanSquaredError(Metric, metrax.MSE):
    """Mean of ``(preds - target) ** 2`` over every element (torchmetrics' name; sklearn's ``mean_squared_error``).

    ``mask`` may be a boolean mask or float sample weights (metrax's ``sample_weights``), shaped
    like the leading dimensions of ``target``.

    Args:
        squared: False gives the root of the mean (RMSE), as torchmetrics' ``squared=False``.

    Example:
        >>> float(MeanSquaredError().update(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0])).compute())
        2.0
    """

    total: jax.Array | None = None
    count: jax.Array | None = None
    squared: bool = config_field(True)

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> MeanSquaredError:
        """The state of one batch: ``preds`` and ``target`` of one shape."""
        preds, target = jnp.asarray(logits_of(preds), jnp.float32), jnp.asarray(target, jnp.float32)
        batch = metrax.MSE.from_model_output(preds, target, sample_weights=_weights(mask, target.shape))
        return self.replace(total=batch.total, count=batch.count)

    def compute(self) -> jax.Array:
        """The mean squared error (its root when ``squared=False``)."""
        mean = divide_no_nan(self.total, self.count)
        return mean if self.squared else jnp.sqrt(mean)


@struct.dataclass(kw_only=True)
class MeanAbsoluteError(Metric, metrax.MAE):
    """Mean of ``|preds - target|`` over every element (torchmetrics' name; sklearn's ``mean_absolute_error``).

    ``mask`` may be a boolean mask or float sample weights, as for :class:`MeanSquaredError`.

    Example:
        >>> float(MeanAbsoluteError().update(jnp.array([1.0, 2.0]), jnp.array([1.0, 4.0])).compute())
        1.0
    """

    total: jax.Array | None = None
    count: jax.Array | None = None

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> MeanAbsoluteError:
        """The state of one batch: ``preds`` and ``target`` of one shape."""
        preds, target = jnp.asarray(logits_of(preds), jnp.float32), jnp.asarray(target, jnp.float32)
        batch = metrax.MAE.from_model_output(preds, target, sample_weights=_weights(mask, target.shape))
        return self.replace(total=batch.total, count=batch.count)

    def compute(self) -> jax.Array:
        """The mean absolute error."""
        return divide_no_nan(self.total, self.count)
