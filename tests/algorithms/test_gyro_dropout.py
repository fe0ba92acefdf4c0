"""GyroDropout: sigma fixed masks, tau of them per batch slice, Composer's period and scaling, eval identity."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.gyro_dropout import (
    GyroDropout,
    GyroDropoutLayer,
    apply_gyro_dropout,
    gyro_selection_period,
)
from composerjax.models import SmallCNN
from composerjax.models.surgery import count_modules


def inputs(shape: tuple[int, ...], seed: int = 0) -> jnp.ndarray:
    """Nonzero values, so a zero in the output can only come from the mask."""
    values = np.random.default_rng(seed).uniform(0.5, 2.0, size=shape) * np.random.default_rng(seed + 1).choice(
        [-1.0, 1.0], size=shape)
    return jnp.asarray(values.astype(np.float32))


@nnx.jit
def call(layer: GyroDropoutLayer, x: jnp.ndarray) -> jnp.ndarray:
    return layer(x)


def masks_of(layer: GyroDropoutLayer, x: jnp.ndarray, p: float) -> np.ndarray:
    """Run one training call and recover each sample's 0/1 mask, checking the scaling on the way."""
    out = np.asarray(call(layer, x))
    mask = (out != 0).astype(np.float32)
    np.testing.assert_allclose(out, np.asarray(x) * mask / (1 - p), rtol=1e-6)  # x * mask * 1 / (1 - p)
    return mask


def test_each_batch_slice_uses_one_of_tau_masks_drawn_from_sigma_fixed_ones():
    p, sigma, tau, batch = 0.5, 4, 2, 8
    layer = GyroDropoutLayer(p, sigma, tau, period=1, rngs=nnx.Rngs(dropout=0))
    x = inputs((batch, 32))
    seen = set()
    for _ in range(30):
        mask = masks_of(layer, x, p)
        for start in range(0, batch, batch // tau):  # samples of a slice share their mask
            assert (mask[start:start + batch // tau] == mask[start]).all()
        seen.update(tuple(row) for row in mask)
    assert len(seen) == sigma  # 60 picks with replacement found all 4 pre-selected masks, and no other
    assert int(layer.step[...]) == 30


def test_masks_are_reselected_every_period_calls_only():
    layer = GyroDropoutLayer(0.5, sigma=64, tau=4, period=3, rngs=nnx.Rngs(dropout=1))
    x = inputs((8, 32))
    masks = [masks_of(layer, x, 0.5) for _ in range(12)]
    for selection in range(4):
        first = masks[3 * selection]
        assert all((masks[3 * selection + i] == first).all() for i in (1, 2))
    assert not all((masks[3 * s] == masks[0]).all() for s in range(1, 4))


def test_the_masks_keep_a_1_minus_p_fraction_of_features():
    layer = GyroDropoutLayer(0.3, sigma=8, tau=8, period=1, rngs=nnx.Rngs(dropout=2))
    mask = masks_of(layer, inputs((8, 4096)), 0.3)
    np.testing.assert_allclose(mask.mean(axis=1), 0.7, atol=0.03)


def test_the_mask_is_on_the_last_axis_and_shared_over_the_middle_ones():
    layer = GyroDropoutLayer(0.5, sigma=4, tau=2, rngs=nnx.Rngs(dropout=0))
    mask = masks_of(layer, inputs((4, 5, 16)), 0.5)
    assert (mask == mask[:, :1, :]).all()


def test_eval_is_the_identity_and_does_not_count():
    layer = GyroDropoutLayer(0.5, sigma=4, tau=2, rngs=nnx.Rngs(dropout=0))
    x = inputs((4, 8))
    layer.eval()
    np.testing.assert_array_equal(layer(x), x)
    assert int(layer.step[...]) == 0
    layer.train()
    assert not np.array_equal(layer(x), x)
    np.testing.assert_array_equal(layer(x, deterministic=True), x)


def test_draws_are_fixed_by_the_key():
    x = inputs((4, 16))

    def outputs(seed: int) -> list[np.ndarray]:
        layer = GyroDropoutLayer(0.5, sigma=16, tau=2, rngs=nnx.Rngs(dropout=seed))
        return [np.asarray(layer(x)) for _ in range(3)]

    assert all((a == b).all() for a, b in zip(outputs(0), outputs(0)))
    assert not all((a == b).all() for a, b in zip(outputs(0), outputs(1)))


def test_selection_period_is_composers_iter_num():
    assert gyro_selection_period(100 * 10, 256, 16) == int(100 * 10 / 256) * 16 == 48
    assert gyro_selection_period(8, 4, 2) == 4
    with pytest.raises(ValueError, match="sigma=256"):
        gyro_selection_period(100, 256, 16)


def test_surgery_replaces_dropout_with_the_algorithms_rate():
    model = SmallCNN(channels=2, rngs=nnx.Rngs(0))
    assert apply_gyro_dropout(model, p=0.25, sigma=8, tau=2) == 1
    assert isinstance(model.dropout, GyroDropoutLayer) and model.dropout.p == 0.25  # not the layer's 0.1
    assert count_modules(model, nnx.Dropout) == 0


def test_gyro_dropout_in_a_trainer_sets_the_period_and_counts_steps():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 4)).astype(np.float32)
    y = rng.integers(0, 3, size=16).astype(np.int32)
    rngs = nnx.Rngs(0)
    network = nnx.Sequential(nnx.Linear(4, 8, rngs=rngs), nnx.Dropout(0.1, rngs=rngs), nnx.Linear(8, 3, rngs=rngs))
    trainer = Trainer(ComposerClassifier(network, 3), ArrayLoader((x, y), 4, shuffle=False), "3ep", optax.sgd(0.01),
                      algorithms=[GyroDropout(p=0.5, sigma=4, tau=2)], progress_bar=False, run_summary=False)
    assert count_modules(trainer.state.model, GyroDropoutLayer) == 1
    trainer.fit()
    layer = next(m for _, m in nnx.iter_modules(trainer.state.model) if isinstance(m, GyroDropoutLayer))
    assert int(layer.period[...]) == int(12 / 4) * 2  # 4 batches x 3 epochs, sigma 4, tau 2
    assert int(layer.step[...]) == 12
    assert trainer.compile_count == 1


def test_a_batch_that_does_not_split_into_tau_slices_raises():
    layer = GyroDropoutLayer(0.5, sigma=4, tau=3, rngs=nnx.Rngs(dropout=0))
    with pytest.raises(ValueError, match="tau=3"):
        layer(jnp.ones((4, 2)))


@pytest.mark.parametrize("kwargs, message", [
    ({"p": 1.0}, "p=1.0"),
    ({"p": -0.1}, "p=-0.1"),
    ({"sigma": 0}, "sigma=0"),
    ({"tau": 2.5}, "tau=2.5"),
    ({"seed": "a"}, "seed='a'"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GyroDropout(**kwargs)


def test_composer_defaults():
    algorithm = GyroDropout()
    assert (algorithm.p, algorithm.sigma, algorithm.tau) == (0.5, 256, 16)
