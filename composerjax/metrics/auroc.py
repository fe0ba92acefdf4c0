"""Exact AUROC: every score and label is kept and ranked once, not binned on a threshold grid as metrax's AUCROC."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from metrax.base import divide_no_nan

from composerjax.metrics.metric import Metric, config_field, flat_classification, logits_of, sample_mask

__all__ = ["BinaryAUROC", "MulticlassAUROC", "rank_auc"]


def rank_auc(scores: jax.Array, positive: jax.Array, valid: jax.Array) -> jax.Array:
    """The area under the ROC curve of ``scores`` for the ``positive`` samples among the ``valid`` ones.

    The Mann-Whitney statistic: the fraction of (positive, negative) pairs the scores order
    correctly, a tie counting one half, which is the trapezoidal area under the exact ROC curve
    (sklearn's ``roc_auc_score``). Sorted once; ties are found as runs of equal sorted scores.
    0 when there is no positive or no negative.

    Example:
        >>> float(rank_auc(jnp.array([0.1, 0.4, 0.4, 0.8]), jnp.array([False, False, True, True]),
        ...                jnp.ones(4, bool)))
        0.875
    """
    order = jnp.argsort(scores)
    sorted_scores, valid = scores[order], valid[order]
    positive = positive[order] & valid
    negative = valid & ~positive
    starts = jnp.concatenate([jnp.ones((1,), bool), sorted_scores[1:] != sorted_scores[:-1]])
    group = jnp.cumsum(starts) - 1  # the tie group of each sorted sample
    group_negatives = jax.ops.segment_sum(negative.astype(jnp.int32), group, num_segments=scores.shape[0])
    below = jnp.cumsum(group_negatives) - group_negatives  # negatives scored strictly lower than the group
    negatives = negative.sum()
    # Each positive's share of negatives it beats (ties half): a number in [0, 1], summed in float32.
    beaten = (below[group] + 0.5 * group_negatives[group]) / jnp.maximum(negatives, 1)
    auc = divide_no_nan(jnp.sum(jnp.where(positive, beaten, 0.0)), positive.sum().astype(jnp.float32))
    return jnp.where(negatives > 0, auc, 0.0)


@struct.dataclass(kw_only=True)
class _Collected(Metric):
    """Keeps every batch's scores, labels and validity; merging appends (no device work), ``compute`` concatenates."""

    collects = True
    scores: tuple[jax.Array, ...] | None = None
    labels: tuple[jax.Array, ...] | None = None
    valid: tuple[jax.Array, ...] | None = None

    def merge(self, other: Any) -> Any:
        """Both states' samples, in order."""
        if not other.has_state:
            return self
        if not self.has_state:
            return other
        return self.replace(scores=self.scores + other.scores, labels=self.labels + other.labels,
                            valid=self.valid + other.valid)

    def _samples(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return (jnp.concatenate(self.scores), jnp.concatenate(self.labels), jnp.concatenate(self.valid))


@struct.dataclass(kw_only=True)
class BinaryAUROC(_Collected):
    """Area under the ROC curve of scores for 0/1 labels, exact (torchmetrics' name; ``thresholds=None``).

    The state keeps every score, so the value equals sklearn's ``roc_auc_score`` over all batches,
    devices and processes (ties count one half). Any monotone scores work (logits or
    probabilities: torchmetrics' sigmoid for logits would not change the ranks).

    Args:
        ignore_index: a label value that is left out, or None.

    Example:
        >>> metric = BinaryAUROC()
        >>> state = metric.update(jnp.array([0.1, 0.4]), jnp.array([0, 0]))
        >>> float(state.merge(metric.update(jnp.array([0.4, 0.8]), jnp.array([1, 1]))).compute())
        0.875
    """

    ignore_index: int | None = config_field()

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> BinaryAUROC:
        """One batch: ``preds`` scores and ``target`` 0/1 labels of one shape, ``mask`` a prefix of it."""
        scores, labels = jnp.asarray(logits_of(preds)).reshape(-1), jnp.asarray(target).reshape(-1).astype(jnp.int32)
        valid = jnp.ones(labels.shape, bool) if mask is None else (sample_mask(mask, jnp.shape(target)) != 0).ravel()
        if self.ignore_index is not None:
            valid = valid & (labels != self.ignore_index)
        return self.replace(scores=(scores.astype(jnp.float32),), labels=(labels,), valid=(valid,))

    def compute(self) -> jax.Array:
        """The AUROC of every sample seen."""
        scores, labels, valid = self._samples()
        return rank_auc(scores, labels == 1, valid)


@struct.dataclass(kw_only=True)
class MulticlassAUROC(_Collected):
    """One-vs-rest AUROC per class, averaged, exact (torchmetrics' name; sklearn's ``multi_class='ovr'``).

    As torchmetrics, a batch of scores outside ``[0, 1]`` counts as logits and goes through a
    softmax first (the per-class ranks of logits and of probabilities differ). ``average='macro'``
    is the mean over the classes that have both positive and negative samples; ``'weighted'``
    weighs each class by its label count (sklearn's ``average='weighted'``).

    Args:
        num_classes: ``C``, the scores' last dimension.
        average: ``'macro'`` or ``'weighted'``.
        ignore_index: a label value that is left out, or None.

    Example:
        >>> probabilities = jnp.array([[0.7, 0.2, 0.1], [0.2, 0.5, 0.3], [0.1, 0.3, 0.6], [0.3, 0.4, 0.3]])
        >>> metric = MulticlassAUROC(num_classes=3)
        >>> round(float(metric.update(probabilities, jnp.array([0, 1, 2, 2])).compute()), 4)
        0.9583
    """

    num_classes: int = config_field()
    average: str = config_field("macro")
    ignore_index: int | None = config_field()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        if not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool) or self.num_classes < 2:
            raise ValueError(f"{owner}(num_classes={self.num_classes!r}): expected an integer >= 2")
        if self.average not in ("macro", "weighted"):
            raise ValueError(f"{owner}(average={self.average!r}): expected 'macro' or 'weighted'")

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> MulticlassAUROC:
        """One batch: ``preds`` ``(..., C)`` scores, ``target`` ``(...)`` labels, ``mask`` a prefix of theirs."""
        scores, labels, valid = flat_classification(preds, target, mask, self.ignore_index)
        if scores.shape[-1] != self.num_classes:
            raise ValueError(f"MulticlassAUROC(num_classes={self.num_classes}): the predictions have "
                             f"{scores.shape[-1]} scores per sample; expected one per class")
        scores = scores.astype(jnp.float32)
        probabilities = jnp.all(jnp.where(valid[:, None], (scores >= 0) & (scores <= 1), True))
        scores = jnp.where(probabilities, scores, jax.nn.softmax(scores, axis=-1))
        return self.replace(scores=(scores,), labels=(labels,), valid=(valid,))

    def compute(self) -> jax.Array:
        """The averaged one-vs-rest AUROC of every sample seen."""
        scores, labels, valid = self._samples()
        positive = (labels[:, None] == jnp.arange(self.num_classes)) & valid[:, None]
        per_class = jax.vmap(rank_auc, in_axes=(1, 1, None))(scores, positive, valid)
        positives = positive.sum(axis=0)
        if self.average == "weighted":
            return divide_no_nan(jnp.sum(per_class * positives), positives.sum())
        defined = (positives > 0) & (positives < valid.sum())
        return divide_no_nan(jnp.sum(jnp.where(defined, per_class, 0.0)), defined.sum())
