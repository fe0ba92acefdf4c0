"""SAM: the perturbation's closed form, and whole runs against a plain-JAX two-pass SAM loop."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.algorithms.sam import SAM, sam_gradients, sam_perturbation

LR = 0.1
BATCH = 16
RHO = 0.5


def regression_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = np.sin(x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)
    return x, y


class TinyMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def mse(model: nnx.Module, batch: tuple) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def run_trainer(algorithms: list, steps: int) -> Trainer:
    x, y = regression_data()
    trainer = Trainer(TinyMLP(nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), f"{steps}ba",
                      optax.sgd(LR), loss_fn=mse, algorithms=algorithms, progress_bar=False)
    trainer.fit()
    return trainer


def reference_loss(p: dict, xb: np.ndarray, yb: np.ndarray) -> jax.Array:
    hidden = jnp.tanh(xb @ p["hidden"]["kernel"] + p["hidden"]["bias"])
    return jnp.mean((hidden @ p["out"]["kernel"] + p["out"]["bias"] - yb) ** 2)


@functools.partial(jax.jit, static_argnames=("sam",))
def reference_step(params: dict, xb: np.ndarray, yb: np.ndarray, sam: bool, rho: float, epsilon: float) -> dict:
    """One SGD step; with ``sam``, two passes: ascend to w + e, then take the gradient there."""
    grads = jax.grad(reference_loss)(params, xb, yb)
    if sam:
        scale = rho / (jnp.sqrt(sum(jnp.sum(g ** 2) for g in jax.tree.leaves(grads))) + epsilon)
        perturbed = jax.tree.map(lambda p, g: p + scale * g, params, grads)
        grads = jax.grad(reference_loss)(perturbed, xb, yb)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


def reference_run(steps: int, sam_steps: set[int], rho: float = RHO, epsilon: float = 1e-12) -> dict:
    """Plain JAX: SGD on the same MLP, with SAM's two passes on ``sam_steps``."""
    params = jax.device_get(nnx.to_pure_dict(nnx.state(TinyMLP(nnx.Rngs(0)), nnx.Param)))
    x, y = regression_data()
    for step in range(steps):
        start = (step * BATCH) % len(x)
        params = reference_step(params, x[start:start + BATCH], y[start:start + BATCH], step in sam_steps, rho,
                                epsilon)
    return jax.device_get(params)


def assert_params_close(actual: dict, expected: dict) -> None:
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_sam_perturbation_has_length_rho_along_the_gradient():
    grads = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[2.0]])}
    e = sam_perturbation(grads, rho=0.3)
    np.testing.assert_allclose(e["a"], 0.3 * np.array([1.0, 2.0]) / 3.0, rtol=1e-6)
    np.testing.assert_allclose(e["b"], [[0.3 * 2.0 / 3.0]], rtol=1e-6)
    assert np.isfinite(jax.tree.leaves(sam_perturbation({"z": jnp.zeros(3)}))[0]).all()  # epsilon guards 0 / 0


def test_sam_gradients_is_the_gradient_at_the_perturbed_point():
    def loss(p):
        return jnp.sum(jnp.cos(p["w"]))

    params = {"w": jnp.array([0.3, -1.2])}
    grads = jax.grad(loss)(params)
    e = 0.1 * grads["w"] / jnp.linalg.norm(grads["w"])
    np.testing.assert_allclose(sam_gradients(jax.grad(loss), params, grads, 0.1)["w"], -np.sin(params["w"] + e),
                               rtol=1e-6)


def test_sam_every_step_equals_the_two_pass_reference():
    trainer = run_trainer([SAM(rho=RHO)], steps=3)
    assert_params_close(trainer.state.train_state.params, reference_run(3, sam_steps={0, 1, 2}))
    assert trainer.compile_count == 1
    # SAM really changes the update: plain SGD ends elsewhere.
    plain = reference_run(3, sam_steps=set())
    assert not np.allclose(jax.tree.leaves(trainer.state.train_state.params)[0], jax.tree.leaves(plain)[0])


def test_sam_interval_two_runs_on_every_second_step_with_two_cached_plans():
    trainer = run_trainer([SAM(rho=RHO, interval=2)], steps=4)
    assert_params_close(trainer.state.train_state.params, reference_run(4, sam_steps={1, 3}))
    assert trainer.compile_count == 2
    traced = [t.batch for t in trainer.engine.trace_log if t.traced and t.key == "SAM/AFTER_BACKWARD"]
    assert traced == [1, 3]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rho": -0.1}, "rho=-0.1"),
        ({"epsilon": 0}, "epsilon=0"),
        ({"interval": 0}, "interval=0"),
        ({"interval": 1.5}, "interval=1.5"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SAM(**kwargs)
