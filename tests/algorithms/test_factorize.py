"""Factorize: SVD-initialised low-rank Linear/Conv layers, thresholds, and training after surgery."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Event, Logger, State, Trainer
from composerjax.algorithms.factorize import (
    Factorize,
    FactorizedConv,
    FactorizedLinear,
    apply_factorization,
    factorize_matrix,
)
from composerjax.models import SmallResNet
from composerjax.models.surgery import count_modules


def rank_truncation(matrix: np.ndarray, rank: int) -> np.ndarray:
    u, s, vt = np.linalg.svd(np.asarray(matrix, np.float64), full_matrices=False)
    return (u[:, :rank] * s[:rank]) @ vt[:rank]


def test_factorize_matrix_is_the_truncated_svd():
    matrix = np.random.default_rng(0).normal(size=(12, 7)).astype(np.float32)
    for rank in (1, 3, 7):
        a, b = factorize_matrix(jnp.asarray(matrix), rank)
        assert a.shape == (12, rank) and b.shape == (rank, 7)
        np.testing.assert_allclose(np.asarray(a @ b), rank_truncation(matrix, rank), atol=1e-5)
    np.testing.assert_allclose(np.asarray(a @ b), matrix, atol=1e-5)  # full rank: the matrix itself
    with pytest.raises(ValueError, match="rank=8"):
        factorize_matrix(jnp.asarray(matrix), 8)


def test_full_rank_factorized_linear_computes_the_same_function():
    linear = nnx.Linear(6, 10, rngs=nnx.Rngs(0))
    linear.bias[...] = jnp.arange(10, dtype=jnp.float32)
    factorized = FactorizedLinear.from_linear(linear, rank=6)
    x = jax.random.normal(jax.random.key(1), (5, 6))
    np.testing.assert_allclose(factorized(x), linear(x), atol=1e-5)
    assert factorized.linear0.bias is None
    np.testing.assert_array_equal(factorized.linear1.bias[...], np.arange(10))


def test_low_rank_factorized_linear_kernel_product_is_the_rank_r_truncation():
    linear = nnx.Linear(16, 12, rngs=nnx.Rngs(0))
    factorized = FactorizedLinear.from_linear(linear, rank=3)
    product = factorized.linear0.kernel[...] @ factorized.linear1.kernel[...]
    np.testing.assert_allclose(product, rank_truncation(linear.kernel[...], 3), atol=1e-5)
    x = jax.random.normal(jax.random.key(1), (4, 16))
    np.testing.assert_allclose(factorized(x), x @ rank_truncation(linear.kernel[...], 3) + linear.bias[...],
                               atol=1e-5)


@pytest.mark.parametrize("kernel_size, strides", [((3, 3), 2), ((1, 1), 2)])
def test_full_rank_factorized_conv_computes_the_same_function(kernel_size, strides):
    conv = nnx.Conv(4, 6, kernel_size, strides=strides, rngs=nnx.Rngs(0))
    conv.bias[...] = jnp.linspace(-1, 1, 6)
    full_rank = min(4 * kernel_size[0] * kernel_size[1], 6)
    factorized = FactorizedConv.from_conv(conv, rank=full_rank)
    assert factorized.conv0.kernel.shape == (*kernel_size, 4, full_rank)
    assert factorized.conv1.kernel.shape == (1, 1, full_rank, 6)
    x = jax.random.normal(jax.random.key(1), (2, 7, 7, 4))
    np.testing.assert_allclose(factorized(x), conv(x), atol=1e-5)


def test_low_rank_factorized_conv_kernel_is_the_rank_r_truncation_of_the_flattened_kernel():
    conv = nnx.Conv(4, 6, (3, 3), use_bias=False, rngs=nnx.Rngs(0))
    factorized = FactorizedConv.from_conv(conv, rank=2)
    assert factorized.conv1.bias is None
    flat0 = factorized.conv0.kernel[...].reshape(36, 2)
    product = flat0 @ factorized.conv1.kernel[...].reshape(2, 6)
    np.testing.assert_allclose(product, rank_truncation(conv.kernel[...].reshape(36, 6), 2), atol=1e-5)


def test_linear_counts_respect_min_features_and_parameter_savings():
    def mlp() -> nnx.Sequential:
        rngs = nnx.Rngs(0)
        return nnx.Sequential(nnx.Linear(16, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 32, rngs=rngs), nnx.relu,
                              nnx.Linear(32, 4, rngs=rngs))

    assert apply_factorization(mlp(), min_features=17) == 0  # 16 features < 17
    model = mlp()
    assert apply_factorization(model, min_features=16, latent_features=0.25) == 2  # 32 -> 4 has 4 < 16 outputs
    assert model.layers[0].latent_features == 4 and model.layers[2].latent_features == 4
    assert isinstance(model.layers[4], nnx.Linear)
    # rank 8 for 16 -> 16 is exactly break-even (8 * 32 == 16 * 16): not replaced; 16 -> 32 saves weights.
    model = mlp()
    assert apply_factorization(model, min_features=16, latent_features=8) == 1
    assert isinstance(model.layers[0], nnx.Linear) and isinstance(model.layers[2], FactorizedLinear)
    assert apply_factorization(mlp(), factorize_linears=False, min_features=1) == 0


def test_conv_counts_respect_min_channels_and_parameter_savings():
    # SmallResNet(width=4): stem 1->4 (3x3), four 3x3 convs 4->4, 4->8, 8->8 ... and a 1x1 shortcut 4->8.
    original = SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0))
    model = nnx.clone(original)
    assert apply_factorization(model, factorize_linears=False, min_channels=4, latent_channels=0.25) == 5
    assert isinstance(model.stem, nnx.Conv)  # one input channel < min_channels
    assert isinstance(model.blocks[1].shortcut, FactorizedConv)
    # 3 latent channels: a 3x3 4->4 conv saves (9*4*3 + 3*4 = 120 < 144); the 1x1 4->8 shortcut does not (36 > 32).
    model = nnx.clone(original)
    assert apply_factorization(model, factorize_linears=False, min_channels=4, latent_channels=3) == 4
    assert isinstance(model.blocks[1].shortcut, nnx.Conv)
    assert apply_factorization(original, factorize_convs=False, min_channels=1) == 0  # the head is 8 -> 2


@pytest.mark.parametrize("argument, value", [("latent_features", 0.0), ("latent_features", 1.5),
                                             ("min_channels", 0), ("factorize_convs", 1)])
def test_bad_arguments_name_the_argument(argument, value):
    with pytest.raises(ValueError, match=f"{argument}={value!r}"):
        Factorize(**{argument: value})


def test_factorized_mlp_trains_in_the_trainer_with_one_compile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype(np.float32)
    y = (x[:, :4].sum(axis=1) > 0).astype(np.int32)
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(16, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 2, rngs=rngs)), 2)
    trainer = Trainer(model, ArrayLoader((x, y), 16, shuffle=False), "12ba", optax.adam(1e-2),
                      algorithms=[Factorize(min_features=8, latent_features=4)], progress_bar=False)
    params = trainer.state.train_state.params["module"]["layers"]
    assert set(params[0]) == {"linear0", "linear1"} and params[0]["linear0"]["kernel"].shape == (16, 4)
    before = trainer.eval(ArrayLoader((x, y), 64, shuffle=False))["CrossEntropy"]
    trainer.fit()
    after = trainer.eval(ArrayLoader((x, y), 64, shuffle=False))["CrossEntropy"]
    assert after < before - 0.05
    assert count_modules(trainer.state.model, FactorizedLinear) == 1
    assert trainer.compile_count == 2  # one train step, one eval step


def test_factorized_resnet_trains():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16, shuffle=False), "2ba", optax.sgd(0.1),
                      algorithms=[Factorize(min_channels=4, latent_channels=0.5, factorize_linears=False)],
                      progress_bar=False)
    start = jax.tree.map(np.asarray, trainer.state.train_state.params)
    trainer.fit()
    end = trainer.state.train_state.params
    kernel = start["module"]["blocks"][0]["conv1"]["conv0"]["kernel"]
    assert kernel.shape == (3, 3, 4, 2)
    assert not np.allclose(kernel, end["module"]["blocks"][0]["conv1"]["conv0"]["kernel"])
    assert np.isfinite(float(trainer.state.loss))
    assert trainer.compile_count == 1


def test_defaults_are_composers_class_and_function_defaults():
    algorithm = Factorize()
    assert (algorithm.factorize_convs, algorithm.factorize_linears, algorithm.min_channels, algorithm.latent_channels,
            algorithm.min_features, algorithm.latent_features) == (True, True, 256, 0.25, 256, 128)

    def wide() -> nnx.Sequential:
        return nnx.Sequential(nnx.Linear(300, 300, rngs=nnx.Rngs(0)), nnx.Linear(300, 256, rngs=nnx.Rngs(1)))

    # the algorithm: 128 latent features (an integer is the rank itself, not a fraction of 300)
    model = wide()
    state = State(model=model, max_duration="1ba")
    algorithm.apply(Event.INIT, state, Logger(state))
    assert isinstance(model.layers[0], FactorizedLinear) and model.layers[0].latent_features == 128
    assert isinstance(model.layers[1], FactorizedLinear) and model.layers[1].latent_features == 128
    # the function: Composer's apply_factorization defaults, min_features=512, so 300-wide layers stay
    assert apply_factorization(wide()) == 0
    model = nnx.Sequential(nnx.Linear(512, 512, rngs=nnx.Rngs(0)))
    assert apply_factorization(model) == 1 and model.layers[0].latent_features == 128  # 0.25 * 512
    # 256 x 256 at rank 128 holds as many weights as the original: not worth it, as in Composer
    assert apply_factorization(nnx.Sequential(nnx.Linear(256, 256, rngs=nnx.Rngs(0))), min_features=256,
                               latent_features=128) == 0
