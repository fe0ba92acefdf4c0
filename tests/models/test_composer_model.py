"""ComposerClassifier: cross-entropy for integer and soft targets, metric sums."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ComposerClassifier


@pytest.fixture(scope="module")
def classifier() -> ComposerClassifier:
    return ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=3)


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(6, 5)).astype(np.float32), np.array([0, 1, 2, 2, 1, 0], np.int32)


def test_integer_and_one_hot_targets_give_the_same_loss(classifier):
    x, y = batch()
    logits = classifier.forward((x, y))
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    assert float(classifier.loss(logits, (x, y))) == pytest.approx(float(expected), rel=1e-6)
    one_hot = np.eye(3, dtype=np.float32)[y]
    assert float(classifier.loss(logits, (x, one_hot))) == pytest.approx(float(expected), rel=1e-6)


def test_soft_targets_use_the_full_distribution(classifier):
    x, y = batch()
    logits = classifier.forward((x, y))
    soft = np.full((6, 3), 0.1, np.float32)
    soft[np.arange(6), y] = 0.8
    expected = -(soft * jax_log_softmax(np.asarray(logits))).sum(-1).mean()
    assert float(classifier.loss(logits, (x, soft))) == pytest.approx(float(expected), rel=1e-5)


def jax_log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_metrics_are_sums_and_counts(classifier):
    x, y = batch()
    logits = classifier.forward((x, y))
    metrics = classifier.metrics(logits, (x, y))
    correct, count = metrics["accuracy"]
    assert float(count) == 6
    assert float(correct) == float(jnp.sum(jnp.argmax(logits, -1) == y))
    total, _ = metrics["cross_entropy"]
    assert float(total) == pytest.approx(6 * float(classifier.loss(logits, (x, y))), rel=1e-6)


def test_wrong_num_classes_is_reported(classifier):
    with pytest.raises(ValueError, match="num_classes=1"):
        ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=1)
    mismatched = ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=4)
    with pytest.raises(ValueError, match="num_classes=4"):
        mismatched.forward(batch())
