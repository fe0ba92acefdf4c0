"""LRMonitor: logged learning rates equal the schedule at each step; a warning without inject_hyperparams."""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.callbacks.lr_monitor import LRMonitor, find_learning_rates
from composerjax.loggers import InMemoryLogger


def schedule(count):
    return 0.1 / (1.0 + count)


def fit(classification_arrays, make_tiny_classifier, optimizer, monitor, duration="2ep"):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration=duration,
                      optimizers=optimizer, callbacks=[monitor], loggers=[memory], progress_bar=False,
                      run_summary=False)
    trainer.fit()
    return trainer, memory


def test_logged_rates_follow_the_schedule(classification_arrays, make_tiny_classifier):
    optimizer = optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    trainer, memory = fit(classification_arrays, make_tiny_classifier, optimizer, LRMonitor(fetch_interval=3))
    logged = memory.data["lr-optimizer"]
    assert [step for step, _ in logged] == list(range(1, 9))
    # Step n used schedule(n - 1): the optimizer's count before its update.
    np.testing.assert_allclose([rate for _, rate in logged], [schedule(n - 1) for n in range(1, 9)], rtol=1e-6)
    assert trainer.compile_count == 1


def test_rates_inside_a_chain_are_named_by_their_position(classification_arrays, make_tiny_classifier):
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(0.1, 0.0, 4)))
    _, memory = fit(classification_arrays, make_tiny_classifier, optimizer, LRMonitor(), duration="5ba")
    np.testing.assert_allclose([rate for _, rate in memory.data["lr-optimizer/1"]],
                               [0.1, 0.075, 0.05, 0.025, 0.0], atol=1e-7)


def test_warns_once_without_inject_hyperparams(classification_arrays, make_tiny_classifier):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, memory = fit(classification_arrays, make_tiny_classifier, optax.sgd(0.1), LRMonitor())
    messages = [str(w.message) for w in caught if "LRMonitor" in str(w.message)]
    assert len(messages) == 1 and "optax.inject_hyperparams" in messages[0]
    assert not any(name.startswith("lr-") for name in memory.data)


def test_find_learning_rates_skips_states_without_a_learning_rate():
    opt_state = optax.chain(optax.inject_hyperparams(optax.add_decayed_weights)(weight_decay=0.1),
                            optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)).init(jnp.zeros(3))
    assert list(find_learning_rates(opt_state)) == ["lr-optimizer/1"]


def test_invalid_fetch_interval_is_named():
    with pytest.raises(ValueError, match="fetch_interval=0"):
        LRMonitor(fetch_interval=0)
