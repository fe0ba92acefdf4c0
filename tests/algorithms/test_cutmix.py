"""CutMix: the pasted box and its exact area, and SGD steps inside a Trainer against plain JAX."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, State, Trainer
from composerjax.algorithms.cutmix import CutMix, box_mask, cutmix_batch, cutmix_box, cutmix_sample, cutmix_targets
from composerjax.algorithms.mixup import MixUp

LR = 0.1
BATCH = 8
SIZE = 6
STEPS = 3


def image_data(n: int = 24) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, SIZE, SIZE)).astype(np.float32), rng.integers(0, 3, size=n).astype(np.int32)


class FlatLinear(nnx.Module):
    """Logits from flattened images: the smallest model whose update a plain-JAX reference can redo."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(SIZE * SIZE, 3, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear(x.reshape((x.shape[0], -1)))


class StepKeyProbe(Algorithm):
    """Keeps the raw data of every step's random key, so a test can redraw what CutMix drew."""

    def init_state(self, state):
        return jnp.zeros((STEPS, 2), jnp.uint32)

    def match(self, event, state):
        return event == Event.BEFORE_TRAIN_BATCH

    def apply(self, event, state, logger):
        keys = state.algorithm_state[self.name]
        state.algorithm_state[self.name] = keys.at[state.step].set(jax.random.key_data(state.step_rng))


def make_trainer(algorithms: list[Algorithm], max_duration: str = f"{STEPS}ba") -> Trainer:
    x, y = image_data()
    return Trainer(
        ComposerClassifier(FlatLinear(nnx.Rngs(0)), num_classes=3),
        ArrayLoader((x, y), batch_size=BATCH, shuffle=False),
        max_duration=max_duration,
        optimizers=optax.sgd(LR),
        algorithms=algorithms,
        progress_bar=False,
    )


def pasted(x: np.ndarray, bbox: np.ndarray, perm: np.ndarray) -> np.ndarray:
    """The CutMix image batch written with numpy slicing."""
    top, left, bottom, right = bbox
    expected = x.copy()
    expected[:, top:bottom, left:right] = x[perm][:, top:bottom, left:right]
    return expected


def test_the_box_is_pasted_exactly_and_lambda_is_its_exact_kept_area():
    x = np.random.default_rng(1).normal(size=(BATCH, SIZE, SIZE, 2)).astype(np.float32)
    y = np.arange(BATCH, dtype=np.int32)
    perm = np.roll(np.arange(BATCH), 1)
    full_sides = set()
    for seed, lam in enumerate(np.linspace(0.05, 0.95, 12)):
        bbox = np.asarray(cutmix_box(jax.random.key(seed), SIZE, SIZE, lam))
        mixed, permuted, adjusted = cutmix_batch(jnp.asarray(x), jnp.asarray(y), jnp.asarray(bbox), jnp.asarray(perm))
        np.testing.assert_array_equal(np.asarray(mixed), pasted(x, bbox, perm))
        np.testing.assert_array_equal(np.asarray(permuted), perm)
        mask = np.asarray(box_mask(jnp.asarray(bbox), SIZE, SIZE))
        assert mask.sum() == (bbox[2] - bbox[0]) * (bbox[3] - bbox[1])
        assert float(adjusted) == pytest.approx(1.0 - mask.sum() / SIZE**2, abs=1e-7)
        # Nominal side floor(SIZE * sqrt(1 - lam)), spanning side // 2 either side of the centre.
        nominal = 2 * (int(np.floor(SIZE * np.sqrt(1 - np.float32(lam)))) // 2)
        assert 0 <= bbox[0] <= bbox[2] <= SIZE and bbox[2] - bbox[0] <= nominal and bbox[3] - bbox[1] <= nominal
        full_sides.add(bbox[2] - bbox[0] == nominal)
    assert full_sides == {True, False}  # some boxes are clipped at the border, some are not


def test_sample_draws_a_permutation_and_a_box_inside_the_image():
    for seed in range(5):
        bbox, indices = cutmix_sample(jax.random.key(seed), BATCH, SIZE, SIZE, 1.0, False)
        assert sorted(np.asarray(indices).tolist()) == list(range(BATCH))
        top, left, bottom, right = np.asarray(bbox)
        assert 0 <= top <= bottom <= SIZE and 0 <= left <= right <= SIZE


def test_uniform_sampling_covers_the_border_as_often_as_the_centre():
    lambdas = np.random.default_rng(0).uniform(size=300)

    def border_over_centre(uniform: bool) -> float:
        coverage = np.zeros((SIZE, SIZE))
        for seed, lam in enumerate(lambdas):
            top, left, bottom, right = np.asarray(cutmix_box(jax.random.key(seed), SIZE, SIZE, lam, uniform))
            coverage[top:bottom, left:right] += 1
        rows, cols = coverage.sum(1), coverage.sum(0)
        middle = [SIZE // 2 - 1, SIZE // 2]
        return (rows[[0, -1]].sum() + cols[[0, -1]].sum()) / (rows[middle].sum() + cols[middle].sum())

    assert border_over_centre(False) < 0.8  # centres uniform over the image: the border is covered less
    assert 0.88 < border_over_centre(True) < 1.12


def test_cutmix_targets_weight_each_example_by_its_kept_area():
    eye = np.eye(3, dtype=np.float32)
    mixed = cutmix_targets(jnp.array([0, 1, 2]), 0.64, jnp.array([1, 2, 0]), num_classes=3)
    np.testing.assert_allclose(np.asarray(mixed), 0.64 * eye + 0.36 * eye[[1, 2, 0]], rtol=1e-6)
    with pytest.raises(ValueError, match="num_classes"):
        cutmix_targets(jnp.array([0, 1]), 0.5, jnp.array([1, 0]))


def test_segmentation_targets_get_the_box_pasted_instead_of_mixed():
    x, _ = image_data(BATCH)
    masks = np.random.default_rng(2).integers(0, 3, size=(BATCH, SIZE, SIZE)).astype(np.int32)
    cutmix = CutMix()
    state = State(model=None)
    state.batch, state.step_rng, state.outputs = (jnp.asarray(x), jnp.asarray(masks)), jax.random.key(5), None
    cutmix.apply(Event.BEFORE_FORWARD, state, None)
    state.outputs = jnp.zeros((BATCH, SIZE, SIZE, 3))
    cutmix.apply(Event.BEFORE_LOSS, state, None)
    bbox, indices = cutmix_sample(cutmix.sample_key(jax.random.key(5)), BATCH, SIZE, SIZE, 1.0, False)
    np.testing.assert_array_equal(np.asarray(state.batch[0]), pasted(x, np.asarray(bbox), np.asarray(indices)))
    np.testing.assert_array_equal(np.asarray(state.batch[1]), pasted(masks, np.asarray(bbox), np.asarray(indices)))


def test_training_equals_plain_jax_cutmix_with_one_compile():
    cutmix = CutMix(alpha=1.0)
    trainer = make_trainer([cutmix, StepKeyProbe()])
    trainer.fit()
    assert trainer.compile_count == 1
    keys = [trace.key for trace in trainer.engine.trace_log if trace.traced]
    assert keys.count("CutMix/BEFORE_FORWARD") == STEPS
    assert keys.count("CutMix/BEFORE_LOSS") == STEPS

    linear = nnx.Linear(SIZE * SIZE, 3, rngs=nnx.Rngs(0))
    params = {"kernel": linear.kernel[...], "bias": linear.bias[...]}
    x_all, y_all = image_data()
    eye = np.eye(3, dtype=np.float32)
    key_data = np.asarray(jax.device_get(trainer.state.train_state.algorithm_state["StepKeyProbe"]))
    for step, row in enumerate(key_data):
        bbox, indices = cutmix_sample(cutmix.sample_key(jax.random.wrap_key_data(row)), BATCH, SIZE, SIZE,
                                      1.0, False)
        bbox, perm = np.asarray(bbox), np.asarray(indices)
        x, y = x_all[step * BATCH:(step + 1) * BATCH], y_all[step * BATCH:(step + 1) * BATCH]
        x_mixed = pasted(x, bbox, perm).reshape((BATCH, -1))
        lam = 1.0 - (bbox[2] - bbox[0]) * (bbox[3] - bbox[1]) / SIZE**2
        targets = lam * eye[y] + (1 - lam) * eye[y[perm]]
        grads = jax.grad(lambda p, x_mixed=x_mixed, targets=targets: optax.softmax_cross_entropy(
            x_mixed @ p["kernel"] + p["bias"], targets).mean())(params)
        params = jax.tree.map(lambda p, g: p - LR * g, params, grads)
    trained = jax.device_get(trainer.state.train_state.params["module"]["linear"])
    np.testing.assert_allclose(trained["kernel"], params["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], params["bias"], rtol=1e-5, atol=1e-6)


def test_interpolated_loss_weights_the_model_loss_by_the_kept_area():
    x, y = (jnp.asarray(a[:BATCH]) for a in image_data())
    model = ComposerClassifier(FlatLinear(nnx.Rngs(0)), num_classes=3)
    cutmix = CutMix(interpolate_loss=True)
    assert cutmix.match(Event.BEFORE_BACKWARD, None) and not cutmix.match(Event.BEFORE_LOSS, None)
    state = State(model=model)
    state.batch, state.step_rng = (x, y), jax.random.key(3)
    cutmix.apply(Event.BEFORE_FORWARD, state, None)
    state.outputs = model.forward(state.batch)
    state.loss = model.loss(state.outputs, state.batch)
    cutmix.apply(Event.BEFORE_BACKWARD, state, None)
    bbox, indices = cutmix_sample(cutmix.sample_key(jax.random.key(3)), BATCH, SIZE, SIZE, 1.0, False)
    bbox, perm = np.asarray(bbox), np.asarray(indices)
    lam = 1.0 - (bbox[2] - bbox[0]) * (bbox[3] - bbox[1]) / SIZE**2
    logits = model.forward((jnp.asarray(pasted(np.asarray(x), bbox, perm)), y))
    expected = (lam * optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
                + (1 - lam) * optax.softmax_cross_entropy_with_integer_labels(logits, y[perm]).mean())
    assert float(state.loss) == pytest.approx(float(expected), rel=1e-6)
    np.testing.assert_array_equal(np.asarray(state.batch[1]), np.asarray(y))  # targets untouched


def test_mixup_and_cutmix_both_interpolating_the_loss_warn():
    # The trainer plans (matches and orders) the step's algorithms with the engine's default passes.
    events = [Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.BEFORE_BACKWARD]
    trainer = make_trainer([MixUp(interpolate_loss=True), CutMix(interpolate_loss=True)])
    with pytest.warns(UserWarning, match="interpolate the loss"):
        trainer.engine.plan(events)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_trainer([MixUp(), CutMix()]).engine.plan(events)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"alpha": 0.0}, "alpha=0.0"),
        ({"uniform_sampling": "yes"}, "uniform_sampling='yes'"),
        ({"target_key": 1.5}, "target_key=1.5"),
        ({"num_classes": 0}, "num_classes=0"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CutMix(**kwargs)
