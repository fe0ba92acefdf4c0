"""LabelSmoothing: the closed form of smooth_labels, and one SGD step against plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.label_smoothing import LabelSmoothing, smooth_labels

LR = 0.1
BATCH = 16


def classification_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


def make_trainer(algorithms: list[Algorithm], max_duration: str = "1ba") -> Trainer:
    x, y = classification_data()
    return Trainer(
        ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), num_classes=3),
        ArrayLoader((x, y), batch_size=BATCH, shuffle=False),
        max_duration=max_duration,
        optimizers=optax.sgd(LR),
        algorithms=algorithms,
        progress_bar=False,
    )


def reference_step(targets: np.ndarray) -> dict:
    """One SGD step of the same linear classifier, in plain JAX, against dense ``targets``."""
    linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))
    params = {"kernel": linear.kernel[...], "bias": linear.bias[...]}
    x = classification_data()[0][:BATCH]

    def loss(p: dict) -> jax.Array:
        return optax.softmax_cross_entropy(x @ p["kernel"] + p["bias"], targets).mean()

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads)


class TargetProbe(Algorithm):
    """Keeps the targets the batch holds at AFTER_BACKWARD, to see what LabelSmoothing left there."""

    def init_state(self, state):
        return jnp.zeros((BATCH,), jnp.int32)

    def match(self, event, state):
        return event == Event.AFTER_BACKWARD

    def apply(self, event, state, logger):
        state.algorithm_state[self.name] = state.batch_get_item(1)


def test_integer_labels_become_the_closed_form():
    labels = jnp.array([0, 2, 1])
    smoothed = smooth_labels(jnp.zeros((3, 4)), labels, smoothing=0.2)
    expected = 0.8 * np.eye(4, dtype=np.float32)[[0, 2, 1]] + 0.2 / 4
    np.testing.assert_array_equal(np.asarray(smoothed), expected)
    np.testing.assert_allclose(np.asarray(smoothed).sum(-1), 1.0, rtol=1e-6)


def test_dense_targets_and_sequence_logits_are_smoothed_on_the_last_axis():
    soft = jnp.array([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    np.testing.assert_allclose(np.asarray(smooth_labels(jnp.zeros((2, 3)), soft, 0.3)), 0.7 * soft + 0.1, rtol=1e-6)
    tokens = jnp.array([[0, 1], [2, 0]])
    smoothed = smooth_labels(jnp.zeros((2, 2, 3)), tokens, 0.3)
    assert smoothed.shape == (2, 2, 3)
    np.testing.assert_allclose(np.asarray(smoothed), 0.7 * np.eye(3)[np.asarray(tokens)] + 0.1, rtol=1e-6)


def test_one_training_step_equals_plain_jax_with_smoothed_targets():
    trainer = make_trainer([LabelSmoothing(smoothing=0.2)])
    trainer.fit()
    params = jax.device_get(trainer.state.train_state.params["module"])
    labels = classification_data()[1][:BATCH]
    expected = reference_step(0.8 * np.eye(3, dtype=np.float32)[labels] + 0.2 / 3)
    np.testing.assert_allclose(params["kernel"], expected["kernel"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(params["bias"], expected["bias"], rtol=1e-6, atol=1e-7)
    unsmoothed = reference_step(np.eye(3, dtype=np.float32)[labels])
    assert not np.allclose(params["kernel"], unsmoothed["kernel"], rtol=1e-4, atol=1e-6)


def test_original_targets_are_back_after_the_loss_and_one_compile_serves_every_batch():
    trainer = make_trainer([LabelSmoothing(0.1), TargetProbe()], max_duration="4ba")
    trainer.fit()
    assert trainer.compile_count == 1
    seen = jax.device_get(trainer.state.train_state.algorithm_state["TargetProbe"])
    np.testing.assert_array_equal(seen, classification_data()[1][3 * BATCH:4 * BATCH])
    keys = [trace.key for trace in trainer.engine.trace_log if trace.traced]
    assert keys.count("LabelSmoothing/BEFORE_LOSS") == 4
    assert keys.count("LabelSmoothing/AFTER_LOSS") == 4


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"smoothing": 1.5}, "smoothing=1.5"),
        ({"smoothing": -0.1}, "smoothing=-0.1"),
        ({"target_key": 1.0}, "target_key=1.0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LabelSmoothing(**kwargs)
