"""RandAugment: the pure functions on known images, argument checks, and the Algorithm in a Trainer run."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.augmentation_ops import Augmentation
from composerjax.algorithms.randaugment import RandAugment, randaugment_batch, randaugment_image
from composerjax.models import SmallCNN


def digits_like(n: int = 32, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` random 8x8 images on 17 gray levels (like sklearn's digits / 16) and labels 0..9."""
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 17, size=(n, 8, 8)) / 16.0).astype(np.float32), rng.integers(0, 10, n).astype(np.int32)


randaugment_jit = jax.jit(randaugment_batch, static_argnums=(2, 3, 4))


def test_randaugment_batch_stays_in_range_is_deterministic_and_depends_on_the_key():
    # (N, H, W, C) here; the Trainer test below feeds (N, H, W)
    images = jnp.asarray(np.random.default_rng(1).uniform(size=(6, 8, 8, 3)).astype(np.float32))
    first = randaugment_jit(images, jax.random.key(0), 2, 9.0, "all")
    again = randaugment_jit(images, jax.random.key(0), 2, 9.0, "all")
    other = randaugment_jit(images, jax.random.key(1), 2, 9.0, "all")
    assert first.shape == images.shape and first.dtype == images.dtype
    assert float(first.min()) >= 0.0 and float(first.max()) <= 1.0
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    assert not np.allclose(first, images)
    # each image gets its own random choices: identical inputs come out differently
    same = randaugment_jit(jnp.broadcast_to(images[:1], images.shape), jax.random.key(0), 2, 9.0, "all")
    assert not np.allclose(same[0], same[1])


def test_randaugment_image_applies_depth_augmentations_in_a_row():
    brighten = Augmentation("add_0.1", lambda image, draws, severity: image + 0.1)
    image = jnp.linspace(0.0, 0.6, 16, dtype=jnp.float32).reshape(4, 4)
    out = randaugment_image(image, jax.random.key(3), depth=3, severity=5, augmentation_set=[brighten])
    np.testing.assert_allclose(out, np.clip(np.asarray(image) + 0.3, 0, 1), atol=1e-6)
    out_hwc = randaugment_image(image[..., None], jax.random.key(3), depth=1, severity=5, augmentation_set=[brighten])
    assert out_hwc.shape == (4, 4, 1)
    np.testing.assert_allclose(out_hwc[..., 0], np.asarray(image) + 0.1, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"severity": 11}, r"severity=11: expected a number in \[0, 10\]"),
        ({"severity": -0.5}, r"severity=-0.5"),
        ({"depth": 0}, r"depth=0: expected an integer >= 1"),
        ({"depth": -1}, r"depth=-1: expected an integer >= 1"),
        ({"depth": 2.0}, r"depth=2.0"),
        ({"augmentation_set": "everything"}, r"augmentation_set='everything'.*'all', 'original', 'safe'"),
        ({"input_key": 1.5}, r"input_key=1.5: expected an int index or a str key"),
    ],
)
def test_randaugment_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RandAugment(**kwargs)


def test_randaugment_pure_functions_reject_bad_shapes_and_arguments():
    with pytest.raises(ValueError, match=r"\(N, H, W\) or \(N, H, W, C\)"):
        randaugment_batch(jnp.zeros((8, 8)), jax.random.key(0))
    with pytest.raises(ValueError, match=r"depth=0"):
        randaugment_image(jnp.zeros((8, 8)), jax.random.key(0), depth=0)


def test_randaugment_runs_only_before_the_training_forward():
    algorithm = RandAugment()
    assert algorithm.match(Event.BEFORE_FORWARD, None)
    for event in (Event.EVAL_BEFORE_FORWARD, Event.PREDICT_BEFORE_FORWARD, Event.BEFORE_TRAIN_BATCH, Event.INIT):
        assert not algorithm.match(event, None)
    assert repr(algorithm) == "RandAugment(severity=9, depth=2, augmentation_set='all', input_key=0)"


class MicrobatchInputs(Algorithm):
    """Keeps the images the model saw in each of the two microbatches of the last step (its device state)."""

    def init_state(self, state):
        return {"count": jnp.zeros((), jnp.int32), "seen": jnp.zeros((2, 4, 8, 8), jnp.float32)}

    def match(self, event, state):
        return event == Event.BEFORE_FORWARD

    def apply(self, event, state, logger):
        count, seen = state.algorithm_state[self.name]["count"], state.algorithm_state[self.name]["seen"]
        seen = seen.at[count % 2].set(state.batch_get_item(0))
        state.algorithm_state[self.name] = {"count": count + 1, "seen": seen}


def fit(algorithms: list[Algorithm], x: np.ndarray, y: np.ndarray) -> Trainer:
    model = ComposerClassifier(SmallCNN(num_classes=10, channels=4, rngs=nnx.Rngs(0)), num_classes=10)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=8, shuffle=False), "4ba", optax.sgd(0.1),
                      algorithms=algorithms, device_train_microbatch_size=4, progress_bar=False)
    trainer.fit()
    return trainer


def test_randaugment_in_a_trainer_changes_the_inputs_with_one_compile():
    x, y = digits_like()
    # In every batch of 8 the second microbatch repeats the first, but for one pixel of its last image.
    x[4::8], x[5::8], x[6::8] = x[0::8], x[1::8], x[2::8]
    augmented = fit([MicrobatchInputs(), RandAugment(severity=9, depth=2), MicrobatchInputs()], x, y)
    plain = fit([MicrobatchInputs()], x, y)
    assert augmented.compile_count == 1 and plain.compile_count == 1

    algorithm_state = augmented.state.train_state.algorithm_state
    last_batch = x[24:32].reshape(2, 4, 8, 8)
    np.testing.assert_array_equal(algorithm_state["MicrobatchInputs"]["seen"], last_batch)  # before RandAugment
    seen = np.asarray(algorithm_state["MicrobatchInputs#1"]["seen"])
    assert seen.shape == (2, 4, 8, 8) and seen.min() >= 0.0 and seen.max() <= 1.0
    assert not np.allclose(seen[0], last_batch[0]) and not np.allclose(seen[1], last_batch[1])
    # Equal images at the same place in the two microbatches of a step get their own random ops. A pair
    # can still come out equal when both draws are ops that leave an 8x8 image as it is (equalize), so
    # require most pairs, not all, to differ.
    differing = sum(not np.allclose(seen[0, index], seen[1, index]) for index in range(3))
    assert differing >= 2

    traced = [t for t in augmented.engine.trace_log if t.key == "RandAugment/BEFORE_FORWARD"]
    assert len(traced) == 4 and all(t.traced for t in traced)
    params, baseline = (jax.device_get(t.state.train_state.params) for t in (augmented, plain))
    # The first convolution's kernel saw the augmented pixels (its bias is followed by BatchNorm, which
    # cancels it: its gradient is zero up to rounding in both runs, so it cannot tell them apart).
    kernel = params["module"]["conv1"]["kernel"]
    assert not np.allclose(kernel, baseline["module"]["conv1"]["kernel"])
