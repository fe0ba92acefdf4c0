"""SWA: the running mean, and the swapped-in weights against the numpy mean of the snapshots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.algorithms.swa import SWA, swa_update

LR = 0.1
BATCH = 16  # 64 samples: 4 batches per epoch


def regression_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def mse(model: nnx.Module, batch: tuple) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


class Snapshots(Callback):
    """``trained[t - 1]``: the weights the optimizer produced at batch t; ``held[t - 1]``: after BATCH_END."""

    def __init__(self) -> None:
        self.trained: list[dict] = []
        self.held: list[dict] = []

    def after_optimizer_step(self, state, logger):  # traced: hand the updated weights out as step metrics
        state.step_metrics["params"] = state.params

    def batch_end(self, state, logger):
        self.trained.append(jax.device_get(state.step_metrics["params"]))
        self.held.append(jax.device_get(state.params))


def run(swa: SWA, max_duration: str) -> tuple[Trainer, Snapshots]:
    x, y = regression_data()
    snapshots = Snapshots()
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), max_duration,
                      optax.sgd(LR), loss_fn=mse, algorithms=[swa], callbacks=[snapshots], progress_bar=False)
    trainer.fit()
    return trainer, snapshots


def mean_of(snapshots: list[dict]) -> dict:
    return jax.tree.map(lambda *leaves: np.mean(np.stack(leaves).astype(np.float64), axis=0), *snapshots)


def sgd_step(params: dict, step: int) -> dict:
    """One plain-JAX SGD step on batch ``step`` (0-based, unshuffled)."""
    x, y = regression_data()
    start = (step * BATCH) % len(x)
    xb, yb = x[start:start + BATCH], y[start:start + BATCH]
    grads = jax.grad(lambda p: jnp.mean((xb @ p["kernel"] + p["bias"] - yb) ** 2))(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def assert_tree_close(actual, expected, rtol=1e-6, atol=1e-6) -> None:
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_swa_update_is_a_running_mean():
    average, count = {"w": jnp.full((2,), 7.0)}, 0  # whatever is there before the first update is dropped
    values = [np.array([1.0, -2.0]), np.array([3.0, 0.5]), np.array([-4.0, 8.0])]
    for value in values:
        average, count = swa_update(average, {"w": jnp.asarray(value, jnp.float32)}, count)
    assert int(count) == 3
    np.testing.assert_allclose(average["w"], np.mean(values, axis=0), rtol=1e-6, atol=1e-6)


def test_batch_interval_average_replaces_the_weights_at_swa_end():
    # 10 batches; the window opens at batch 3 (0.3dur); updates at its 1st, 3rd, ... batch: 3, 5, 7, 9;
    # swa_end = 1.0dur is reached at batch 10, where the weights become the average.
    trainer, snapshots = run(SWA(swa_start="0.3dur", swa_end="1.0dur", update_interval="2ba"), "10ba")
    expected = mean_of([snapshots.trained[t - 1] for t in (3, 5, 7, 9)])
    assert_tree_close(trainer.state.params, expected)
    own = trainer.state.train_state.algorithm_state["SWA"]
    assert int(own["count"]) == 4
    assert_tree_close(own["params"], expected)
    updated = [t.batch for t in trainer.engine.trace_log if t.key == "SWA/AFTER_OPTIMIZER_STEP"]
    assert updated == [2, 4, 6, 8]  # steps counted from 0
    assert trainer.compile_count == 2  # a step with the update, one without


def test_training_continues_from_the_average_after_swa_end():
    # 8 batches; window from batch 2 (0.25dur) to batch 6 (0.75dur), updated every batch.
    trainer, snapshots = run(SWA(swa_start="0.25dur", swa_end="0.75dur", update_interval="1ba"), "8ba")
    average = mean_of([snapshots.trained[t - 1] for t in range(2, 7)])
    assert_tree_close(snapshots.held[5], average)  # swapped in at the end of batch 6
    expected = sgd_step(sgd_step(jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), average), 6), 7)
    assert_tree_close(trainer.state.params, expected, rtol=1e-5)
    assert not np.allclose(snapshots.trained[5]["kernel"], average["kernel"])  # the swap really changed them


def test_epoch_interval_updates_and_swaps_at_epoch_ends():
    # 4 epochs of 4 batches; updates after epochs 1, 2 and 3; swapped in after epoch 3; epoch 4 trains on.
    trainer, snapshots = run(SWA(swa_start="1ep", swa_end="3ep", update_interval="1ep"), "4ep")
    average = mean_of([snapshots.trained[t - 1] for t in (4, 8, 12)])
    own = trainer.state.algorithm_state["SWA"]
    assert int(own["count"]) == 3
    assert_tree_close(own["params"], average)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), average)
    for step in range(12, 16):
        params = sgd_step(params, step)
    assert_tree_close(trainer.state.params, params, rtol=1e-5)
    assert trainer.compile_count == 1  # epoch updates run on the host: the plan never changes


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_swa_lr": True}, "schedule_swa_lr=True"),
        ({"swa_lr": 0.01}, "swa_lr=0.01"),
        ({"swa_start": "5ba"}, "swa_start='5ba'"),
        ({"swa_start": "2ep", "swa_end": "0.9dur"}, "same unit"),
        ({"swa_start": "0.9dur", "swa_end": "0.5dur"}, "swa_end='0.5dur'"),
        ({"swa_end": "1.5dur"}, "swa_end='1.5dur'"),
        ({"update_interval": "10sp"}, "update_interval='10sp'"),
        ({"update_interval": "0ep"}, "update_interval='0ep'"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SWA(**kwargs)
