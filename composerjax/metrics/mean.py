"""MeanMetric: a weighted mean, and the ``{name: (sum, count)}`` pairs of ``ComposerModel.metrics`` as metrics."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import metrax
from flax import struct
from metrax.base import divide_no_nan

from composerjax.metrics.metric import Metric, sample_mask

__all__ = ["MeanMetric", "mean_metrics"]


@struct.dataclass(kw_only=True)
class MeanMetric(Metric, metrax.Average):
    """The mean of values over every batch (torchmetrics' name), kept as (sum, count).

    ``update(values, weights=None)`` adds ``sum(values * weights)`` and ``sum(weights)``; a
    ``(sum, count)`` pair from ``ComposerModel.metrics`` becomes one with :meth:`from_sum`.

    Example:
        >>> state = MeanMetric().update(jnp.array([1.0, 2.0]))
        >>> float(state.merge(MeanMetric.from_sum(jnp.float32(6.0), jnp.float32(1.0))).compute())
        3.0
    """

    total: jax.Array | None = None
    count: jax.Array | None = None

    def batch_state(self, values: jax.Array, weights: jax.Array | None = None) -> MeanMetric:
        """The state of one batch of ``values`` (weights: a boolean mask or floats, a prefix of their shape)."""
        values = jnp.asarray(values, jnp.float32)
        weights = sample_mask(weights, values.shape)
        batch = metrax.Average.from_model_output(values, None if weights is None else weights.astype(jnp.float32))
        return self.replace(total=batch.total, count=batch.count)

    @classmethod
    def from_sum(cls, total: Any, count: Any) -> MeanMetric:
        """The state whose sum is ``total`` over ``count`` samples."""
        return cls(total=jnp.asarray(total, jnp.float32), count=jnp.asarray(count, jnp.float32))

    def compute(self) -> jax.Array:
        """Sum over count (0 when nothing was counted)."""
        return divide_no_nan(self.total, self.count)


def mean_metrics(sums: dict[str, tuple[Any, Any]]) -> dict[str, MeanMetric]:
    """``{name: (sum, count)}`` (what ``ComposerModel.metrics`` returns) as ``{name: MeanMetric}`` states.

    Example:
        >>> states = mean_metrics({"loss": (jnp.float32(3.0), jnp.float32(4.0))})
        >>> float(states["loss"].compute())
        0.75
    """
    return {name: MeanMetric.from_sum(total, count) for name, (total, count) in sums.items()}
