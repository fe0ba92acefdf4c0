"""ComposerClassifier: cross-entropy for integer and soft targets, Composer's eval metrics."""

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


def test_eval_metrics_are_composers_and_update_returns_the_batch_state(classifier):
    x, y = batch()
    logits = classifier.forward((x, y))
    metrics = classifier.get_metrics()
    assert sorted(metrics) == ["CrossEntropy", "MulticlassAccuracy"]
    accuracy = classifier.update_metric((x, y), logits, metrics["MulticlassAccuracy"])
    assert int(accuracy.count) == 6
    assert int(accuracy.total) == int(jnp.sum(jnp.argmax(logits, -1) == y))
    cross_entropy = classifier.update_metric((x, y), logits, metrics["CrossEntropy"])
    assert float(cross_entropy.total) == pytest.approx(6 * float(classifier.loss(logits, (x, y))), rel=1e-6)
    assert not metrics["CrossEntropy"].has_state  # the metric get_metrics gave is unchanged


def test_train_metrics_and_custom_val_metrics(classifier):
    from composerjax.metrics import MulticlassAccuracy, MulticlassF1Score

    assert classifier.get_metrics(is_train=True) == {}  # train metrics are off by default
    accuracy = MulticlassAccuracy(num_classes=3, top_k=2)
    with_train = ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=3, train_metrics=accuracy)
    assert with_train.get_metrics(is_train=True) == {"MulticlassAccuracy": accuracy}
    custom = ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=3,
                                val_metrics={"f1": MulticlassF1Score(num_classes=3)})
    assert list(custom.get_metrics()) == ["f1"]


def test_wrong_num_classes_is_reported(classifier):
    with pytest.raises(ValueError, match="num_classes=1"):
        ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=1)
    mismatched = ComposerClassifier(nnx.Linear(5, 3, rngs=nnx.Rngs(0)), num_classes=4)
    with pytest.raises(ValueError, match="num_classes=4"):
        mismatched.forward(batch())
