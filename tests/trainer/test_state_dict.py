"""State.state_dict / load_state_dict: a run resumed mid-epoch ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, Callback, Event, Trainer


class Noise(Algorithm):
    """A stochastic traced algorithm with device state: resume must restore both."""

    def init_state(self, state):
        return {"total": jnp.zeros(())}

    def match(self, event, state):
        return event in (Event.BEFORE_FORWARD, Event.AFTER_TRAIN_BATCH)

    def apply(self, event, state, logger):
        if event == Event.BEFORE_FORWARD:
            x = state.batch_get_item(0)
            state.batch_set_item(0, x + 0.1 * jax.random.normal(state.step_rng, x.shape))
        else:
            own = state.algorithm_state[self.name]
            state.algorithm_state[self.name] = {"total": own["total"] + state.loss}


class CountBatches(Callback):
    def __init__(self) -> None:
        self.batches = 0

    def batch_end(self, state, logger):
        self.batches += 1

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def make_trainer() -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(80, 6)).astype(np.float32)
    y = rng.normal(size=(80, 1)).astype(np.float32)
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(6, 8, rngs=rngs), nnx.relu, nnx.Dropout(0.2, rngs=rngs),
                           nnx.Linear(8, 1, rngs=rngs))
    return Trainer(model, ArrayLoader((x, y), batch_size=16, seed=7), "3ep", optax.adam(1e-2),
                   loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), algorithms=[Noise()],
                   callbacks=[CountBatches()], progress_bar=False)


def test_resume_mid_epoch_is_bit_identical():
    uninterrupted = make_trainer()
    uninterrupted.fit()

    first = make_trainer()
    first.fit("7ba")  # mid-epoch 2 (5 batches per epoch)
    saved = jax.device_get(first.state.state_dict())

    resumed = make_trainer()
    resumed.state.load_state_dict(saved)
    assert resumed.state.timestamp.batch == 7 and resumed.state.timestamp.batch_in_epoch == 2
    resumed.fit()

    wall_clock = resumed.state.timestamp.counts  # float seconds: a timedelta would round them to microseconds
    assert resumed.state.timestamp == uninterrupted.state.timestamp.copy(
        total_wct=wall_clock.total_wct, iteration_wct=wall_clock.iteration_wct, epoch_wct=wall_clock.epoch_wct,
        batch_wct=wall_clock.batch_wct)
    assert resumed.state.callbacks[0].batches == uninterrupted.state.callbacks[0].batches == 15
    expected = jax.device_get(uninterrupted.state.train_state)
    got = jax.device_get(resumed.state.train_state)
    for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)


def test_load_state_dict_rejects_a_mismatched_model():
    trainer = make_trainer()
    saved = jax.device_get(trainer.state.state_dict())
    saved["train_state"]["params"]["layers"][0]["kernel"] = np.zeros((5, 8), np.float32)
    with pytest.raises(ValueError, match=r"shape \(5, 8\), expected \(6, 8\)"):
        make_trainer().state.load_state_dict(saved)
