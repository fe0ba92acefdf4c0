"""ColOut: kept rows and columns are exact copies, the shape shrinks once, and training equals plain JAX."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, State, Trainer
from composerjax.algorithms.colout import ColOut, colout_batch, colout_indices, kept_size

LR = 0.1
BATCH = 8
SIZE = 8
STEPS = 3


def image_data(n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, SIZE, SIZE, 2)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


class PooledLinear(nnx.Module):
    """Global average pooling, then a linear layer: takes images of any size."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(2, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x.mean(axis=(1, 2)))


class StepKeyProbe(Algorithm):
    """Keeps the raw data of every step's random key, so a test can redraw what ColOut drew."""

    def init_state(self, state):
        return jnp.zeros((STEPS, 2), jnp.uint32)

    def match(self, event, state):
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event, state, logger):
        keys = state.algorithm_state[self.name]
        state.algorithm_state[self.name] = keys.at[state.step].set(jax.random.key_data(state.step_rng))


class InputShapeProbe(Algorithm):
    """Records the image shape the model's forward receives (host-side, while tracing)."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def match(self, event, state):
        return event == Event.AFTER_FORWARD

    def apply(self, event, state, logger):
        self.shapes.append(tuple(state.batch_get_item(0).shape))


def test_kept_size_truncates_the_kept_fraction_as_composer():
    assert kept_size(8, 0.15) == 6  # int(6.8), as Composer's int((1 - p) * size); rounding would keep 7
    assert kept_size(32, 0.15) == 27
    assert kept_size(10, 0.0) == 10
    assert kept_size(3, 0.9) == 1


@pytest.mark.parametrize("channels", [None, 2], ids=["NHW", "NHWC"])
def test_kept_rows_and_columns_are_exact_copies_in_order(channels):
    x = image_data(BATCH)[0] if channels else image_data(BATCH)[0][..., 0]
    rng = jax.random.key(4)
    out = np.asarray(colout_batch(jnp.asarray(x), p_row=0.25, p_col=0.5, rng=rng))
    rows, cols = (np.asarray(i) for i in colout_indices(rng, SIZE, SIZE, 0.25, 0.5))
    assert out.shape == (BATCH, 6, 4) + ((channels,) if channels else ())
    assert (np.diff(rows) > 0).all() and (np.diff(cols) > 0).all() and rows.max() < SIZE and cols.max() < SIZE
    np.testing.assert_array_equal(out, x[:, rows][:, :, cols])


def test_per_example_draws_its_own_rows_and_columns_for_each_image():
    x = image_data(BATCH)[0]
    rng = jax.random.key(1)
    out = np.asarray(colout_batch(jnp.asarray(x), 0.25, 0.25, rng=rng, per_example=True))
    drawn = set()
    for i, key in enumerate(jax.random.split(rng, BATCH)):
        rows, cols = (np.asarray(a) for a in colout_indices(key, SIZE, SIZE, 0.25, 0.25))
        np.testing.assert_array_equal(out[i], x[i][rows][:, cols])
        drawn.add((tuple(rows), tuple(cols)))
    assert len(drawn) > 1


def test_segmentation_targets_lose_the_same_rows_and_columns():
    x, _ = image_data(BATCH)
    masks = np.arange(BATCH * SIZE * SIZE, dtype=np.int32).reshape((BATCH, SIZE, SIZE))
    colout = ColOut(p_row=0.25, p_col=0.25)
    state = State(model=None)
    state.batch, state.step_rng = (jnp.asarray(x), jnp.asarray(masks)), jax.random.key(2)
    colout.apply(Event.BEFORE_FORWARD, state, None)
    rows, cols = (np.asarray(a) for a in colout_indices(colout.sample_key(jax.random.key(2)), SIZE, SIZE, 0.25, 0.25))
    np.testing.assert_array_equal(np.asarray(state.batch[0]), x[:, rows][:, :, cols])
    np.testing.assert_array_equal(np.asarray(state.batch[1]), masks[:, rows][:, :, cols])

    labels = np.arange(BATCH, dtype=np.int32)
    state.batch = (jnp.asarray(x), jnp.asarray(labels))
    ColOut(resize_target="auto").apply(Event.BEFORE_FORWARD, state, None)
    np.testing.assert_array_equal(np.asarray(state.batch[1]), labels)
    with pytest.raises(ValueError, match="resize_target=True"):
        ColOut(resize_target=True).apply(Event.BEFORE_FORWARD, state, None)


def test_training_equals_plain_jax_colout_with_one_compile():
    colout, shapes = ColOut(p_row=0.25, p_col=0.15), InputShapeProbe()
    x_all, y_all = image_data()
    trainer = Trainer(
        ComposerClassifier(PooledLinear(nnx.Rngs(0)), num_classes=3),
        ArrayLoader((x_all, y_all), batch_size=BATCH, shuffle=False),
        max_duration=f"{STEPS}ba",
        optimizers=optax.sgd(LR),
        algorithms=[colout, StepKeyProbe(), shapes],
        progress_bar=False,
    )
    trainer.fit()
    assert trainer.compile_count == 1
    assert shapes.shapes == [(BATCH, 6, 6, 2)]  # traced once, with the shrunk images
    keys = [trace.key for trace in trainer.engine.trace_log if trace.traced]
    assert keys.count("ColOut/BEFORE_FORWARD") == STEPS

    linear = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = {"kernel": linear.kernel[...], "bias": linear.bias[...]}
    key_data = np.asarray(jax.device_get(trainer.state.train_state.algorithm_state["StepKeyProbe"]))
    for step, row in enumerate(key_data):
        rows, cols = (np.asarray(a) for a in colout_indices(colout.sample_key(jax.random.wrap_key_data(row)),
                                                             SIZE, SIZE, 0.25, 0.15))
        x = x_all[step * BATCH:(step + 1) * BATCH][:, rows][:, :, cols].mean(axis=(1, 2))
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
        ({"p_row": 1.0}, "p_row=1.0"),
        ({"p_col": -0.1}, "p_col=-0.1"),
        ({"batch": "yes"}, "batch='yes'"),
        ({"resize_target": "always"}, "resize_target='always'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ColOut(**kwargs)
