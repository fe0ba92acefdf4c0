"""ChannelsLast: accepted like Composer's, runs at INIT only, changes nothing and says why."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.channels_last import ChannelsLast, apply_channels_last
from composerjax.models import SmallCNN


def test_takes_no_arguments_and_matches_init_only():
    algorithm = ChannelsLast()
    assert repr(algorithm) == "ChannelsLast()"
    assert [event for event in Event if algorithm.match(event, None)] == [Event.INIT]
    with pytest.raises(TypeError):
        ChannelsLast(True)


def test_functional_form_leaves_the_model_bit_identical():
    model = SmallCNN(channels=2, rngs=nnx.Rngs(0))
    before = jax.tree.map(np.array, nnx.to_pure_dict(nnx.state(model, (nnx.Param, nnx.BatchStat))))
    apply_channels_last(model)
    after = nnx.to_pure_dict(nnx.state(model, (nnx.Param, nnx.BatchStat)))
    jax.tree.map(np.testing.assert_array_equal, after, before)


def test_in_a_trainer_it_warns_once_and_the_parameters_are_unchanged():
    x = np.random.default_rng(0).normal(size=(8, 8, 8)).astype(np.float32)
    y = np.arange(8, dtype=np.int32) % 10

    def build(algorithms):
        model = ComposerClassifier(SmallCNN(channels=2, rngs=nnx.Rngs(0)), 10)
        return Trainer(model, ArrayLoader((x, y), 4, shuffle=False), "1ba", optax.sgd(0.1),
                       algorithms=algorithms, progress_bar=False, run_summary=False)

    with pytest.warns(UserWarning, match="XLA chooses each array's memory layout") as caught:
        with_algorithm = build([ChannelsLast()])
    assert sum("ChannelsLast" in str(warning.message) for warning in caught) == 1
    without = build([])
    jax.tree.map(np.testing.assert_array_equal, with_algorithm.state.params, without.state.params)
    assert [t.key for t in with_algorithm.engine.trace_log if t.run] == ["ChannelsLast/INIT"]
