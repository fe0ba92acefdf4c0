"""NaNMonitor: a loss that turns infinite (or NaN) at a known step raises with that batch, value and plan."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, Event, Trainer
from composerjax.callbacks.nan_monitor import NaNMonitor, NonFiniteLossError
from composerjax.loggers import InMemoryLogger


class Passthrough(Algorithm):
    """Matches before every forward and changes nothing: it shows up in the step's plan."""

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state, logger):
        return None


def cross_entropy(model, batch):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]))


def infinite_at_step_5(model, batch, rng, step):
    """Divides by (step - 5)^2: infinite in the step that ends batch 6."""
    return cross_entropy(model, batch) / jnp.square(step.astype(jnp.float32) - 5.0)


def nan_at_step_2(model, batch, rng, step):
    return jnp.where(step == 2, jnp.nan, cross_entropy(model, batch))


def finite(model, batch, rng, step):
    return cross_entropy(model, batch)


def make_trainer(arrays, loss_fn, monitor, **kwargs) -> tuple[Trainer, InMemoryLogger]:
    x, y = arrays
    memory = InMemoryLogger()
    trainer = Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="4ep",
                      optimizers=optax.sgd(0.01), loss_fn=loss_fn, callbacks=[monitor], loggers=[memory],
                      progress_bar=False, run_summary=False, **kwargs)
    return trainer, memory


def test_raises_from_the_trainers_logged_rows(classification_arrays):
    trainer, _ = make_trainer(classification_arrays, infinite_at_step_5, NaNMonitor(), log_interval=2,
                              algorithms=[Passthrough()])
    with pytest.raises(NonFiniteLossError) as raised:
        trainer.fit()
    error = raised.value
    assert isinstance(error, FloatingPointError)
    assert (error.batch, error.loss, error.algorithms) == (6, float("inf"), ("Passthrough/BEFORE_FORWARD",))
    assert "at batch 6" in str(error) and "inf" in str(error) and "Passthrough/BEFORE_FORWARD" in str(error)
    # Batch 6's row is fetched (two intervals behind) during batch 8: the error comes at its end.
    assert trainer.state.timestamp.batch == 8
    assert trainer.compile_count == 1


def test_raises_from_its_own_batched_fetch(classification_arrays):
    trainer, _ = make_trainer(classification_arrays, infinite_at_step_5, NaNMonitor(check_interval=3))
    with pytest.raises(NonFiniteLossError, match=r"loss is inf at batch 6 .*Algorithms in that compiled step: none"):
        trainer.fit()
    # The flags of batches 5-7 are fetched together at batch 8 (the newest step is never waited on).
    assert trainer.state.timestamp.batch == 8


def test_nan_in_one_microbatch_step(classification_arrays):
    trainer, _ = make_trainer(classification_arrays, nan_at_step_2, NaNMonitor(check_interval=1),
                              device_train_microbatch_size=8)
    with pytest.raises(NonFiniteLossError, match="loss is nan at batch 3") as raised:
        trainer.fit()
    assert raised.value.batch == 3
    assert trainer.state.timestamp.batch == 4


@pytest.mark.parametrize("check_interval", [None, 2])
def test_a_finite_run_trains_to_the_end(classification_arrays, check_interval):
    trainer, memory = make_trainer(classification_arrays, finite, NaNMonitor(check_interval))
    trainer.fit()
    assert trainer.state.timestamp.batch == 16
    assert memory.data["train/nan_monitor/nonfinite"] == [(step, 0.0) for step in range(1, 17)]
    assert not any("step_variant" in name for name in memory.data)
    assert trainer.compile_count == 1


def test_invalid_check_interval_is_named():
    with pytest.raises(ValueError, match="check_interval=0"):
        NaNMonitor(check_interval=0)
