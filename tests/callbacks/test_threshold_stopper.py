"""ThresholdStopper: training stops at the exact batch or epoch where the metric crosses the threshold."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.callbacks.threshold_stopper import ThresholdStopper


class ScriptedEval(Callback):
    """Listed before the stopper: replaces each evaluation's metric with the next scripted value."""

    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values = name, list(values)

    def eval_end(self, state, logger):
        state.metrics["eval"] = {**state.metrics["eval"], self.name: self.values.pop(0)}


def falling_loss(model, batch, rng, step):
    """10 at step 0, 9 at step 1, ...: the loss logged at batch n is 11 - n."""
    return jnp.asarray(10.0 - step, jnp.float32) + 0.0 * jnp.sum(model(batch[0]))


def fit_falling_loss(arrays, stopper, **kwargs) -> Trainer:
    x, y = arrays
    trainer = Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="10ep",
                      optimizers=optax.sgd(0.1), loss_fn=falling_loss, callbacks=[stopper], progress_bar=False,
                      run_summary=False, **kwargs)
    trainer.fit()
    return trainer


def test_stops_at_the_evaluation_that_crosses(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    # Evaluated after every batch; 0.8 equals the threshold (not above it), 0.81 crosses at batch 4.
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="10ep",
                      optimizers=optax.sgd(0.1), eval_dataloader=ArrayLoader((x, y), batch_size=32),
                      eval_interval="1ba", progress_bar=False, run_summary=False,
                      callbacks=[ScriptedEval("accuracy", [0.5, 0.7, 0.8, 0.81, 0.9, 0.9]),
                                 ThresholdStopper("accuracy", "eval", 0.8)])
    trainer.fit()
    assert trainer.state.timestamp.batch == 4


def test_train_loss_epoch_mean(classification_arrays):
    # Epoch means of the loss: 8.5, 4.5, 0.5: below 4 at the end of epoch 3.
    trainer = fit_falling_loss(classification_arrays, ThresholdStopper("loss", "train", threshold=4.0))
    assert (trainer.state.timestamp.epoch, trainer.state.timestamp.batch) == (3, 12)


def test_train_loss_on_batch(classification_arrays):
    # Batch 6's loss is 5.0 < 5.5. With log_interval=1 the trainer fetches batch 6's values during
    # batch 7 (one interval behind the newest step), so training stops at batch 7.
    trainer = fit_falling_loss(classification_arrays, ThresholdStopper("loss", "train", 5.5, stop_on_batch=True),
                               log_interval=1)
    assert trainer.state.timestamp.batch == 7


def test_train_loss_on_batch_checks_the_values_fetched_at_epoch_end(classification_arrays):
    # Batch 4's loss (7.0) crosses 7.5; it is fetched with the epoch-end flush, so the stop comes at
    # EPOCH_END of epoch 1, before batch 5 runs.
    trainer = fit_falling_loss(classification_arrays, ThresholdStopper("loss", "train", 7.5, stop_on_batch=True),
                               log_interval=1)
    assert trainer.state.timestamp.batch == 4


@pytest.mark.parametrize("kwargs, message", [
    ({"monitor": "accuracy"}, "threshold=None"),
    ({"monitor": "accuracy", "threshold": 0.5, "comp": "bigger"}, "comp='bigger'"),
    ({"monitor": "accuracy", "threshold": 0.5, "stop_on_batch": 1}, "stop_on_batch=1"),
    ({"monitor": "", "threshold": 0.5}, "monitor=''"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ThresholdStopper(**kwargs)
