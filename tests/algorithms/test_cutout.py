"""CutOut: exactly the drawn boxes are zeroed, and SGD steps inside a Trainer equal plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.cutout import CutOut, cutout_batch, cutout_boxes, hole_length, zero_boxes

LR = 0.1
BATCH = 8
SIZE = 8
STEPS = 3


def image_data(n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    # Shifted away from zero, so a zeroed pixel is always a cut one.
    return rng.uniform(1.0, 2.0, size=(n, SIZE, SIZE)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


class FlatLinear(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(SIZE * SIZE, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x.reshape((x.shape[0], -1)))


class StepKeyProbe(Algorithm):
    """Keeps the raw data of every step's random key, so a test can redraw what CutOut drew."""

    def init_state(self, state):
        return jnp.zeros((STEPS, 2), jnp.uint32)

    def match(self, event, state):
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event, state, logger):
        keys = state.algorithm_state[self.name]
        state.algorithm_state[self.name] = keys.at[state.step].set(jax.random.key_data(state.step_rng))


def holed(x: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """The CutOut batch written with numpy slicing."""
    expected = x.copy()
    for top, left, bottom, right in boxes:
        expected[:, top:bottom, left:right] = 0
    return expected


def test_hole_length_is_a_fraction_of_the_smaller_side_or_pixels():
    assert hole_length(0.5, 8, 6) == 3
    assert hole_length(0.25, 32, 32) == 8
    assert hole_length(5, 32, 16) == 5
    assert hole_length(2.7, 32, 16) == 2
    with pytest.raises(ValueError, match="length=0"):
        hole_length(0, 8, 8)


@pytest.mark.parametrize("channels", [None, 3], ids=["NHW", "NHWC"])
def test_exactly_the_drawn_boxes_are_zeroed(channels):
    x = image_data(BATCH)[0]
    if channels:
        x = np.repeat(x[..., None], channels, axis=-1)
    sides = set()
    for seed in range(8):
        rng = jax.random.key(seed)
        boxes = np.asarray(cutout_boxes(rng, SIZE, SIZE, 2, 0.5, False))
        out = np.asarray(cutout_batch(jnp.asarray(x), num_holes=2, length=0.5, rng=rng))
        np.testing.assert_array_equal(out, holed(x, boxes))
        assert ((boxes >= 0) & (boxes <= SIZE)).all()
        assert ((boxes[:, 2] - boxes[:, 0]) <= 4).all() and ((boxes[:, 3] - boxes[:, 1]) <= 4).all()
        sides.update((boxes[:, 2] - boxes[:, 0]).tolist())
    assert 4 in sides  # unclipped holes have the full side length 0.5 * 8


def test_zero_boxes_keeps_the_dtype_and_unions_overlapping_holes():
    images = jnp.ones((1, 4, 4), jnp.bfloat16)
    out = zero_boxes(images, jnp.array([[0, 0, 2, 2], [1, 1, 3, 3]]))
    assert out.dtype == jnp.bfloat16
    assert int((out == 0).sum()) == 7


def test_training_equals_plain_jax_cutout_with_one_compile():
    cutout = CutOut(num_holes=2, length=0.5)
    x_all, y_all = image_data()
    trainer = Trainer(
        ComposerClassifier(FlatLinear(nnx.Rngs(0)), num_classes=3),
        ArrayLoader((x_all, y_all), batch_size=BATCH, shuffle=False),
        max_duration=f"{STEPS}ba",
        optimizers=optax.sgd(LR),
        algorithms=[cutout, StepKeyProbe()],
        progress_bar=False,
    )
    trainer.fit()
    assert trainer.compile_count == 1
    keys = [trace.key for trace in trainer.engine.trace_log if trace.traced]
    assert keys.count("CutOut/BEFORE_FORWARD") == STEPS

    linear = nnx.Linear(SIZE * SIZE, 3, rngs=nnx.Rngs(0))
    params = {"kernel": linear.kernel[...], "bias": linear.bias[...]}
    key_data = np.asarray(jax.device_get(trainer.state.train_state.algorithm_state["StepKeyProbe"]))
    for step, row in enumerate(key_data):
        boxes = np.asarray(cutout_boxes(cutout.sample_key(jax.random.wrap_key_data(row)), SIZE, SIZE, 2, 0.5, False))
        x = holed(x_all[step * BATCH:(step + 1) * BATCH], boxes).reshape((BATCH, -1))
        y = y_all[step * BATCH:(step + 1) * BATCH]
        grads = jax.grad(lambda p, x=x, y=y: optax.softmax_cross_entropy_with_integer_labels(
            x @ p["kernel"] + p["bias"], y).mean())(params)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    trained = jax.device_get(trainer.state.train_state.params["module"]["linear"])
    np.testing.assert_allclose(trained["kernel"], params["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], params["bias"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_holes": 0}, "num_holes=0"),
        ({"length": -0.5}, "length=-0.5"),
        ({"uniform_sampling": None}, "uniform_sampling=None"),
        ({"input_key": 0.0}, "input_key=0.0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CutOut(**kwargs)
