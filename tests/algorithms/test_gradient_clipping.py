"""GradientClipping: clip_gradients against numpy closed forms, and one SGD step against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.algorithms.gradient_clipping import GradientClipping, clip_gradients

LR = 0.1
BATCH = 16


def regression_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def mse(model: nnx.Module, batch: tuple) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def initial_params() -> dict:
    linear = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return {"kernel": np.asarray(linear.kernel[...]), "bias": np.asarray(linear.bias[...])}


def first_batch_grads(size: int = BATCH, start: int = 0) -> dict:
    x, y = regression_data()
    x, y = x[start:start + size], y[start:start + size]

    def loss(p: dict) -> jax.Array:
        return jnp.mean((x @ p["kernel"] + p["bias"] - y) ** 2)

    return jax.device_get(jax.grad(loss)(initial_params()))


def numpy_clip(grads: dict, params: dict, clipping_type: str, threshold: float) -> dict:
    """The three clipping rules written out in numpy."""
    if clipping_type == "norm":
        norm = np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values()))
        scale = min(1.0, threshold / norm)
        return {k: g * scale for k, g in grads.items()}
    if clipping_type == "value":
        return {k: np.clip(g, -threshold, threshold) for k, g in grads.items()}
    clipped = {}
    for key, g in grads.items():
        p = params[key]
        axis = 0 if g.ndim == 2 else None  # a dense kernel's units are its columns; a bias is one unit
        g_norm = np.sqrt(np.sum(g.astype(np.float64) ** 2, axis=axis, keepdims=True))
        p_norm = np.sqrt(np.sum(p.astype(np.float64) ** 2, axis=axis, keepdims=True))
        max_norm = threshold * np.maximum(p_norm, 1e-3)
        clipped[key] = np.where(g_norm < max_norm, g, g * max_norm / np.maximum(g_norm, 1e-6))
    return clipped


# Thresholds chosen so every rule really clips this batch's gradient.
CASES = [("norm", 0.5), ("value", 0.3), ("adaptive", 0.05)]


@pytest.mark.parametrize(("clipping_type", "threshold"), CASES)
def test_clip_gradients_matches_the_closed_form(clipping_type, threshold):
    grads, params = first_batch_grads(), initial_params()
    clipped = jax.device_get(clip_gradients(grads, params, clipping_type, threshold))
    expected = numpy_clip(grads, params, clipping_type, threshold)
    for key in grads:
        np.testing.assert_allclose(clipped[key], expected[key], rtol=1e-5, atol=1e-7)
    assert not np.allclose(clipped["kernel"], grads["kernel"])  # the case really clips


def test_clip_gradients_leaves_small_gradients_alone():
    grads = {"w": jnp.array([0.1, -0.2])}
    for clipping_type in ("norm", "value"):
        np.testing.assert_array_equal(clip_gradients(grads, grads, clipping_type, 10.0)["w"], grads["w"])


@pytest.mark.parametrize(("clipping_type", "threshold"), CASES)
def test_one_sgd_step_uses_the_clipped_gradient(clipping_type, threshold):
    x, y = regression_data()
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), "1ba",
                      optax.sgd(LR), loss_fn=mse, algorithms=[GradientClipping(clipping_type, threshold)],
                      progress_bar=False)
    trainer.fit()
    params = jax.device_get(trainer.state.train_state.params)
    clipped = numpy_clip(first_batch_grads(), initial_params(), clipping_type, threshold)
    for key, p in initial_params().items():
        np.testing.assert_allclose(params[key], p - LR * clipped[key], rtol=1e-5, atol=1e-6)
    assert trainer.compile_count == 1
    opt_state = trainer.state.train_state.opt_state
    assert isinstance(opt_state, tuple) and len(opt_state) == 2  # INIT chained (clip, sgd)


@pytest.mark.parametrize(("clipping_type", "threshold"), [("norm", 0.5), ("adaptive", 0.05)])
def test_microbatches_clip_the_whole_batch_gradient(clipping_type, threshold):
    x, y = regression_data()
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), 32, shuffle=False), "1ba",
                      optax.sgd(LR), loss_fn=mse, algorithms=[GradientClipping(clipping_type, threshold)],
                      device_train_microbatch_size=8, progress_bar=False)
    trainer.fit()
    params = jax.device_get(trainer.state.train_state.params)
    grads = first_batch_grads(32)
    clipped = numpy_clip(grads, initial_params(), clipping_type, threshold)
    for key, p in initial_params().items():
        np.testing.assert_allclose(params[key], p - LR * clipped[key], rtol=1e-5, atol=1e-5)
    # Clipping each microbatch's gradient and averaging would give another update.
    per_microbatch = [numpy_clip(first_batch_grads(8, start), initial_params(), clipping_type, threshold)
                      for start in range(0, 32, 8)]
    averaged = np.mean([c["kernel"] for c in per_microbatch], axis=0)
    assert not np.allclose(averaged, clipped["kernel"], rtol=1e-3)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clipping_type": "global"}, "clipping_type='global'"),
        ({"clipping_threshold": 0.0}, "clipping_threshold=0.0"),
        ({"clipping_threshold": -1}, "clipping_threshold=-1"),
        ({"clipping_threshold": "1"}, "clipping_threshold='1'"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GradientClipping(**kwargs)
