"""MeanMetric: a weighted mean, and the (sum, count) pairs of older models as metrics."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from composerjax.metrics import MeanMetric, mean_metrics


def test_weights_weigh_values_and_a_mask_leaves_them_out():
    values = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    assert float(MeanMetric().update(values, np.array([1, 0, 1, 0], bool)).compute()) == 2.0
    weights = np.array([0.5, 0.5, 1.0, 2.0], np.float32)
    assert float(MeanMetric().update(values, weights).compute()) == pytest.approx(np.average(values, weights=weights))


def test_sum_count_pairs_become_means_and_nothing_counted_is_zero():
    states = mean_metrics({"loss": (jnp.float32(3.0), jnp.float32(2.0)), "empty": (jnp.float32(0), jnp.float32(0))})
    assert {name: float(state.compute()) for name, state in states.items()} == {"loss": 1.5, "empty": 0.0}
