"""Classification metrics: accuracy (top-k, binary, masked) on metrax, precision/recall/F1 on a confusion matrix."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import metrax
from flax import struct
from metrax.base import divide_no_nan

from composerjax.metrics.metric import Metric, config_field, flat_classification, logits_of, sample_mask

__all__ = ["BinaryAccuracy", "MaskedAccuracy", "MulticlassAccuracy", "MulticlassF1Score", "MulticlassPrecision",
           "MulticlassRecall"]


def _check_classes(owner: str, num_classes: Any) -> None:
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
        raise ValueError(f"{owner}(num_classes={num_classes!r}): expected an integer >= 2")


def _check_choice(owner: str, name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{owner}({name}={value!r}): expected one of {', '.join(map(repr, allowed))}")


def _check_scores(owner: str, scores: jax.Array, num_classes: int) -> None:
    if scores.shape[-1] != num_classes:
        raise ValueError(f"{owner}(num_classes={num_classes}): the predictions have {scores.shape[-1]} scores per "
                         "sample (last dimension); expected one per class")


def _macro(per_class: jax.Array, present: jax.Array) -> jax.Array:
    """The mean of ``per_class`` over the classes ``present`` (sklearn's and torchmetrics' macro average)."""
    return divide_no_nan(jnp.sum(jnp.where(present, per_class, 0.0)), jnp.sum(present))


@struct.dataclass(kw_only=True)
class MulticlassAccuracy(Metric, metrax.Accuracy):
    """The fraction of samples whose label is among the ``top_k`` highest scores (torchmetrics' name).

    ``average='micro'`` (the default, as Composer's classifier sets it) counts every sample once;
    ``'macro'`` averages the per-class accuracy (recall) over the classes that occur in the
    labels: sklearn's ``balanced_accuracy_score``. Scores ``(..., C)`` are flattened with their
    labels ``(...)``; one-hot or soft targets count as their argmax. Ties among scores go to the
    lower class index (``argmax``, ``lax.top_k``).

    Args:
        num_classes: ``C``, the scores' last dimension.
        top_k: a sample is right when its label is among this many highest scores.
        average: ``'micro'`` or ``'macro'``.
        ignore_index: a label value that is left out (padding), or None.

    Example:
        >>> metric = MulticlassAccuracy(num_classes=3, top_k=2)
        >>> scores = jnp.array([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7]])
        >>> float(metric.update(scores, jnp.array([1, 0])).compute())
        0.5
    """

    total: jax.Array | None = None
    count: jax.Array | None = None
    num_classes: int = config_field()
    top_k: int = config_field(1)
    average: str = config_field("micro")
    ignore_index: int | None = config_field()

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_classes(owner, self.num_classes)
        if not isinstance(self.top_k, int) or not 1 <= self.top_k <= self.num_classes:
            raise ValueError(f"{owner}(top_k={self.top_k!r}): expected an integer from 1 to num_classes")
        _check_choice(owner, "average", self.average, ("micro", "macro"))

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> MulticlassAccuracy:
        """The state of one batch: ``preds`` ``(..., C)`` scores, ``target`` ``(...)`` labels, ``mask`` ``(...)``."""
        scores, labels, valid = flat_classification(preds, target, mask, self.ignore_index)
        _check_scores(type(self).__name__, scores, self.num_classes)
        predicted = jnp.argmax(scores, axis=-1)
        if self.top_k > 1:
            # The label itself when it is among the top k; otherwise the top-1 class, which is not the label.
            hit = jnp.any(jax.lax.top_k(scores, self.top_k)[1] == labels[:, None], axis=-1)
            predicted = jnp.where(hit, labels, predicted)
        if self.average == "micro":
            batch = metrax.Accuracy.from_model_output(predicted, labels, sample_weights=valid)
            return self.replace(total=batch.total, count=batch.count)
        correct = ((predicted == labels) & valid).astype(jnp.int32)
        return self.replace(total=jax.ops.segment_sum(correct, labels, self.num_classes),
                            count=jax.ops.segment_sum(valid.astype(jnp.int32), labels, self.num_classes))

    def compute(self) -> jax.Array:
        """Correct over counted samples (micro), or the mean per-class accuracy over present classes (macro)."""
        if self.average == "micro":
            return divide_no_nan(self.total, self.count)
        return _macro(divide_no_nan(self.total, self.count), self.count > 0)


@struct.dataclass(kw_only=True)
class BinaryAccuracy(Metric, metrax.Accuracy):
    """The fraction of samples whose thresholded score equals the 0/1 label (torchmetrics' name and rule).

    As torchmetrics, scores outside ``[0, 1]`` (in a batch) are logits and go through a sigmoid,
    and a sample is predicted positive when its probability is strictly above ``threshold``.

    Args:
        threshold: the probability above which a sample is positive.
        ignore_index: a label value that is left out, or None.

    Example:
        >>> metric = BinaryAccuracy()
        >>> round(float(metric.update(jnp.array([0.2, 0.7, 0.5]), jnp.array([0, 1, 1])).compute()), 4)
        0.6667
    """

    total: jax.Array | None = None
    count: jax.Array | None = None
    threshold: float = config_field(0.5)
    ignore_index: int | None = config_field()

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> BinaryAccuracy:
        """The state of one batch: ``preds`` scores and ``target`` 0/1 labels of one shape, ``mask`` a prefix of it."""
        scores, labels = jnp.asarray(logits_of(preds)).reshape(-1), jnp.asarray(target).reshape(-1).astype(jnp.int32)
        valid = jnp.ones(labels.shape, bool) if mask is None else (sample_mask(mask, jnp.shape(target)) != 0).ravel()
        if self.ignore_index is not None:
            valid = valid & (labels != self.ignore_index)
        probabilities = jnp.all(jnp.where(valid, (scores >= 0) & (scores <= 1), True))
        scores = jnp.where(probabilities, scores, jax.nn.sigmoid(scores))
        batch = metrax.Accuracy.from_model_output((scores > self.threshold).astype(jnp.int32), labels,
                                                  sample_weights=valid)
        return self.replace(total=batch.total, count=batch.count)

    def compute(self) -> jax.Array:
        """Correct over counted samples."""
        return divide_no_nan(self.total, self.count)


@struct.dataclass(kw_only=True)
class MaskedAccuracy(Metric, metrax.Accuracy):
    """Composer's token accuracy: argmax of the scores against the labels, leaving out ``ignore_index``.

    Needs no ``num_classes`` (a vocabulary can be large): it is ``MulticlassAccuracy`` with
    ``top_k=1``, ``average='micro'`` and ``ignore_index=-100`` without the class count.

    Example:
        >>> logits = jnp.array([[[2.0, 0.0], [0.0, 1.0], [1.0, 0.0]]])
        >>> float(MaskedAccuracy().update(logits, jnp.array([[0, 0, -100]])).compute())
        0.5
    """

    total: jax.Array | None = None
    count: jax.Array | None = None
    ignore_index: int | None = config_field(-100)

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> MaskedAccuracy:
        """The state of one batch: ``preds`` ``(..., V)`` scores, ``target`` ``(...)`` labels."""
        scores, labels, valid = flat_classification(preds, target, mask, self.ignore_index)
        batch = metrax.Accuracy.from_model_output(jnp.argmax(scores, axis=-1), labels, sample_weights=valid)
        return self.replace(total=batch.total, count=batch.count)

    def batch_state_from_predictions(self, predictions: jax.Array, target: jax.Array,
                                     mask: jax.Array | None = None) -> MaskedAccuracy:
        """One batch from argmax predictions already computed (a chunked LM head's): ``(...)`` ids against labels.

        The same state :meth:`batch_state` gives for the scores whose argmax ``predictions`` are.

        Example:
            >>> float(MaskedAccuracy().batch_state_from_predictions(jnp.array([[0, 1, 1]]),
            ...                                                      jnp.array([[0, 0, -100]])).compute())
            0.5
        """
        labels = jnp.asarray(target).astype(jnp.int32)
        valid = jnp.ones(labels.shape, bool) if self.ignore_index is None else labels != self.ignore_index
        if mask is not None:
            valid = valid & (sample_mask(mask, labels.shape) != 0)
        batch = metrax.Accuracy.from_model_output(jnp.asarray(predictions).astype(jnp.int32).reshape(-1),
                                                  jnp.where(valid, labels, 0).reshape(-1),
                                                  sample_weights=valid.reshape(-1))
        return self.replace(total=batch.total, count=batch.count)

    def compute(self) -> jax.Array:
        """Correct over counted tokens."""
        return divide_no_nan(self.total, self.count)


@struct.dataclass(kw_only=True)
class _ConfusionMatrixMetric(Metric):
    """Counts of (true class, predicted class) pairs: exact precision, recall and F1, merged by adding."""

    confusion: jax.Array | None = None  # (C, C) int32: rows are true classes, columns predicted ones
    num_classes: int = config_field()
    average: str = config_field("macro")
    ignore_index: int | None = config_field()

    def __post_init__(self) -> None:
        _check_classes(type(self).__name__, self.num_classes)
        _check_choice(type(self).__name__, "average", self.average, ("micro", "macro", "weighted"))

    def batch_state(self, preds: Any, target: jax.Array, mask: jax.Array | None = None) -> Any:
        """The confusion matrix of one batch: ``preds`` ``(..., C)`` scores (argmax), ``target`` ``(...)`` labels."""
        scores, labels, valid = flat_classification(preds, target, mask, self.ignore_index)
        _check_scores(type(self).__name__, scores, self.num_classes)
        classes = self.num_classes
        confusion = jnp.zeros((classes, classes), jnp.int32).at[labels, jnp.argmax(scores, axis=-1)].add(
            valid.astype(jnp.int32))
        return self.replace(confusion=confusion)

    def _per_class(self, true_positives: jax.Array, false_positives: jax.Array, false_negatives: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        """``(numerator, denominator)`` per class of the score."""
        raise NotImplementedError

    def compute(self) -> jax.Array:
        """The score, averaged as ``average`` says."""
        confusion = self.confusion
        true_positives = jnp.diagonal(confusion)
        false_positives = confusion.sum(axis=0) - true_positives
        false_negatives = confusion.sum(axis=1) - true_positives
        numerator, denominator = self._per_class(true_positives, false_positives, false_negatives)
        if self.average == "micro":
            return divide_no_nan(numerator.sum(), denominator.sum())
        per_class = divide_no_nan(numerator, denominator)
        if self.average == "weighted":
            support = true_positives + false_negatives
            return divide_no_nan(jnp.sum(per_class * support), support.sum())
        # Classes never seen in the labels nor predicted are left out, as sklearn and torchmetrics do.
        return _macro(per_class, (true_positives + false_positives + false_negatives) > 0)


@struct.dataclass(kw_only=True)
class MulticlassPrecision(_ConfusionMatrixMetric):
    """Precision ``tp / (tp + fp)`` of the argmax predictions, per class then averaged (torchmetrics' name).

    ``average='macro'`` (the default, as torchmetrics) is the mean over the classes that occur in
    the labels or the predictions (a class never predicted counts 0, as sklearn's
    ``zero_division=0``); ``'micro'`` pools the counts; ``'weighted'`` weighs classes by their
    label count. The state is the ``num_classes x num_classes`` confusion matrix, so the value is
    exact over any number of batches, devices and processes.

    Args:
        num_classes: ``C``, the scores' last dimension.
        average: ``'macro'``, ``'micro'`` or ``'weighted'``.
        ignore_index: a label value that is left out, or None.

    Example:
        >>> scores = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
        >>> float(MulticlassPrecision(num_classes=2).update(scores, jnp.array([0, 1, 1])).compute())
        0.75
    """

    def _per_class(self, true_positives: jax.Array, false_positives: jax.Array, false_negatives: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        return true_positives, true_positives + false_positives


@struct.dataclass(kw_only=True)
class MulticlassRecall(_ConfusionMatrixMetric):
    """Recall ``tp / (tp + fn)`` of the argmax predictions, per class then averaged; see :class:`MulticlassPrecision`.

    Example:
        >>> scores = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
        >>> float(MulticlassRecall(num_classes=2).update(scores, jnp.array([0, 1, 1])).compute())
        0.75
    """

    def _per_class(self, true_positives: jax.Array, false_positives: jax.Array, false_negatives: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        return true_positives, true_positives + false_negatives


@struct.dataclass(kw_only=True)
class MulticlassF1Score(_ConfusionMatrixMetric):
    """F1 ``2 tp / (2 tp + fp + fn)`` of the argmax predictions, per class then averaged (see Precision).

    Example:
        >>> scores = jnp.array([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7]])
        >>> round(float(MulticlassF1Score(num_classes=2).update(scores, jnp.array([0, 1, 1])).compute()), 4)
        0.6667
    """

    def _per_class(self, true_positives: jax.Array, false_positives: jax.Array, false_negatives: jax.Array
                   ) -> tuple[jax.Array, jax.Array]:
        return 2 * true_positives, 2 * true_positives + false_positives + false_negatives
