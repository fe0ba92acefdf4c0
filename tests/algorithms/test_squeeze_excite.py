"""SqueezeExcite: the SE block against a hand computation, which convs get one, training."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.squeeze_excite import (
    SqueezeExcite,
    SqueezeExcite2d,
    SqueezeExciteConv,
    apply_squeeze_excite,
    latent_width,
)
from composerjax.models import SmallResNet
from composerjax.models.surgery import count_modules


def reference_squeeze_excite(x: np.ndarray, se: SqueezeExcite2d) -> np.ndarray:
    """pool -> fc -> relu -> fc -> sigmoid -> scale (Composer's block: linear layers without bias), in numpy."""
    w1 = np.asarray(se.squeeze.kernel[...], np.float64)
    w2 = np.asarray(se.excite.kernel[...], np.float64)
    pooled = x.astype(np.float64).mean(axis=(1, 2))
    hidden = np.maximum(pooled @ w1, 0.0)
    gates = 1.0 / (1.0 + np.exp(-(hidden @ w2)))
    return x * gates[:, None, None, :]


def test_latent_width_is_a_width_or_a_fraction_of_the_channels():
    assert latent_width(128, 64) == 64
    assert latent_width(128, 0.25) == 32
    assert latent_width(3, 0.1) == 1  # never below one unit


def test_se_block_equals_the_hand_computation():
    se = SqueezeExcite2d(6, latent_channels=0.5, rngs=nnx.Rngs(0))
    assert se.squeeze.kernel.shape == (6, 3) and se.excite.kernel.shape == (3, 6)
    assert se.squeeze.bias is None and se.excite.bias is None  # as Composer's
    x = np.random.default_rng(0).normal(size=(2, 5, 5, 6)).astype(np.float32)
    np.testing.assert_allclose(se(jnp.asarray(x)), reference_squeeze_excite(x, se), rtol=1e-5, atol=1e-6)


def test_wrapper_keeps_the_conv_unchanged_and_gates_its_output():
    conv = nnx.Conv(3, 4, (3, 3), strides=2, rngs=nnx.Rngs(0))
    kernel = np.asarray(conv.kernel[...])
    wrapped = SqueezeExciteConv(conv, latent_channels=2, rngs=nnx.Rngs(1))
    assert wrapped.conv is conv
    np.testing.assert_array_equal(wrapped.conv.kernel[...], kernel)
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32))
    conv_out = np.asarray(conv(x))
    np.testing.assert_allclose(wrapped(x), reference_squeeze_excite(conv_out, wrapped.se), rtol=1e-5, atol=1e-6)


def test_surgery_adds_blocks_after_convs_whose_narrower_side_is_wide_enough():
    # SmallResNet(width=4): stem 1->4, block0 4->4 (x2), block1 4->8, 8->8, shortcut 4->8.
    model = SmallResNet(num_classes=3, width=4, rngs=nnx.Rngs(0))
    conv2 = model.blocks[1].conv2
    assert apply_squeeze_excite(model, latent_channels=0.5, min_channels=8) == 1
    assert isinstance(model.blocks[1].conv2, SqueezeExciteConv) and model.blocks[1].conv2.conv is conv2
    assert model.blocks[1].conv2.se.squeeze.out_features == 4
    # the wrapped conv is not wrapped again; the rest of the convs with min(in, out) >= 4 are
    assert apply_squeeze_excite(model, latent_channels=2, min_channels=4) == 4
    assert count_modules(model, SqueezeExciteConv) == 5
    assert model(jnp.ones((2, 8, 8))).shape == (2, 3)


def test_squeeze_excite_in_a_trainer_trains_the_new_blocks_with_one_compile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16, shuffle=False), "2ba", optax.sgd(0.5),
                      algorithms=[SqueezeExcite(latent_channels=2, min_channels=8)], progress_bar=False)
    se_params = trainer.state.train_state.params["module"]["blocks"][1]["conv2"]["se"]
    before = np.asarray(se_params["squeeze"]["kernel"])
    trainer.fit()
    assert trainer.compile_count == 1
    assert np.isfinite(float(trainer.state.loss))
    after = trainer.state.train_state.params["module"]["blocks"][1]["conv2"]["se"]["squeeze"]["kernel"]
    assert np.all(np.isfinite(after)) and not np.allclose(after, before)
    assert np.isfinite(trainer.eval(ArrayLoader((x, y), 16, shuffle=False))["CrossEntropy"])


def test_seed_none_derives_the_blocks_from_the_trainer_seed():
    def se_kernel(seed: int, algorithm_seed: int | None) -> np.ndarray:
        trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                          ArrayLoader((np.zeros((8, 8, 8), np.float32), np.zeros(8, np.int32)), 8), "1ba",
                          optax.sgd(0.1), algorithms=[SqueezeExcite(2, 8, seed=algorithm_seed)], seed=seed,
                          progress_bar=False)
        return np.asarray(trainer.state.model.module.blocks[1].conv2.se.squeeze.kernel[...])

    np.testing.assert_array_equal(se_kernel(0, None), se_kernel(0, None))
    assert not np.allclose(se_kernel(0, None), se_kernel(1, None))
    np.testing.assert_array_equal(se_kernel(0, 7), se_kernel(1, 7))


def test_squeeze_excite_warns_when_no_conv_is_wide_enough():
    with pytest.warns(UserWarning, match="SqueezeExcite added no blocks"):
        Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                ArrayLoader((np.zeros((8, 8, 8), np.float32), np.zeros(8, np.int32)), 8), "1ba",
                optax.sgd(0.1), algorithms=[SqueezeExcite()], progress_bar=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"latent_channels": 0}, "latent_channels=0"),
    ({"latent_channels": 2.5}, "latent_channels=2.5"),
    ({"min_channels": -3}, "min_channels=-3"),
    ({"seed": "a"}, "seed='a'"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SqueezeExcite(**kwargs)
