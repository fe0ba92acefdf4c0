"""Naming, selecting, merging and computing many metrics at once."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import struct
from sklearn import metrics as sk

from composerjax.metrics import (
    BinaryAUROC,
    CrossEntropy,
    MeanMetric,
    Metric,
    MulticlassAccuracy,
    collection,
    compute_values,
    merge_states,
    named_metrics,
    select_metrics,
)
from composerjax.metrics.collection import StateTotals, _merge_fixed


def test_metrics_are_named_after_their_class_as_a_metric_collection_does():
    assert list(named_metrics(CrossEntropy())) == ["CrossEntropy"]
    assert named_metrics({"ce": CrossEntropy()}) == {"ce": CrossEntropy()}
    with pytest.raises(ValueError, match="two metrics are named 'CrossEntropy'"):
        named_metrics([CrossEntropy(), CrossEntropy(ignore_index=None)])


def test_selection_matches_regexes_anywhere_ignoring_case_as_composers_evaluator():
    metrics = {"MulticlassAccuracy": 1, "BinaryF1Score": 2, "Top-1": 3, "Top-5": 4}
    assert select_metrics(metrics, None) == metrics
    assert list(select_metrics(metrics, ["accuracy"])) == ["MulticlassAccuracy"]
    assert list(select_metrics(metrics, ["f1", "Top-."])) == ["BinaryF1Score", "Top-1", "Top-5"]
    assert select_metrics(metrics, []) == {}


def test_merging_compiles_once_for_every_batch_of_one_shape():
    metrics = {"accuracy": MulticlassAccuracy(num_classes=2), "auroc": BinaryAUROC()}
    before = _merge_fixed._cache_size()
    total, all_scores, all_labels = None, [], []
    for index in range(5):
        scores = np.array([[0.9, 0.1], [0.2, 0.8]], np.float32) * (index + 1)
        labels = np.array([0, index % 2])
        batch = {"accuracy": metrics["accuracy"].update(scores, labels),
                 "auroc": metrics["auroc"].update(scores[:, 1], labels)}
        total = merge_states(total, batch)
        all_scores.append(scores)
        all_labels.append(labels)
    assert _merge_fixed._cache_size() - before <= 1
    assert len(total["auroc"].scores) == 5
    scores, labels = np.concatenate(all_scores), np.concatenate(all_labels)
    assert compute_values(total) == {"accuracy": pytest.approx(sk.accuracy_score(labels, scores.argmax(1))),
                                     "auroc": pytest.approx(sk.roc_auc_score(labels, scores[:, 1]))}


def test_eval_totals_merge_sixteen_batches_per_call_and_equal_the_batch_by_batch_merge(monkeypatch):
    """37 batches: 3 merge calls (16, 16, 5), the same totals as merging each batch, sklearn's values."""
    calls = []
    merge_many = collection._merge_many
    monkeypatch.setattr(collection, "_merge_many", lambda total, batches: calls.append(len(batches)) or
                        merge_many(total, batches))
    rng = np.random.default_rng(0)
    metrics = {"accuracy": MulticlassAccuracy(num_classes=3), "auroc": BinaryAUROC(), "mean": MeanMetric()}
    totals, one_by_one, all_scores, all_labels = StateTotals(), None, [], []
    for _ in range(37):
        scores, labels = rng.random((4, 3)).astype(np.float32), rng.integers(0, 3, 4)
        batch = {"accuracy": metrics["accuracy"].update(scores, labels),
                 "auroc": metrics["auroc"].update(scores[:, 1], labels == 1),
                 "mean": metrics["mean"].update(jnp.asarray(scores[:, 0]))}
        totals.add(batch)
        one_by_one = merge_states(one_by_one, batch)
        all_scores.append(scores)
        all_labels.append(labels)
    result = totals.result()
    assert calls == [16, 16, 5] and list(result) == ["accuracy", "auroc", "mean"]
    assert compute_values(result) == compute_values(one_by_one)
    scores, labels = np.concatenate(all_scores), np.concatenate(all_labels)
    assert compute_values(result) == {"accuracy": pytest.approx(sk.accuracy_score(labels, scores.argmax(1))),
                                      "auroc": pytest.approx(sk.roc_auc_score(labels == 1, scores[:, 1])),
                                      "mean": pytest.approx(scores[:, 0].mean())}


def test_a_metric_that_computes_no_scalar_is_named():
    @struct.dataclass(kw_only=True)
    class PerClass(MeanMetric):
        def compute(self):
            return jnp.stack([self.total, self.count])

    with pytest.raises(TypeError, match=r"metric 'per_class': compute\(\) returned shape \(2,\)"):
        compute_values({"per_class": PerClass().update(jnp.ones(3))})
    assert issubclass(PerClass, Metric)


def test_metrax_and_clu_metrics_merge_and_compute_alongside():
    """A model's update_metric may return any clu metric, e.g. metrax's own, as its batch state."""
    import metrax

    preds, targets = np.array([1.0, 2.0, 4.0], np.float32), np.array([1.0, 3.0, 2.0], np.float32)
    total = None
    for rows in (slice(0, 1), slice(1, 3)):
        total = merge_states(total, {"RMSE": metrax.RMSE.from_model_output(preds[rows], targets[rows])})
    assert compute_values(total) == {"RMSE": pytest.approx(np.sqrt(np.mean((preds - targets) ** 2)))}
