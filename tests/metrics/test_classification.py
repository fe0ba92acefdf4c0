"""Classification metrics against scikit-learn: masks, ignore_index, one-hot targets, sequences, absent classes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as sk

from composerjax.metrics import (
    BinaryAccuracy,
    MaskedAccuracy,
    MulticlassAccuracy,
    MulticlassF1Score,
    MulticlassPrecision,
    MulticlassRecall,
)


def scores_and_labels(count: int = 40, classes: int = 4, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.normal(size=(count, classes)).astype(np.float32), rng.integers(0, classes, count).astype(np.int32)


def test_mask_and_ignore_index_leave_samples_out():
    scores, labels = scores_and_labels()
    mask = np.arange(40) % 3 != 0
    padded = np.where(np.arange(40) % 5 == 0, -100, labels)
    kept = mask & (padded != -100)
    predicted = scores.argmax(1)
    accuracy = MulticlassAccuracy(num_classes=4, ignore_index=-100).update(scores, padded, mask)
    assert float(accuracy.compute()) == pytest.approx(sk.accuracy_score(labels[kept], predicted[kept]), rel=1e-6)
    f1 = MulticlassF1Score(num_classes=4, ignore_index=-100).update(scores, padded, mask)
    assert float(f1.compute()) == pytest.approx(sk.f1_score(labels[kept], predicted[kept], average="macro"), rel=1e-6)


def test_one_hot_targets_count_as_their_argmax_and_sequences_flatten():
    scores, labels = scores_and_labels()
    one_hot = np.eye(4, dtype=np.float32)[labels]
    metric = MulticlassRecall(num_classes=4)
    assert float(metric.update(scores, one_hot).compute()) == float(metric.update(scores, labels).compute())
    sequences = metric.update(scores.reshape(5, 8, 4), labels.reshape(5, 8), np.ones(5, bool))  # (N, T) mask prefix
    assert int(sequences.confusion.sum()) == 40
    assert float(sequences.compute()) == pytest.approx(sk.recall_score(labels, scores.argmax(1), average="macro"))


def test_macro_averages_over_the_classes_in_labels_or_predictions():
    # Class 3 never occurs: sklearn and torchmetrics leave it out of the macro average.
    scores = np.eye(4, dtype=np.float32)[[0, 1, 2, 2, 1]]
    labels = np.array([0, 1, 1, 2, 2], np.int32)
    for metric_class, sklearn_score in ((MulticlassPrecision, sk.precision_score), (MulticlassRecall, sk.recall_score),
                                        (MulticlassF1Score, sk.f1_score)):
        for average in ("macro", "micro", "weighted"):
            value = float(metric_class(num_classes=4, average=average).update(scores, labels).compute())
            assert value == pytest.approx(sklearn_score(labels, scores.argmax(1), average=average)), (metric_class,
                                                                                                       average)


def test_macro_accuracy_is_balanced_accuracy():
    scores, labels = scores_and_labels(seed=2)
    value = float(MulticlassAccuracy(num_classes=4, average="macro").update(scores, labels).compute())
    assert value == pytest.approx(sk.balanced_accuracy_score(labels, scores.argmax(1)), rel=1e-6)


def test_top_k_accuracy_equals_sklearn():
    scores, labels = scores_and_labels(seed=3)
    for k in (1, 2, 3):
        value = float(MulticlassAccuracy(num_classes=4, top_k=k).update(scores, labels).compute())
        assert value == pytest.approx(sk.top_k_accuracy_score(labels, scores, k=k, labels=range(4)), rel=1e-6)


def test_binary_accuracy_reads_logits_through_a_sigmoid():
    probabilities = np.array([0.2, 0.5, 0.7, 0.9], np.float32)
    labels = np.array([0, 1, 1, 0], np.int32)
    assert float(BinaryAccuracy().update(probabilities, labels).compute()) == 0.5  # 0.5 is not above 0.5
    logits = np.log(probabilities / (1 - probabilities))
    assert float(BinaryAccuracy().update(logits, labels).compute()) == 0.5


def test_masked_accuracy_needs_no_class_count():
    logits = np.zeros((2, 3, 100), np.float32)
    logits[..., 7] = 1.0
    tokens = np.array([[7, 7, -100], [1, 7, -100]], np.int32)
    assert float(MaskedAccuracy().update(logits, tokens).compute()) == 0.75


def test_scores_of_the_wrong_width_are_refused():
    with pytest.raises(ValueError, match=r"MulticlassPrecision\(num_classes=3\): the predictions have 4 scores"):
        MulticlassPrecision(num_classes=3).update(jnp.zeros((2, 4)), jnp.zeros(2, jnp.int32))
