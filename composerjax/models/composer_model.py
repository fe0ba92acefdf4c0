"""ComposerModel: the protocol the trainer drives, and ComposerClassifier for (x, y) batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

__all__ = ["ComposerModel", "ComposerClassifier", "MetricSums"]

#: Metrics leave a step as ``{name: (sum, count)}``; the trainer adds them up over batches and
#: divides at the end, so means over uneven batches stay exact.
MetricSums = dict[str, tuple[jax.Array, jax.Array]]

_maximum = np.maximum.reduce  # ndarray.max without its Python-level argument handling
_UNSIGNED = {np.dtype(f"i{size}"): np.dtype(f"u{size}") for size in (1, 2, 4, 8)}


class ComposerModel(nnx.Module):
    """A model the trainer can drive: ``forward`` on a batch, ``loss`` of its outputs, eval metrics.

    Subclass it and implement ``forward`` and ``loss``; ``eval_forward`` and ``metrics`` have
    defaults. Everything here runs inside the compiled step and must be traceable.

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

    def metrics(self, outputs: Any, batch: Any) -> MetricSums:
        """Return eval metrics as ``{name: (sum, count)}``; the default is the loss."""
        count = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        return {"loss": (self.loss(outputs, batch) * count, count)}

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
    The loss is cross-entropy; eval metrics are ``accuracy`` and ``cross_entropy``. Integer
    labels outside ``[0, num_classes)`` are refused by :meth:`check_batch`, which the trainer runs
    on every numpy train and eval batch.

    Args:
        module: an ``nnx.Module`` called as ``module(x)`` that returns logits.
        num_classes: the number of classes (checked against the logits' last dimension).

    Example:
        >>> clf = ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3)
        >>> clf.forward((jnp.ones((2, 4)), jnp.array([0, 2]))).shape
        (2, 3)
    """

    def __init__(self, module: nnx.Module, num_classes: int) -> None:
        if not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes={num_classes!r}: expected an integer >= 2")
        self.module = module
        self.num_classes = num_classes

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
        ``max`` over the labels read as unsigned, so negatives count as huge; about a microsecond
        per batch). Not checked: labels that are already ``jax.Array`` (reading them would wait for
        the device) and float or one-hot targets.

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

    def metrics(self, outputs: jax.Array, batch: Any) -> MetricSums:
        """``accuracy`` and ``cross_entropy`` as (sum, count) pairs."""
        targets = batch[1]
        labels = jnp.argmax(targets, axis=-1) if targets.ndim == outputs.ndim else targets
        # One prediction per label: (N,) for images, (N, T) for sequences.
        count = jnp.asarray(labels.size, jnp.float32)
        correct = jnp.sum((jnp.argmax(outputs, axis=-1) == labels).astype(jnp.float32))
        return {
            "accuracy": (correct, count),
            "cross_entropy": (cross_entropy(outputs, targets) * count, count),
        }
