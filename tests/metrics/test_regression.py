"""MeanSquaredError and MeanAbsoluteError against scikit-learn, with several outputs and sample weights."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn import metrics as sk

from composerjax.metrics import MeanAbsoluteError, MeanSquaredError


def test_several_outputs_average_over_every_element():
    rng = np.random.default_rng(0)
    preds, targets = rng.normal(size=(30, 3)).astype(np.float32), rng.normal(size=(30, 3)).astype(np.float32)
    metric = MeanSquaredError()
    state = metric.update(preds[:10], targets[:10]).merge(metric.update(preds[10:], targets[10:]))
    assert float(state.compute()) == pytest.approx(sk.mean_squared_error(targets, preds), rel=1e-6)
    root = MeanSquaredError(squared=False).update(preds, targets)
    assert float(root.compute()) == pytest.approx(np.sqrt(sk.mean_squared_error(targets, preds)), rel=1e-6)
    absolute = MeanAbsoluteError().update(preds, targets)
    assert float(absolute.compute()) == pytest.approx(sk.mean_absolute_error(targets, preds), rel=1e-6)


def test_a_mask_leaves_samples_out_and_float_weights_weigh_them():
    rng = np.random.default_rng(1)
    preds, targets = rng.normal(size=20).astype(np.float32), rng.normal(size=20).astype(np.float32)
    mask = np.arange(20) % 4 != 0
    masked = MeanAbsoluteError().update(preds, targets, mask)
    assert float(masked.compute()) == pytest.approx(sk.mean_absolute_error(targets[mask], preds[mask]), rel=1e-6)
    weights = rng.random(20).astype(np.float32)
    weighted = MeanSquaredError().update(preds, targets, weights)
    assert float(weighted.compute()) == pytest.approx(sk.mean_squared_error(targets, preds, sample_weight=weights),
                                                      rel=1e-5)
