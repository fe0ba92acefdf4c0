"""CrossEntropy and the language metrics: per-token means, ignore_index, soft targets, logits in a dict."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from sklearn import metrics as sk

from composerjax.metrics import CrossEntropy, LanguageCrossEntropy, LanguagePerplexity


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits.astype(np.float64) - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def test_uneven_batches_give_the_mean_over_samples_as_log_loss():
    rng = np.random.default_rng(0)
    logits, labels = rng.normal(size=(25, 3)).astype(np.float32), rng.integers(0, 3, 25)
    state = CrossEntropy().update(logits[:20], labels[:20]).merge(CrossEntropy().update(logits[20:], labels[20:]))
    assert float(state.compute()) == pytest.approx(sk.log_loss(labels, softmax(logits), labels=[0, 1, 2]), rel=1e-6)


def test_soft_targets_use_the_whole_distribution():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 3)).astype(np.float32)
    soft = softmax(rng.normal(size=(8, 3))).astype(np.float32)
    expected = float(optax.softmax_cross_entropy(logits, soft).mean())
    assert float(CrossEntropy().update(logits, soft).compute()) == pytest.approx(expected, rel=1e-6)


def test_language_metrics_leave_out_padding_and_read_logits_from_a_dict():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, 6, 11)).astype(np.float32)
    tokens = rng.integers(0, 11, (2, 6)).astype(np.int32)
    tokens[:, -2:] = -100
    kept = tokens != -100
    expected = sk.log_loss(tokens[kept], softmax(logits[kept]), labels=range(11))
    cross_entropy = LanguageCrossEntropy().update({"logits": logits}, tokens)
    assert int(cross_entropy.count) == 8
    assert float(cross_entropy.compute()) == pytest.approx(expected, rel=1e-6)
    assert float(LanguagePerplexity().update(logits, tokens).compute()) == pytest.approx(np.exp(expected), rel=1e-6)
