"""Cross-entropy metrics on metrax's Average: CrossEntropy, LanguageCrossEntropy, LanguagePerplexity."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import metrax
import optax
from flax import struct
from metrax.base import divide_no_nan

from composerjax.metrics.metric import Metric, config_field, logits_of, sample_mask

__all__ = ["CrossEntropy", "LanguageCrossEntropy", "LanguagePerplexity"]


@struct.dataclass(kw_only=True)
class CrossEntropy(Metric, metrax.Average):
    """Mean softmax cross-entropy of logits per sample (token) over every batch (Composer's name).

    Targets are integer labels (``(...)`` for ``(..., C)`` logits; ``ignore_index`` is left out, as
    Composer's) or one-hot / soft targets of the logits' shape. The state is (sum of losses,
    number of samples), so the value is the mean over samples, equal to sklearn's ``log_loss``
    over all batches: Composer's own ``CrossEntropy`` averages the per-batch means instead, which
    differs when batches differ in size.

    Args:
        ignore_index: an integer label that is left out (padding), or None.

    Example:
        >>> logits = jnp.log(jnp.array([[0.5, 0.5], [0.25, 0.75]]))
        >>> round(float(CrossEntropy().update(logits, jnp.array([0, -100])).compute()), 4)  # -log(0.5)
        0.6931
    """

    total: jax.Array | None = None
    count: jax.Array | None = None
    ignore_index: int | None = config_field(-100)

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> Any:
        """One batch: ``preds`` ``(..., C)`` logits (or ``{'logits': ...}``), ``target`` labels or soft targets."""
        logits = jnp.asarray(logits_of(preds)).astype(jnp.float32)
        target = jnp.asarray(target)
        if target.ndim == logits.ndim:
            losses = optax.softmax_cross_entropy(logits, target.astype(jnp.float32))
            valid = jnp.ones(losses.shape, bool)
        else:
            labels = target.astype(jnp.int32)
            valid = jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, labels, 0))
        if mask is not None:
            valid = valid & (sample_mask(mask, losses.shape) != 0)
        # Counted in int32: a language model's eval set can hold more tokens than float32 counts exactly.
        return self.replace(total=jnp.sum(jnp.where(valid, losses, 0.0)), count=jnp.sum(valid, dtype=jnp.int32))

    def batch_state_from_losses(self, losses: jax.Array, target: jax.Array, mask: jax.Array | None = None) -> Any:
        """One batch from per-sample losses already computed (a chunked LM head's), ``target`` the integer labels.

        The same state :meth:`batch_state` gives for the logits those losses came from: labels equal
        to ``ignore_index`` (and samples ``mask`` leaves out) are not counted.

        Example:
            >>> losses = jnp.array([0.5, 1.5, 9.0])
            >>> float(CrossEntropy().batch_state_from_losses(losses, jnp.array([3, 1, -100])).compute())
            1.0
        """
        losses = jnp.asarray(losses, jnp.float32)
        labels = jnp.asarray(target)
        valid = jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index
        if mask is not None:
            valid = valid & (sample_mask(mask, losses.shape) != 0)
        return self.replace(total=jnp.sum(jnp.where(valid, losses, 0.0)), count=jnp.sum(valid, dtype=jnp.int32))

    def compute(self) -> jax.Array:
        """The mean cross-entropy per counted sample."""
        return divide_no_nan(self.total, self.count)


@struct.dataclass(kw_only=True)
class LanguageCrossEntropy(CrossEntropy):
    """Composer's language-model cross-entropy: mean over tokens, ``ignore_index=-100`` left out.

    ``preds`` are ``(N, T, V)`` logits (or ``{'logits': ...}``), ``target`` ``(N, T)`` token ids.

    Example:
        >>> logits = jnp.zeros((1, 3, 4))  # uniform over 4 tokens
        >>> round(float(LanguageCrossEntropy().update(logits, jnp.array([[1, 2, -100]])).compute()), 4)
        1.3863
    """


@struct.dataclass(kw_only=True)
class LanguagePerplexity(LanguageCrossEntropy):
    """Composer's perplexity: ``exp`` of :class:`LanguageCrossEntropy` over every token seen.

    Example:
        >>> logits = jnp.zeros((1, 3, 4))
        >>> round(float(LanguagePerplexity().update(logits, jnp.array([[1, 2, -100]])).compute()), 4)
        4.0
    """

    def compute(self) -> jax.Array:
        """``exp`` of the mean cross-entropy."""
        return jnp.exp(super().compute())
