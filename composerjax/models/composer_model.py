"""ComposerModel: the protocol the trainer drives, and ComposerClassifier for (x, y) batches."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

__all__ = ["ComposerModel", "ComposerClassifier", "MetricSums"]

#: Metrics leave a step as ``{name: (sum, count)}``; the trainer adds them up over batches and
#: divides at the end, so means over uneven batches stay exact.
MetricSums = dict[str, tuple[jax.Array, jax.Array]]


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


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy for integer labels or one-hot / soft targets (same rank as logits)."""
    logits = logits.astype(jnp.float32)
    if targets.ndim == logits.ndim:
        return jnp.mean(optax.softmax_cross_entropy(logits, targets.astype(jnp.float32)))
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, targets.astype(jnp.int32)))


class ComposerClassifier(ComposerModel):
    """Wrap a module mapping inputs to logits into a classifier for ``(x, y)`` batches.

    ``y`` may hold integer labels or one-hot / soft targets (as MixUp or label smoothing produce).
    The loss is cross-entropy; eval metrics are ``accuracy`` and ``cross_entropy``.

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
