"""Exact AUROC: ranks with ties against scikit-learn, binary and one-vs-rest, merged over batches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sklearn import metrics as sk

from composerjax.metrics import BinaryAUROC, MulticlassAUROC, rank_auc


def test_rank_auc_with_many_ties_equals_sklearn():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 5, 200).astype(np.float32)  # five distinct scores: ties everywhere
    labels = rng.integers(0, 2, 200).astype(bool)
    value = float(jax.jit(rank_auc)(scores, labels, np.ones(200, bool)))
    assert value == pytest.approx(sk.roc_auc_score(labels, scores), rel=1e-6)


def test_invalid_samples_do_not_count_and_a_missing_class_gives_zero():
    scores = np.array([0.1, 0.9, 0.4, 0.8], np.float32)
    labels = np.array([0, 1, 1, 0])
    valid = np.array([True, True, True, False])
    assert float(rank_auc(scores, labels == 1, valid)) == pytest.approx(sk.roc_auc_score(labels[:3], scores[:3]))
    assert float(rank_auc(scores, np.ones(4, bool), np.ones(4, bool))) == 0.0


def test_binary_auroc_merges_batches_and_honours_ignore_index():
    rng = np.random.default_rng(1)
    scores = np.round(rng.random(50), 1).astype(np.float32)
    labels = rng.integers(0, 2, 50).astype(np.int32)
    labels[::7] = -1
    metric = BinaryAUROC(ignore_index=-1)
    state = metric.update(scores[:20], labels[:20]).merge(metric.update(scores[20:], labels[20:]))
    assert len(state.scores) == 2  # the batches are kept apart until compute
    kept = labels != -1
    assert float(state.compute()) == pytest.approx(sk.roc_auc_score(labels[kept], scores[kept]), rel=1e-6)


def test_multiclass_auroc_from_logits_softmaxes_first():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(60, 3)).astype(np.float32)
    labels = rng.integers(0, 3, 60).astype(np.int32)
    probabilities = np.exp(logits.astype(np.float64))
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    for average in ("macro", "weighted"):
        value = float(MulticlassAUROC(num_classes=3, average=average).update(jnp.asarray(logits), labels).compute())
        assert value == pytest.approx(sk.roc_auc_score(labels, probabilities, multi_class="ovr", average=average),
                                      rel=1e-6)
