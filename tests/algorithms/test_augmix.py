"""AugMix: the mixing rule on known weights, the pure functions, argument checks, and the Algorithm in a Trainer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.augmentation_ops import Augmentation
from composerjax.algorithms.augmix import AugMix, augmix_batch, augmix_image, mix_augmented
from composerjax.models import SmallCNN


def digits_like(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random 8x8 images on 17 gray levels (like sklearn's digits / 16) and labels 0..9."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 17, size=(n, 8, 8)) / 16.0).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


def test_mix_augmented_follows_the_augmix_formula():
    image = jnp.asarray(np.random.default_rng(0).uniform(size=(4, 4, 3)).astype(np.float32))
    augmented = jnp.stack([image * 0.5, 1.0 - image, jnp.full_like(image, 0.2)])
    # mixing weight 0: the original, whatever the chains
    np.testing.assert_array_equal(mix_augmented(image, augmented, jnp.array([0.2, 0.3, 0.5]), 0.0), image)
    # mixing weight 1 with one chain weighted 1: that chain
    np.testing.assert_allclose(mix_augmented(image, augmented, jnp.array([0.0, 1.0, 0.0]), 1.0), augmented[1],
                               atol=1e-7)
    weights, m = np.array([0.2, 0.3, 0.5], np.float32), 0.25
    expected = (1 - m) * np.asarray(image) + m * np.tensordot(weights, np.asarray(augmented), axes=1)
    np.testing.assert_allclose(mix_augmented(image, augmented, jnp.asarray(weights), m), expected, rtol=1e-6)


augmix_image_jit = jax.jit(augmix_image, static_argnames=("severity", "depth", "width", "alpha", "augmentation_set"))
BRIGHTEN = (Augmentation("add_0.1", lambda image, draws, severity: image + 0.1),)


@pytest.mark.parametrize("alpha", [1.0, 0.1])
def test_augmix_image_mixes_chains_of_depth_augmentations(alpha):
    # Each augmentation adds 0.1, so a chain of depth d gives x + 0.1 d whatever it picks; any convex
    # mix of chains of depth 2 is x + 0.2 m, with m in [0, 1] the (Beta-drawn) mixing weight.
    image = jnp.full((4, 4), 0.3, jnp.float32)
    out = np.asarray(augmix_image_jit(image, jax.random.key(0), depth=2, width=3, alpha=alpha,
                                      augmentation_set=BRIGHTEN))
    assert out.shape == (4, 4)
    m = (out[0, 0] - 0.3) / 0.2
    assert 0.0 <= m <= 1.0
    np.testing.assert_allclose(out, 0.3 + 0.2 * m, atol=1e-6)


def test_augmix_random_depth_draws_one_to_three_augmentations_per_chain():
    # The shift is m times a convex mix of chain depths 0.1 * (1..3), so it lies in [0, 0.3].
    image = jnp.full((4, 4), 0.3, jnp.float32)
    shifts = [float(augmix_image_jit(image, jax.random.key(k), depth=-1, augmentation_set=BRIGHTEN)[0, 0]) - 0.3
              for k in range(3)]
    assert all(-1e-6 <= shift <= 0.3 + 1e-6 for shift in shifts) and len(set(shifts)) == 3


augmix_jit = jax.jit(augmix_batch, static_argnums=(2, 3, 4, 5, 6))


def test_augmix_batch_stays_in_range_is_deterministic_and_depends_on_the_key():
    # (N, H, W, C) here; the Trainer test below feeds (N, H, W)
    images = jnp.asarray(np.random.default_rng(1).uniform(size=(6, 8, 8, 3)).astype(np.float32))
    first = augmix_jit(images, jax.random.key(0), 3.0, -1, 3, 1.0, "all")
    again = augmix_jit(images, jax.random.key(0), 3.0, -1, 3, 1.0, "all")
    other = augmix_jit(images, jax.random.key(1), 3.0, -1, 3, 1.0, "all")
    assert first.shape == images.shape and first.dtype == images.dtype
    assert float(first.min()) >= 0.0 and float(first.max()) <= 1.0
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    assert not np.allclose(first, images)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"severity": 10.5}, r"severity=10.5: expected a number in \[0, 10\]"),
        ({"depth": 0}, r"depth=0: expected an integer >= 1, or -1"),
        ({"depth": -2}, r"depth=-2"),
        ({"width": 0}, r"width=0: expected an integer >= 1"),
        ({"alpha": 0.0}, r"alpha=0.0: expected a number > 0"),
        ({"augmentation_set": "most"}, r"augmentation_set='most'.*'all', 'original', 'safe'"),
        ({"input_key": None}, r"input_key=None: expected an int index or a str key"),
    ],
)
def test_augmix_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AugMix(**kwargs)


def test_augmix_pure_functions_reject_bad_shapes_and_arguments():
    with pytest.raises(ValueError, match=r"\(N, H, W\) or \(N, H, W, C\)"):
        augmix_batch(jnp.zeros((8, 8)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"width=0"):
        augmix_image(jnp.zeros((8, 8)), jax.random.key(0), width=0)


def test_augmix_runs_only_before_the_training_forward():
    algorithm = AugMix()
    assert algorithm.match(Event.BEFORE_FORWARD, None)
    for event in (Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD, Event.FIT_START):
        assert not algorithm.match(event, None)
    assert repr(algorithm) == "AugMix(severity=3, depth=-1, width=3, alpha=1.0, augmentation_set='all', input_key=0)"


class LastInputs(Algorithm):
    """Keeps the images the model saw in the last step (its device state)."""

    def init_state(self, state):
        return jnp.zeros((8, 8, 8), jnp.float32)

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state, logger):
        state.algorithm_state[self.name] = state.batch_get_item(0)


def fit(algorithms: list[Algorithm]) -> Trainer:
    x, y = digits_like()
    model = ComposerClassifier(SmallCNN(num_classes=10, channels=4, rngs=nnx.Rngs(0)), num_classes=10)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=8, shuffle=False), "4ba", optax.sgd(0.1),
                      algorithms=algorithms, progress_bar=False)
    trainer.fit()
    return trainer


def test_augmix_in_a_trainer_changes_the_inputs_with_one_compile():
    x, _ = digits_like()
    augmented = fit([AugMix(severity=3, depth=-1, width=3, alpha=1.0), LastInputs()])
    plain = fit([LastInputs()])
    assert augmented.compile_count == 1 and plain.compile_count == 1

    seen = np.asarray(augmented.state.train_state.algorithm_state["LastInputs"])
    np.testing.assert_array_equal(plain.state.train_state.algorithm_state["LastInputs"], x[24:32])
    assert seen.shape == (8, 8, 8) and seen.min() >= 0.0 and seen.max() <= 1.0
    assert not np.allclose(seen, x[24:32])

    traced = [t for t in augmented.engine.trace_log if t.key == "AugMix/BEFORE_FORWARD"]
    assert len(traced) == 4 and all(t.traced for t in traced)
    params, baseline = (jax.device_get(t.state.train_state.params) for t in (augmented, plain))
    # The first convolution's kernel saw the augmented pixels (its bias is followed by BatchNorm, which
    # cancels it: its gradient is zero up to rounding in both runs, so it cannot tell them apart).
    kernel = params["module"]["conv1"]["kernel"]
    assert not np.allclose(kernel, baseline["module"]["conv1"]["kernel"])
