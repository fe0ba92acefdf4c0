"""Metric: a configured value; update returns a new one, merge adds, settings survive jit and nnx modules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from composerjax.metrics import MeanMetric, MulticlassAccuracy, MulticlassF1Score


def test_a_metric_without_batches_is_a_hashable_settings_object():
    metric = MulticlassAccuracy(num_classes=4, top_k=2)
    assert not metric.has_state and jax.tree.leaves(metric) == []
    assert hash(metric) == hash(MulticlassAccuracy(num_classes=4, top_k=2))
    assert metric != MulticlassAccuracy(num_classes=4)


def test_update_returns_a_new_metric_and_leaves_the_old_one():
    metric = MulticlassAccuracy(num_classes=2)
    state = metric.update(jnp.array([[1.0, 0.0], [0.0, 1.0]]), jnp.array([0, 0]))
    assert not metric.has_state
    assert (int(state.total), int(state.count)) == (1, 2)
    twice = state.update(jnp.array([[1.0, 0.0]]), jnp.array([0]))
    assert (int(twice.total), int(twice.count)) == (2, 3)
    assert state.merge(metric) is state and metric.merge(state) is state  # merging with nothing seen
    assert twice.reset() == metric


def test_merge_under_jit_keeps_the_settings():
    metric = MulticlassAccuracy(num_classes=3, top_k=2)
    state = metric.update(jnp.eye(3), jnp.array([0, 1, 1]))  # the third sample's top two: classes 2 and 0
    merged = jax.jit(lambda a, b: a.merge(b))(state, state)
    assert (merged.num_classes, merged.top_k) == (3, 2)
    assert jax.tree.structure(merged) == jax.tree.structure(state)
    assert (int(merged.total), int(merged.count)) == (4, 6)


def test_a_module_can_keep_metrics_and_split_and_merge():
    class Holder(nnx.Module):
        def __init__(self) -> None:
            self.linear = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
            self.metrics = (("F1", MulticlassF1Score(num_classes=2)), ("Mean", MeanMetric()))

    graphdef, state = nnx.split(Holder())
    hash(graphdef)  # static attributes must hash for jit's cache
    assert dict(nnx.merge(graphdef, state).metrics)["F1"] == MulticlassF1Score(num_classes=2)


def test_settings_are_checked_when_the_metric_is_made():
    with pytest.raises(ValueError, match=r"MulticlassAccuracy\(num_classes=None\): expected an integer >= 2"):
        MulticlassAccuracy()
    with pytest.raises(ValueError, match=r"top_k=4\): expected an integer from 1 to num_classes"):
        MulticlassAccuracy(num_classes=3, top_k=4)
    with pytest.raises(ValueError, match=r"average='samples'\): expected one of 'micro', 'macro', 'weighted'"):
        MulticlassF1Score(num_classes=3, average="samples")
    with pytest.raises(TypeError):
        MulticlassAccuracy(3)  # settings are keywords: a positional value would land in the state


def test_from_model_output_is_clus_constructor():
    state = MeanMetric.from_model_output(jnp.array([1.0, 2.0, 6.0]))
    assert float(state.compute()) == 3.0
