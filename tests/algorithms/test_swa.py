"""SWA: the running mean, and the swapped-in weights against the numpy mean of the snapshots."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.algorithms.swa import (
    SWA,
    advance_swa_learning_rate,
    swa_learning_rate,
    swa_update,
    swalr_rate,
)
from composerjax.optim import LinearScheduler, learning_rate_states

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


def sgd_step(params: dict, step: int, lr: float = LR) -> dict:
    """One plain-JAX SGD step on batch ``step`` (0-based, unshuffled)."""
    x, y = regression_data()
    start = (step * BATCH) % len(x)
    xb, yb = x[start:start + BATCH], y[start:start + BATCH]
    grads = jax.grad(lambda p: jnp.mean((xb @ p["kernel"] + p["bias"] - yb) ** 2))(params)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads)


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


def torch_swalr_rates(lr: float, swa_lr: float, anneal_epochs: int, strategy: str, steps: int) -> list[float]:
    """``group['lr']`` after construction and each ``step()`` of PyTorch's ``SWALR``, following its ``get_lr``.

    The recursive form: each step recovers the starting rate from the current one, then re-anneals.
    """
    anneal = (lambda t: t) if strategy == "linear" else (lambda t: (1 - math.cos(math.pi * t)) / 2)
    rates = []
    for step in range(steps + 1):  # step = _step_count - 1; 0 is the step the constructor takes
        prev_alpha = anneal(max(0.0, min(1.0, (step - 1) / max(1, anneal_epochs))))
        initial = swa_lr if prev_alpha == 1 else (lr - prev_alpha * swa_lr) / (1 - prev_alpha)
        alpha = anneal(max(0.0, min(1.0, step / max(1, anneal_epochs))))
        lr = swa_lr * alpha + initial * (1 - alpha)
        rates.append(lr)
    return rates


@pytest.mark.parametrize("strategy", ["linear", "cos"])
def test_swalr_rate_is_torch_swalr(strategy):
    expected = torch_swalr_rates(0.4, 0.05, 4, strategy, 7)
    actual = [float(swalr_rate(0.4, 0.05, k, 4, strategy)) for k in range(8)]
    np.testing.assert_allclose(actual, expected, rtol=1e-6)
    assert actual[0] == pytest.approx(0.4) and actual[4:] == pytest.approx([0.05] * 4)
    if strategy == "cos":  # the midpoint of a cosine anneal is the mean of the two rates
        assert actual[2] == pytest.approx((0.4 + 0.05) / 2)


@pytest.mark.parametrize("strategy", ["linear", "cos"])
def test_swa_learning_rate_anneals_from_the_rate_at_the_first_advance(strategy):
    optimizer = swa_learning_rate(optax.inject_hyperparams(optax.sgd)(learning_rate=0.3), 0.1, 3, strategy)
    params = jnp.zeros(2)
    state = optimizer.init(params)
    rates, steps = [], []
    for index in range(7):
        updates, state = optimizer.update(jnp.ones(2), state, params)
        rates.append(float(learning_rate_states(state)[0].hyperparams["learning_rate"]))
        steps.append(-float(updates[0]))  # sgd: the update is -rate * gradient
        if index >= 1:  # two plain steps, then an SWA update after every step
            state = advance_swa_learning_rate(state)
    torch_rates = torch_swalr_rates(0.3, 0.1, 3, strategy, 5)
    expected = [0.3, 0.3] + torch_rates[1:]
    np.testing.assert_allclose(rates, expected, rtol=1e-6)
    np.testing.assert_allclose(steps, expected, rtol=1e-6)


def test_swa_learning_rate_refuses_an_optimizer_without_an_injected_rate():
    with pytest.raises(ValueError, match="inject_hyperparams"):
        swa_learning_rate(optax.sgd(0.1), 0.01).init(jnp.zeros(2))


class AppliedRates(Callback):
    def __init__(self) -> None:
        self.rates: list[float] = []

    def batch_end(self, state, logger):  # the rate written into the state is the one the update used
        self.rates.append(float(learning_rate_states(state.train_state.opt_state)[0].hyperparams["learning_rate"]))


@pytest.mark.parametrize("strategy", ["linear", "cos"])
def test_schedule_swa_lr_in_a_trainer_follows_swalr_from_the_scheduled_rate(strategy):
    # 10 batches, the scheduler takes the rate from LR down to 0 linearly; SWA updates after batches
    # 3, 5, 7, 9 (see the test above), each one a SWALR step: batch b uses k = updates done before it.
    x, y = regression_data()
    recorder, snapshots = AppliedRates(), Snapshots()
    swa = SWA(swa_start="0.3dur", swa_end="1.0dur", update_interval="2ba", schedule_swa_lr=True,
              anneal_strategy=strategy, anneal_steps=3, swa_lr=0.01)
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), "10ba",
                      optax.inject_hyperparams(optax.sgd)(learning_rate=LR), loss_fn=mse, algorithms=[swa],
                      callbacks=[recorder, snapshots], schedulers=[LinearScheduler()], progress_bar=False)
    trainer.fit()
    scheduled = [LR * (1 - step / 10) for step in range(10)]
    lr_0 = scheduled[3]  # the scheduler's rate for the batch after the first update
    done = [sum(update <= batch for update in (3, 5, 7, 9)) for batch in range(10)]
    torch_rates = torch_swalr_rates(lr_0, 0.01, 3, strategy, 4)
    expected = [scheduled[step] if done[step] == 0 else torch_rates[done[step]] for step in range(10)]
    np.testing.assert_allclose(recorder.rates, expected, rtol=1e-5)
    params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), snapshots.trained[0])
    for step in range(1, 10):  # the weights moved with exactly these rates
        params = sgd_step(params, step, expected[step])
        assert_tree_close(snapshots.trained[step], params, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"schedule_swa_lr": "yes"}, "schedule_swa_lr='yes'"),
        ({"swa_lr": -0.01}, "swa_lr=-0.01"),
        ({"anneal_strategy": "step"}, "anneal_strategy='step'"),
        ({"anneal_steps": 0}, "anneal_steps=0"),
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


def test_composer_defaults_and_strategy_aliases():
    swa = SWA()
    assert (str(swa.swa_start), str(swa.swa_end), str(swa.update_interval)) == ("0.7dur", "0.97dur", "1ep")
    assert (swa.schedule_swa_lr, swa.anneal_strategy, swa.anneal_steps, swa.swa_lr) == (False, "linear", 10, None)
    assert SWA(anneal_strategy="Cosine").anneal_strategy == "cos"
    assert SWA(anneal_strategy="lin").anneal_strategy == "linear"


def test_schedule_swa_lr_with_epoch_updates_and_no_scheduler():
    # 4 epochs of 4 batches; SWA updates after epochs 1, 2, 3: epoch e uses k = e - 1 SWALR steps.
    x, y = regression_data()
    recorder = AppliedRates()
    swa = SWA(swa_start="1ep", swa_end="3ep", update_interval="1ep", schedule_swa_lr=True, anneal_steps=2,
              swa_lr=0.02)
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), "4ep",
                      optax.inject_hyperparams(optax.sgd)(learning_rate=LR), loss_fn=mse, algorithms=[swa],
                      callbacks=[recorder], progress_bar=False)
    trainer.fit()
    per_epoch = [LR, 0.5 * 0.02 + 0.5 * LR, 0.02, 0.02]
    np.testing.assert_allclose(recorder.rates, np.repeat(per_epoch, 4), rtol=1e-6)
