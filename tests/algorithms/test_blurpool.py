"""BlurPool: the blur against its closed form, BlurConv against plain lax, surgery on SmallResNet, training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.blurpool import (
    BlurConv,
    BlurMaxPool,
    BlurPool,
    MaxPool,
    apply_blurpool,
    blur_2d,
)
from composerjax.models import SmallCNN, SmallResNet
from composerjax.models.surgery import count_modules

KERNEL = np.outer([1.0, 2.0, 1.0], [1.0, 2.0, 1.0]) / 16


def reference_blur(x: np.ndarray) -> np.ndarray:
    """Stride-1 blur with one pixel of zero padding, written as explicit sums over the 3x3 window."""
    padded = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    height, width = x.shape[1:3]
    out = np.zeros_like(x)
    for a in range(3):
        for b in range(3):
            out += KERNEL[a, b] * padded[:, a:a + height, b:b + width, :]
    return out


def lax_conv(x: jax.Array, kernel: jax.Array, stride: int) -> jax.Array:
    return jax.lax.conv_general_dilated(x, kernel, (stride, stride), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))


def images(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def test_blur_of_a_delta_is_the_closed_form_kernel_in_every_channel():
    delta = np.zeros((1, 7, 7, 3), np.float32)
    delta[0, 3, 3, :] = 1.0
    out = np.asarray(blur_2d(jnp.asarray(delta)))
    for channel in range(3):
        np.testing.assert_allclose(out[0, 2:5, 2:5, channel], KERNEL, rtol=1e-6)
    assert out[0].sum() == pytest.approx(3.0)
    assert np.count_nonzero(out) == 27  # nothing leaks outside the 3x3 window or across channels


def test_blur_matches_explicit_sums_and_strided_blur_subsamples_it():
    x = images((2, 8, 8, 3))
    dense = reference_blur(x)
    np.testing.assert_allclose(blur_2d(jnp.asarray(x)), dense, rtol=1e-5, atol=1e-6)
    # Stride 2 keeps Composer's grid (one pixel of padding on each side): windows centred on even pixels.
    np.testing.assert_allclose(blur_2d(jnp.asarray(x), 2), dense[:, ::2, ::2], rtol=1e-5, atol=1e-6)
    # extra leading batch dimensions are kept
    assert blur_2d(jnp.asarray(x).reshape(1, 2, 8, 8, 3)).shape == (1, 2, 8, 8, 3)


def test_stride_2_blur_of_a_4x4_map_samples_composers_grid():
    x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    # By hand: output (i, j) is the [1, 2, 1] x [1, 2, 1] / 16 window centred on input (2i, 2j),
    # zeros outside. Output (0, 0) = (4*0 + 2*1 + 2*4 + 1*5) / 16; (1, 1) centres on (2, 2).
    out = np.asarray(blur_2d(x, 2))[0, :, :, 0]
    assert out[0, 0] == (4 * 0 + 2 * 1 + 2 * 4 + 1 * 5) / 16
    expected_11 = (1 * 5 + 2 * 6 + 1 * 7 + 2 * 9 + 4 * 10 + 2 * 11 + 1 * 13 + 2 * 14 + 1 * 15) / 16
    assert out[1, 1] == expected_11
    assert out.shape == (2, 2)


@pytest.mark.parametrize("use_bias", [False, True])
def test_blur_first_conv_is_conv_of_the_blurred_input(use_bias):
    conv = nnx.Conv(3, 5, (3, 3), strides=2, use_bias=use_bias, rngs=nnx.Rngs(0))
    if use_bias:
        conv.bias[...] = jnp.arange(5.0)
    kernel = np.asarray(conv.kernel[...])
    blurred = BlurConv(conv, blur_first=True)
    x = images((2, 8, 8, 3))
    expected = lax_conv(jnp.asarray(reference_blur(x)), jnp.asarray(kernel), 2) + (jnp.arange(5.0) if use_bias else 0)
    np.testing.assert_allclose(blurred(jnp.asarray(x)), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(blurred.conv.kernel[...], kernel)  # the conv's weights are kept


def test_blur_after_conv_runs_the_conv_densely_and_blurs_with_its_stride():
    conv = nnx.Conv(3, 4, (3, 3), strides=2, rngs=nnx.Rngs(1))
    kernel = conv.kernel[...]
    x = images((2, 8, 8, 3))
    original_shape = conv(jnp.asarray(x)).shape
    blurred = BlurConv(conv, blur_first=False)
    dense = np.asarray(lax_conv(jnp.asarray(x), kernel, 1) + conv.bias[...])
    out = blurred(jnp.asarray(x))
    assert out.shape == original_shape
    # Composer's grid: the blur's stride-2 windows are centred on even pixels, as the strided conv's are.
    np.testing.assert_allclose(out, reference_blur(dense)[:, ::2, ::2], rtol=1e-5, atol=1e-5)


def test_blur_max_pool_is_a_dense_max_pool_then_a_strided_blur():
    x = images((2, 8, 8, 2))
    dense = np.asarray(nnx.max_pool(jnp.asarray(x), (2, 2), (1, 1), "VALID"))  # 7x7
    out = BlurMaxPool((2, 2))(jnp.asarray(x))
    assert out.shape == MaxPool((2, 2))(jnp.asarray(x)).shape == (2, 4, 4, 2)
    # One pixel of padding on each side: stride-2 windows are centred on even pixels.
    np.testing.assert_allclose(out, reference_blur(dense)[:, ::2, ::2], rtol=1e-5, atol=1e-6)


def test_surgery_replaces_only_strided_convs_with_enough_input_channels():
    model = SmallResNet(num_classes=3, width=4, rngs=nnx.Rngs(0))
    strided = [model.blocks[1].conv1, model.blocks[1].shortcut]
    assert apply_blurpool(model, min_channels=4) == 2
    assert count_modules(model, BlurConv) == 2
    assert model.blocks[1].conv1.conv is strided[0] and model.blocks[1].shortcut.conv is strided[1]
    assert apply_blurpool(model, min_channels=4) == 0  # already blurred: nothing new
    assert apply_blurpool(SmallResNet(width=4, rngs=nnx.Rngs(0)), min_channels=5) == 0
    assert apply_blurpool(SmallResNet(width=4, rngs=nnx.Rngs(0)), replace_convs=False, min_channels=0) == 0


def test_surgery_replaces_max_pool_modules():
    model = nnx.Sequential(nnx.Conv(1, 2, (3, 3), rngs=nnx.Rngs(0)), MaxPool((2, 2)))
    assert apply_blurpool(model, replace_maxpools=False) == 0
    assert apply_blurpool(model) == 1
    assert isinstance(model.layers[1], BlurMaxPool)
    assert model(jnp.ones((1, 8, 8, 1))).shape == (1, 4, 4, 2)


def test_blurred_resnet_computes_the_blurred_forward():
    model = SmallResNet(num_classes=3, width=4, rngs=nnx.Rngs(0))
    model.eval()
    block = model.blocks[1]
    x = jnp.asarray(images((2, 8, 8, 4)))
    conv1_kernel, shortcut_kernel = block.conv1.kernel[...], block.shortcut.kernel[...]
    apply_blurpool(model, min_channels=4)
    blurred_x = jnp.asarray(reference_blur(np.asarray(x)))
    identity = lax_conv(blurred_x, shortcut_kernel, 2)
    hidden = nnx.relu(block.norm1(lax_conv(blurred_x, conv1_kernel, 2)))
    expected = nnx.relu(identity + block.norm2(block.conv2(hidden)))
    np.testing.assert_allclose(block(x), expected, rtol=1e-5, atol=1e-5)


def test_blurpool_in_a_trainer_replaces_at_init_and_trains_with_one_compile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    algorithm = BlurPool(min_channels=4)
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16, shuffle=False), "3ba", optax.sgd(0.1), algorithms=[algorithm],
                      progress_bar=False)
    params = trainer.state.train_state.params["module"]["blocks"][1]
    assert "kernel" in params["conv1"]["conv"] and "kernel" in params["shortcut"]["conv"]
    before = np.asarray(params["conv1"]["conv"]["kernel"])
    trainer.fit()
    assert trainer.compile_count == 1
    assert count_modules(trainer.state.model, BlurConv) == 2
    assert np.isfinite(float(trainer.state.loss))
    after = trainer.state.train_state.params["module"]["blocks"][1]["conv1"]["conv"]["kernel"]
    assert np.all(np.isfinite(after)) and not np.allclose(after, before)
    metrics = trainer.eval(ArrayLoader((x, y), 16, shuffle=False))
    assert np.isfinite(metrics["CrossEntropy"])


def test_blurpool_warns_when_nothing_is_replaced():
    x = np.zeros((8, 8, 8), np.float32)
    y = np.zeros((8,), np.int32)
    with pytest.warns(UserWarning, match="BlurPool replaced no modules"):
        Trainer(ComposerClassifier(SmallCNN(num_classes=2, channels=4, rngs=nnx.Rngs(0)), 2),
                ArrayLoader((x, y), 8), "1ba", optax.sgd(0.1), algorithms=[BlurPool(min_channels=0)],
                progress_bar=False)


@pytest.mark.parametrize("kwargs, message", [
    ({"min_channels": -1}, "min_channels=-1"),
    ({"min_channels": 2.5}, "min_channels=2.5"),
    ({"blur_first": "yes"}, "blur_first='yes'"),
    ({"replace_convs": 1}, "replace_convs=1"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BlurPool(**kwargs)
