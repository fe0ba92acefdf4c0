"""ComposerModel: the protocol the trainer drives, and ComposerClassifier for (x, y) batches."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from composerjax.metrics import CrossEntropy, Metric, MulticlassAccuracy, named_metrics

__all__ = ["ComposerModel", "ComposerClassifier", "MetricSums"]

#: The older way to give eval metrics: ``ComposerModel.metrics`` returns ``{name: (sum, count)}``;
#: each pair becomes a :class:`~composerjax.metrics.MeanMetric` (sum over count at the end).
MetricSums = dict[str, tuple[jax.Array, jax.Array]]

#: What ``train_metrics`` / ``val_metrics`` accept: one metric, a sequence (named by class) or ``{name: metric}``.
MetricsArgument = Metric | Sequence[Metric] | Mapping[str, Metric]

_maximum = np.maximum.reduce  # ndarray.max without its Python-level argument handling
_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


class ComposerModel(nnx.Module):
    """A model the trainer can drive: ``forward`` on a batch, ``loss`` of its outputs, eval metrics.

    Subclass it and implement ``forward`` and ``loss``; ``eval_forward`` has a default. Eval
    metrics come as Composer's: :meth:`get_metrics` names the metric objects
    (:mod:`composerjax.metrics`) and :meth:`update_metric` feeds one a batch. With no
    ``get_metrics``, the ``(sum, count)`` pairs of :meth:`metrics` are averaged (the loss by
    default). Everything here runs inside the compiled step and must be traceable.

    Example:
        >>> class Regressor(ComposerModel):
        ...     def __init__(self, rngs):
        ...         self.linear = nnx.Linear(3, 1, rngs=rngs)
        ...     def forward(self, batch):
        ...         return self.linear(batch[0])
        ...     def loss(self, outputs, batch):
        ...         return jnp.mean((outputs - batch[1]) ** 2)
        >>> model = Regressor(nnx.Rngs(0))
        >>> float(model.loss(model.forward((jnp.zeros((2, 3)), jnp.zeros((2, 1))))
        ...       , (None, jnp.zeros((2, 1)))))
        0.0
    """

    def forward(self, batch: Any) -> Any:
        """Return the model's outputs for ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward(batch)")

    def loss(self, outputs: Any, batch: Any) -> jax.Array:
        """Return the scalar training loss of ``outputs`` against ``batch``."""
        raise NotImplementedError(f"{type(self).__name__} must implement loss(outputs, batch)")

    def eval_forward(self, batch: Any, outputs: Any | None = None) -> Any:
        """Return the outputs used for eval metrics (``forward`` by default)."""
        return outputs if outputs is not None else self.forward(batch)

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """Return ``{name: metric}``, the metrics to compute on eval (or train) batches (Composer's method).

        The default is none. The eval step calls it inside the trace and computes, for every
        metric an evaluator selects, ``update_metric``'s state of each batch; the states merge
        exactly over batches, devices and processes, and are logged as
        ``metrics/<label>/<name>``. With no eval metrics, the pairs of :meth:`metrics` are used.
        Train metrics (``is_train=True``) are off by default, as in Composer.

        Example:
            >>> from composerjax.metrics import MeanSquaredError
            >>> class Regressor(ComposerModel):
            ...     def get_metrics(self, is_train=False):
            ...         return {} if is_train else {"MeanSquaredError": MeanSquaredError()}
            >>> list(Regressor().get_metrics())
            ['MeanSquaredError']
        """
        return {}

    def update_metric(self, batch: Any, outputs: Any, metric: Metric) -> Metric:
        """Return ``metric`` updated with one batch: ``metric.update(outputs, targets)`` for your targets.

        Composer's method mutates the metric; here metrics are values, so return the updated one
        (called on the metric as ``get_metrics`` gave it, that is the batch's state). It runs
        inside the compiled eval step on ``eval_forward``'s outputs.
        """
        raise NotImplementedError(
            f"{type(self).__name__}.get_metrics() returned metrics: implement update_metric(batch, outputs, metric) "
            "returning metric.update(outputs, targets)")

    def metrics(self, outputs: Any, batch: Any) -> MetricSums:
        """Return eval metrics as ``{name: (sum, count)}`` when :meth:`get_metrics` gives none; default: the loss."""
        count = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        return {"loss": (self.loss(outputs, batch) * count, count)}

    def loss_token_count(self, batch: Any) -> jax.Array | None:
        """Return how many tokens :meth:`loss` averages over in ``batch``; None (the default) for a mean over samples.

        Composer's ``get_num_tokens_in_batch(batch, token_type='loss_generating')``. With
        ``Trainer(accumulate_train_batch_on_tokens=True)`` and ``device_train_microbatch_size``,
        each microbatch's loss and gradient weigh by its count over the whole batch's (instead of
        1 / number of microbatches), so the accumulated gradient is the whole batch's mean over
        those tokens. It runs inside the compiled step, once per microbatch before
        ``BEFORE_FORWARD``: return a traced scalar (``jnp.sum(targets != -100)``), never a host value.
        None weighs microbatches by their samples, that is equally.

        Example:
            >>> class TokenRegressor(ComposerModel):
            ...     def loss_token_count(self, batch):
            ...         return jnp.sum(batch[1] != -100)
            >>> int(TokenRegressor().loss_token_count((None, jnp.array([[1, -100], [-100, -100]]))))
            1
        """
        return None

    def check_batch(self, batch: Any) -> None:
        """Refuse, on the host, a batch the compiled step would train on silently wrong (default: accept all).

        The trainer calls it on every train and eval batch before the batch goes to the device, so it
        runs on every step: keep it to cheap numpy checks, and never read a ``jax.Array`` (that
        would wait for the device). Raise ``ValueError`` naming what is wrong; the trainer adds
        which loader and batch it was.
        """


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy for integer labels or one-hot / soft targets (same rank as logits).

    Integer labels must lie in ``[0, num_classes)``: outside it optax gives NaN (too large) or
    silently drops the sample (negative). :meth:`ComposerClassifier.check_batch` refuses such
    labels on the host before they get here.
    """
    logits = logits.astype(jnp.float32)
    if targets.ndim == logits.ndim:
        return jnp.mean(optax.softmax_cross_entropy(logits, targets.astype(jnp.float32)))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets.astype(jnp.int32)))


class ComposerClassifier(ComposerModel):
    """Wrap a module mapping inputs to logits into a classifier for ``(x, y)`` batches.

    ``y`` may hold integer labels or one-hot / soft targets (as MixUp or label smoothing produce).
    The loss is cross-entropy. Eval metrics are Composer's: ``CrossEntropy`` and
    ``MulticlassAccuracy`` (micro). Train metrics are off unless ``train_metrics`` is given
    (Composer's classifier names ``MulticlassAccuracy`` but computes it only with
    ``compute_training_metrics``; here returning train metrics turns them on). Integer labels
    outside ``[0, num_classes)`` are refused by :meth:`check_batch`, which the trainer runs on
    every numpy train and eval batch.

    Args:
        module: an ``nnx.Module`` called as ``module(x)`` that returns logits.
        num_classes: the number of classes (checked against the logits' last dimension).
        train_metrics: metrics to compute on train batches: a metric, a sequence (named by
            class, as a ``MetricCollection``) or ``{name: metric}``; None for none.
        val_metrics: the eval metrics instead, in the same forms.

    Example:
        >>> clf = ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3)
        >>> clf.forward((jnp.ones((2, 4)), jnp.array([0, 2]))).shape
        (2, 3)
        >>> sorted(clf.get_metrics())
        ['CrossEntropy', 'MulticlassAccuracy']
    """

    def __init__(self, module: nnx.Module, num_classes: int, train_metrics: MetricsArgument | None = None,
                 val_metrics: MetricsArgument | None = None) -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r}: expected an integer >= 2")
        self.module = module
        self.num_classes = num_classes
        if train_metrics is None:
            train_metrics = {}
        if val_metrics is None:
            val_metrics = [CrossEntropy(), MulticlassAccuracy(num_classes=num_classes, average="micro")]
        # Kept as (name, metric) pairs: a module's static attributes must be hashable.
        self.train_metrics = tuple(named_metrics(train_metrics).items())
        self.val_metrics = tuple(named_metrics(val_metrics).items())

    def forward(self, batch: Any) -> jax.Array:
        """Logits of ``module(x)`` for a batch ``(x, y)``."""
        logits = self.module(batch[0])
        if logits.shape[-1] != self.num_classes:
            raise ValueError(
                f"ComposerClassifier: the module returned logits with last dimension {logits.shape[-1]}, "
                f"but num_classes={self.num_classes}"
            )
        return logits

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        """Cross-entropy of the logits against ``y`` (integer or soft targets)."""
        return cross_entropy(outputs, batch[1])

    def check_batch(self, batch: Any) -> None:
        """Refuse integer labels outside ``[0, num_classes)`` in ``batch[1]``, before the batch reaches the device.

        Inside the step such labels fail silently: one at or above ``num_classes`` makes the loss
        NaN, a negative one is dropped from the loss. Checked: a numpy integer ``batch[1]`` (one
        ``max`` over the labels read as unsigned, so negatives count as huge; Python's ``min`` and
        ``max`` for 64 labels or fewer: a few microseconds per batch). Not checked: labels that are
        already ``jax.Array`` (reading them would wait for the device) and float or one-hot targets.

        Raises:
            ValueError: naming ``batch[1]``, the first bad label and where it is, and the range.

        Example:
            >>> clf = ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3)
            >>> clf.check_batch((np.zeros((2, 4)), np.array([0, 3])))  # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: batch[1] (labels) holds 3 at index (1,): expected class indices from 0 to 2 (num_classes=3); ...
        """
        if type(batch) is not tuple and type(batch) is not list or len(batch) < 2:
            return
        labels = batch[1]
        if type(labels) is not np.ndarray or not labels.size:
            return
        if labels.size <= 64 and labels.dtype.kind in "iu":  # a few labels: Python's min/max beat numpy's call cost
            values = labels.ravel().tolist()
            if min(values) >= 0 and max(values) < self.num_classes:
                return
        unsigned = _UNSIGNED.get(labels.dtype)
        if unsigned is not None:  # a signed label read as unsigned: -1 becomes the largest value
            top = _maximum(labels.view(unsigned), None)
        elif labels.dtype.kind == "u":
            top = _maximum(labels, None)
        else:
            return
        if top < self.num_classes:
            return
        bad = (labels < 0) | (labels >= self.num_classes)
        where = np.unravel_index(int(np.argmax(bad)), labels.shape)
        first = labels[where]
        raise ValueError(
            f"batch[1] (labels) holds {int(first)} at index {tuple(int(i) for i in where)}: expected class indices "
            f"from 0 to {self.num_classes - 1} (num_classes={self.num_classes}); {int(bad.sum())} of {labels.size} "
            f"labels are out of range (min {int(labels.min())}, max {int(labels.max())}). A label >= num_classes "
            "makes the loss NaN and a negative one is silently ignored: fix the data or num_classes")

    def get_metrics(self, is_train: bool = False) -> dict[str, Metric]:
        """``{name: metric}``: the train metrics or the eval metrics given (or Composer's defaults)."""
        return dict(self.train_metrics if is_train else self.val_metrics)

    def update_metric(self, batch: Any, outputs: Any, metric: Metric) -> Metric:
        """``metric`` updated with the logits ``outputs`` against ``y = batch[1]``.

        Example:
            >>> clf = ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3)
            >>> metric = clf.get_metrics()["MulticlassAccuracy"]
            >>> logits = jnp.array([[2.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
            >>> float(clf.update_metric((None, jnp.array([0, 2])), logits, metric).compute())
            0.5
        """
        return metric.update(outputs, batch[1])
