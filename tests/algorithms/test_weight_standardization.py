"""WeightStandardization: the standardized kernel's closed form, convs against plain lax, ignored layers, SGD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.weight_standardization import (
    WeightStandardization,
    apply_weight_standardization,
    is_standardized,
    standardize_kernel,
)
from composerjax.models import SmallResNet

LR = 0.1


def hand_standardized(kernel: np.ndarray) -> np.ndarray:
    """Per output channel (last axis): subtract the mean, divide by the (biased) standard deviation."""
    flat = kernel.reshape(-1, kernel.shape[-1]).astype(np.float64)
    return ((kernel - flat.mean(axis=0)) / np.sqrt(flat.var(axis=0) + 1e-10)).astype(np.float32)


def lax_conv(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_standardized_kernel_has_zero_mean_and_unit_variance_per_output_channel():
    kernel = np.random.default_rng(0).normal(2.0, 3.0, size=(3, 3, 2, 5)).astype(np.float32)
    out = np.asarray(standardize_kernel(jnp.asarray(kernel)))
    np.testing.assert_allclose(out, hand_standardized(kernel), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out.reshape(-1, 5).mean(axis=0), 0.0, atol=1e-6)
    np.testing.assert_allclose(out.reshape(-1, 5).std(axis=0), 1.0, rtol=1e-5)
    assert standardize_kernel(jnp.asarray(kernel, jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("stride", [1, 2])
def test_standardized_conv_is_lax_conv_with_the_hand_standardized_kernel(stride):
    model = nnx.Sequential(nnx.Conv(3, 4, (3, 3), strides=stride, rngs=nnx.Rngs(0)))
    conv = model.layers[0]
    conv.bias[...] = jnp.arange(4.0)
    kernel = np.asarray(conv.kernel[...])
    assert apply_weight_standardization(model) == 1
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 8, 8, 3)).astype(np.float32))
    expected = lax_conv(x, jnp.asarray(hand_standardized(kernel)), stride) + jnp.arange(4.0)
    np.testing.assert_allclose(model(x), expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(conv.kernel[...], kernel)  # the parameter itself is unchanged
    assert apply_weight_standardization(model) == 0  # already standardized


def test_last_layers_in_definition_order_are_ignored():
    # SmallResNet's convs in definition order: stem, block0.conv1, block0.conv2, block1.conv1,
    # block1.conv2, block1.shortcut
    model = SmallResNet(width=4, rngs=nnx.Rngs(0))
    convs = [model.stem, model.blocks[0].conv1, model.blocks[0].conv2, model.blocks[1].conv1,
             model.blocks[1].conv2, model.blocks[1].shortcut]
    assert apply_weight_standardization(model, n_last_layers_ignore=2) == 4
    assert [is_standardized(conv) for conv in convs] == [True] * 4 + [False] * 2
    assert apply_weight_standardization(model, n_last_layers_ignore=1) == 1
    assert is_standardized(model.blocks[1].conv2) and not is_standardized(model.blocks[1].shortcut)
    assert apply_weight_standardization(SmallResNet(width=4, rngs=nnx.Rngs(0)), n_last_layers_ignore=9) == 0


def test_one_sgd_step_matches_plain_jax_through_the_standardization():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 2)).astype(np.float32)
    y = rng.integers(0, 3, size=8).astype(np.int32)
    model = nnx.Sequential(nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0)), lambda h: h.mean(axis=(1, 2)))
    kernel, bias = np.array(model.layers[0].kernel[...]), np.array(model.layers[0].bias[...])  # step donates
    trainer = Trainer(ComposerClassifier(model, 3), ArrayLoader((x, y), 8, shuffle=False), "1ba", optax.sgd(LR),
                      algorithms=[WeightStandardization()], progress_bar=False)
    trainer.fit()
    assert trainer.compile_count == 1

    def loss(params: dict) -> jax.Array:
        logits = (lax_conv(jnp.asarray(x), standardize_kernel(params["kernel"])) + params["bias"]).mean(axis=(1, 2))
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, jnp.asarray(y)))

    params = {"kernel": jnp.asarray(kernel), "bias": jnp.asarray(bias)}
    expected = jax.tree.map(lambda p, g: p - LR * g, params, jax.grad(loss)(params))
    trained = trainer.state.train_state.params["module"]["layers"][0]
    np.testing.assert_allclose(trained["kernel"], expected["kernel"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], expected["bias"], rtol=1e-5, atol=1e-6)


def test_weight_standardization_warns_when_every_conv_is_ignored():
    data = ArrayLoader((np.zeros((8, 6, 6, 2), np.float32), np.zeros(8, np.int32)), 8)
    model = nnx.Sequential(nnx.Conv(2, 3, (3, 3), rngs=nnx.Rngs(0)), lambda h: h.mean(axis=(1, 2)))
    with pytest.warns(UserWarning, match="WeightStandardization changed no modules"):
        Trainer(ComposerClassifier(model, 3), data, "1ba", optax.sgd(LR),
                algorithms=[WeightStandardization(n_last_layers_ignore=1)], progress_bar=False)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_n_last_layers_ignore_raises(value):
    with pytest.raises(ValueError, match=f"n_last_layers_ignore={value!r}"):
        WeightStandardization(n_last_layers_ignore=value)
