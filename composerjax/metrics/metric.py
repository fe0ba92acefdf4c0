"""The metric protocol: a configured metric turns a batch into a state; states merge; a state computes its value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import struct

__all__ = ["Metric", "config_field", "flat_classification", "logits_of", "sample_mask"]

M = TypeVar("M", bound="Metric")


def config_field(default: Any = None) -> Any:
    """A setting of a metric (``num_classes``, ``average``): static, part of the state's tree structure."""
    return struct.field(pytree_node=False, default=default)


@struct.dataclass(kw_only=True)
class Metric(clu_metrics.Metric):
    """A metric as a value: settings, plus the sufficient statistics of the batches seen so far.

    Composer's metrics are torchmetrics objects that ``update`` in place and sync across processes
    in ``compute``. Here a metric is a ``flax.struct`` dataclass (a ``clu.metrics.Metric``, as
    metrax's are): :meth:`update` returns a new metric, :meth:`merge` adds two states, and the
    states are pytrees, so they are computed inside the compiled eval step on global arrays and
    need no sync. A metric that has seen no batch holds ``None`` for its state: that is the object
    ``ComposerModel.get_metrics`` returns (hashable, safe to keep on an ``nnx.Module``).

    Subclasses define :meth:`batch_state` (the statistics of one batch, as a metric with the same
    settings) and ``compute``; the default :meth:`merge` adds the state leaf by leaf, right for
    counts and sums.

    Example:
        >>> from composerjax.metrics import MulticlassAccuracy
        >>> metric = MulticlassAccuracy(num_classes=3)
        >>> state = metric.update(jnp.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]]), jnp.array([1, 2]))
        >>> round(float(state.merge(metric.update(jnp.array([[0.0, 0.0, 1.0]]), jnp.array([2]))).compute()), 4)
        0.6667
    """

    #: A state that keeps every sample (AUROC) merges by appending its per-batch arrays: no device
    #: work per batch, one concatenation in ``compute``.
    collects: ClassVar[bool] = False

    def batch_state(self: M, *args: Any, **kwargs: Any) -> M:
        """Return the state of one batch, with this metric's settings."""
        raise NotImplementedError(f"{type(self).__name__} must implement batch_state(...)")

    def update(self: M, *args: Any, **kwargs: Any) -> M:
        """Return this metric with one more batch merged in (a new object; ``self`` is unchanged)."""
        return self.merge(self.batch_state(*args, **kwargs))

    @classmethod
    def from_model_output(cls: type[M], *args: Any, **kwargs: Any) -> M:
        """clu's constructor: the state of one batch for a metric with default settings."""
        return cls().batch_state(*args, **kwargs)

    @classmethod
    def empty(cls: type[M]) -> M:
        """A metric with default settings that has seen no batch."""
        return cls()

    @property
    def has_state(self) -> bool:
        """Whether this metric has seen a batch (a static fact: it is the pytree's structure)."""
        return bool(jax.tree.leaves(self))

    def merge(self: M, other: M) -> M:
        """Return the state of both ``self``'s and ``other``'s batches."""
        if not other.has_state:
            return self
        if not self.has_state:
            return other
        return jax.tree.map(jnp.add, self, other)

    def reset(self: M) -> M:
        """The same metric with no batch seen."""
        settings = {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                    if not field.metadata.get("pytree_node", True)}
        return type(self)(**settings)


def logits_of(outputs: Any) -> jax.Array:
    """The predictions in a model's outputs: the outputs themselves, or ``outputs['logits']`` (as Composer reads)."""
    return outputs["logits"] if isinstance(outputs, Mapping) else outputs


def sample_mask(mask: jax.Array | None, shape: tuple[int, ...]) -> jax.Array | None:
    """``mask`` (shaped like the leading dimensions of ``shape``) broadcast to ``shape``."""
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    return jnp.broadcast_to(mask.reshape(mask.shape + (1,) * (len(shape) - mask.ndim)), shape)


def flat_classification(preds: Any, target: jax.Array, mask: jax.Array | None, ignore_index: int | None
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(scores (M, C), labels (M,), valid (M,))`` from ``(..., C)`` scores and ``(...)`` labels.

    One-hot or soft targets (same rank as the scores) count as their argmax. A sample is valid
    when its label is not ``ignore_index`` and ``mask`` (any shape that prefixes the labels') is
    true there; invalid labels are replaced by 0 so they index safely, and count nowhere.
    """
    scores = logits_of(preds)
    target = jnp.asarray(target)
    labels = jnp.argmax(target, axis=-1) if target.ndim == scores.ndim else target
    labels = labels.astype(jnp.int32)
    valid = jnp.ones(labels.shape, bool)
    if ignore_index is not None:
        valid = valid & (labels != ignore_index)
    if mask is not None:
        valid = valid & (sample_mask(mask, labels.shape) != 0)
    labels, valid = labels.reshape(-1), valid.reshape(-1)
    return scores.reshape(-1, scores.shape[-1]), jnp.where(valid, labels, 0), valid
