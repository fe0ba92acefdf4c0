"""Image augmentation ops against closed forms on small known images, and the random augmentation sets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composerjax.algorithms.augmentation_ops import (
    AUGMENTATION_SETS,
    DRAWS_PER_AUGMENTATION,
    Augmentation,
    apply_random_augmentation,
    autocontrast,
    batch_key,
    brightness,
    check_severity,
    color,
    contrast,
    equalize,
    posterize,
    resolve_augmentation_set,
    rotate,
    sharpness,
    shear_x,
    shear_y,
    solarize,
    translate_x,
    translate_y,
)

LUMA = np.array([0.299, 0.587, 0.114], np.float32)


def levels_image(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random values on the 8-bit grid k / 255."""
    return (np.random.default_rng(seed).integers(0, 256, size=shape) / 255.0).astype(np.float32)


def test_solarize_inverts_exactly_the_values_at_or_above_the_threshold():
    x = np.array([[0.0, 0.25, 0.5], [0.625, 0.75, 1.0]], np.float32)
    np.testing.assert_array_equal(solarize(x, 0.5), [[0.0, 0.25, 0.5], [0.375, 0.25, 0.0]])
    np.testing.assert_array_equal(solarize(x, 256 / 255), x)  # PIL's threshold 256: nothing changes
    np.testing.assert_array_equal(solarize(x, 0.0), 1.0 - x)


@pytest.mark.parametrize("bits", [0, 1, 2, 4, 7, 8])
def test_posterize_keeps_the_top_bits_of_every_8_bit_level(bits):
    levels = np.arange(256, dtype=np.int64).reshape(16, 16)
    mask = (0xFF << (8 - bits)) & 0xFF
    out = np.asarray(posterize(levels.astype(np.float32) / np.float32(255.0), bits))
    np.testing.assert_array_equal(np.round(out * 255).astype(np.int64), levels & mask)
    np.testing.assert_allclose(out, (levels & mask) / 255.0, rtol=1e-6)


def test_brightness_scales_and_clips():
    x = levels_image((4, 4, 3))
    np.testing.assert_allclose(brightness(x, 0.5), 0.5 * x, rtol=1e-6)
    np.testing.assert_allclose(brightness(x, 1.7), np.clip(1.7 * x, 0, 1), rtol=1e-6)
    np.testing.assert_array_equal(brightness(x, 0.0), np.zeros_like(x))


def test_contrast_blends_with_the_mean_luma():
    x = levels_image((4, 4, 3), seed=1)
    mean = float(np.mean(x @ LUMA))
    np.testing.assert_allclose(contrast(x, 0.0), np.full_like(x, mean), rtol=1e-6)
    np.testing.assert_allclose(contrast(x, 0.3), mean + 0.3 * (x - mean), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(contrast(x, 2.5), np.clip(mean + 2.5 * (x - mean), 0, 1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(contrast(x, 1.0), x, atol=1e-7)


def test_color_blends_with_the_grayscale_image_and_leaves_one_channel_alone():
    x = levels_image((4, 4, 3), seed=2)
    gray = (x @ LUMA)[..., None]
    np.testing.assert_allclose(color(x, 0.0), np.broadcast_to(gray, x.shape), rtol=1e-6)
    np.testing.assert_allclose(color(x, 1.8), np.clip(gray + 1.8 * (x - gray), 0, 1), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(color(x, 1.0), x, atol=1e-7)
    single = levels_image((4, 4), seed=3)
    np.testing.assert_array_equal(color(single, 0.0), single)


def smooth_reference(x: np.ndarray) -> np.ndarray:
    """PIL's SMOOTH filter on the interior of one (H, W) channel, border kept."""
    kernel = np.array([[1, 1, 1], [1, 5, 1], [1, 1, 1]], np.float64) / 13.0
    out = x.astype(np.float64).copy()
    for r in range(1, x.shape[0] - 1):
        for c in range(1, x.shape[1] - 1):
            out[r, c] = np.sum(kernel * x[r - 1:r + 2, c - 1:c + 2])
    return out


def test_sharpness_blends_with_pils_smooth_filter():
    x = np.full((5, 5), 0.25, np.float32)
    x[2, 2] = 0.5
    smooth = smooth_reference(x)
    assert smooth[2, 2] == pytest.approx(4.5 / 13) and smooth[1, 1] == pytest.approx(3.5 / 13)
    np.testing.assert_allclose(sharpness(x, 0.0), smooth, rtol=1e-6)
    np.testing.assert_allclose(sharpness(x, 2.0), np.clip(2 * x - smooth, 0, 1), rtol=1e-5)
    np.testing.assert_allclose(sharpness(x, 1.0), x, atol=1e-7)
    flat = np.full((6, 6, 3), 0.4, np.float32)
    np.testing.assert_allclose(sharpness(flat, 3.0), flat, rtol=1e-6)


def test_autocontrast_maps_each_channels_min_and_max_to_0_and_1():
    x = np.stack([np.array([[0.2, 0.3], [0.4, 0.6]], np.float32), np.full((2, 2), 0.3, np.float32)], axis=-1)
    out = np.asarray(autocontrast(x))
    np.testing.assert_allclose(out[..., 0], [[0.0, 0.25], [0.5, 1.0]], atol=1e-6)
    np.testing.assert_array_equal(out[..., 1], x[..., 1])  # a constant channel is left alone


def test_equalize_follows_pils_lookup_table():
    # 1024 pixels: 512 at level 0, 256 at 128, 256 at 255. PIL: step = (1024 - 256) // 255 = 3,
    # lut[i] = (1 + pixels below i) // 3 -> 0 -> 0, 128 -> 513 // 3 = 171, 255 -> 769 // 3 = 256 -> 255.
    levels = np.array([0] * 512 + [128] * 256 + [255] * 256).reshape(32, 32)
    out = np.asarray(equalize(levels.astype(np.float32) / 255.0))
    expected = np.select([levels == 0, levels == 128], [0.0, 171 / 255], 1.0).astype(np.float32)
    np.testing.assert_allclose(out, expected, atol=1e-7)
    # every level exactly four times: the table is the identity
    ramp = np.repeat(np.arange(256), 4).reshape(32, 32).astype(np.float32) / 255.0
    np.testing.assert_allclose(equalize(ramp), ramp, atol=1e-7)
    # fewer than 256 pixels: PIL leaves the image unchanged
    small = levels_image((8, 8), seed=4)
    np.testing.assert_array_equal(equalize(small), small)


def test_rotate_by_0_is_the_identity_and_by_90_matches_rot90():
    x = levels_image((6, 6, 2), seed=5)
    np.testing.assert_array_equal(rotate(x, 0.0), x)
    np.testing.assert_allclose(rotate(x, 90.0), np.rot90(x, 1, axes=(0, 1)), atol=1e-5)
    np.testing.assert_allclose(rotate(x[..., 0], 180.0), x[::-1, ::-1, 0], atol=1e-5)


@pytest.mark.parametrize("pixels", [2, -3])
def test_translate_by_whole_pixels_is_a_roll_with_zero_fill(pixels):
    x = levels_image((5, 7), seed=6)
    shifted_cols = np.roll(x, pixels, axis=1)
    shifted_rows = np.roll(x, pixels, axis=0)
    if pixels > 0:
        shifted_cols[:, :pixels] = 0
        shifted_rows[:pixels] = 0
    else:
        shifted_cols[:, pixels:] = 0
        shifted_rows[pixels:] = 0
    np.testing.assert_array_equal(translate_x(x, pixels), shifted_cols)
    np.testing.assert_array_equal(translate_y(x, pixels), shifted_rows)


def test_shear_by_1_shifts_each_row_by_its_offset_from_the_centre():
    x = levels_image((3, 6), seed=7)
    expected = np.stack([np.concatenate([[0.0], x[0, :-1]]), x[1], np.concatenate([x[2, 1:], [0.0]])])
    np.testing.assert_array_equal(shear_x(x, 1.0), expected)
    np.testing.assert_array_equal(shear_y(x.T, 1.0), expected.T)


def test_ops_take_hw_and_hwc_images_alike():
    x = levels_image((6, 6), seed=8)
    for op, argument in [(rotate, 17.0), (sharpness, 1.5), (equalize, None), (posterize, 3)]:
        args = () if argument is None else (argument,)
        np.testing.assert_array_equal(op(x, *args), np.asarray(op(x[..., None], *args))[..., 0])
    with pytest.raises(ValueError, match=r"\(H, W\) or \(H, W, C\)"):
        rotate(np.zeros((2, 6, 6, 1), np.float32), 10.0)


def test_augmentation_sets_follow_composer():
    names = {name: [a.name for a in augmentations] for name, augmentations in AUGMENTATION_SETS.items()}
    safe = ["autocontrast", "equalize", "posterize", "rotate", "solarize", "shear_x", "shear_y", "translate_x",
            "translate_y"]
    assert names["safe"] == safe
    assert names["all"] == safe + ["color", "contrast", "brightness", "sharpness"]
    assert names["original"] == safe + ["color_original", "contrast_original", "brightness_original",
                                        "sharpness_original"]
    assert resolve_augmentation_set("all") is AUGMENTATION_SETS["all"]
    with pytest.raises(ValueError, match=r"augmentation_set='bogus'.*'all', 'original', 'safe'"):
        resolve_augmentation_set("bogus")
    with pytest.raises(ValueError, match="non-empty sequence of Augmentation"):
        resolve_augmentation_set([])
    with pytest.raises(ValueError, match="exactly one of fn or transform"):
        Augmentation("nothing")


@pytest.mark.parametrize("severity", [-1, 10.5, True, "9"])
def test_check_severity_rejects_values_outside_0_to_10(severity):
    with pytest.raises(ValueError, match=r"severity=.*expected a number in \[0, 10\]"):
        check_severity(severity)


@jax.jit
def every_augmentation(image: jax.Array, draws: jax.Array, severity: jax.Array) -> jax.Array:
    return jnp.stack([a.apply(image, draws, severity) for a in AUGMENTATION_SETS["all"]])


def test_severity_0_makes_the_geometric_solarize_and_enhancement_augmentations_identities():
    x = jnp.asarray(levels_image((8, 8, 3), seed=9))
    draws = jnp.asarray([0.9, 0.2, 0.7, 0.6], jnp.float32)
    outputs = every_augmentation(x, draws, 0.0)
    for augmentation, out in zip(AUGMENTATION_SETS["all"], outputs):
        if augmentation.name in ("autocontrast", "equalize", "posterize"):
            continue  # no intensity (autocontrast, equalize) or 4 bits at the weakest (posterize)
        np.testing.assert_allclose(out, x, atol=1e-6, err_msg=augmentation.name)


def test_every_augmentation_keeps_shape_and_range_at_full_severity():
    x = jnp.asarray(levels_image((8, 8, 3), seed=10))
    for draws in ([0.99, 0.1, 0.2, 0.99], [0.5, 0.9, 0.8, 0.3]):
        outputs = np.asarray(every_augmentation(x, jnp.asarray(draws, jnp.float32), 10.0))
        assert outputs.shape == (13, 8, 8, 3)
        assert outputs.min() >= 0.0 and outputs.max() <= 1.0
        assert all(not np.allclose(out, x) for out in outputs[3:])  # rotate .. sharpness all act


def test_apply_random_augmentation_picks_the_augmentation_named_by_the_first_draw():
    augmentations = AUGMENTATION_SETS["all"]
    x = jnp.asarray(levels_image((8, 8, 3), seed=11))
    op_draws = jnp.asarray([0.8, 0.7, 0.2, 0.9], jnp.float32)
    pick = jax.jit(lambda image, draws: apply_random_augmentation(image, draws, 9.0, augmentations))
    direct = every_augmentation(x, op_draws, 9.0)
    for index in range(len(augmentations)):
        choice = (index + 0.5) / len(augmentations)
        draws = jnp.concatenate([jnp.asarray([choice], jnp.float32), op_draws])
        assert draws.shape == (1 + DRAWS_PER_AUGMENTATION,)
        np.testing.assert_allclose(pick(x, draws), direct[index], atol=1e-6, err_msg=augmentations[index].name)


def test_an_augmentation_called_with_a_key_is_deterministic():
    rotate_augmentation = AUGMENTATION_SETS["all"][3]
    x = levels_image((6, 6), seed=12)
    first = rotate_augmentation(x, jax.random.key(1), 9.0)
    np.testing.assert_array_equal(first, rotate_augmentation(x, jax.random.key(1), 9.0))
    assert first.shape == x.shape


def test_batch_key_depends_on_the_step_key_the_name_and_the_images():
    images = jnp.asarray(levels_image((4, 8, 8), seed=13))
    step_rng = jax.random.key(0)

    def data(key: jax.Array) -> list[int]:
        return jax.random.key_data(key).tolist()

    reference = data(batch_key(step_rng, "RandAugment", images))
    assert reference == data(batch_key(step_rng, "RandAugment", images))
    assert reference != data(batch_key(jax.random.key(1), "RandAugment", images))
    assert reference != data(batch_key(step_rng, "AugMix", images))
    # microbatches of one step share step_rng: other images, or the same images reordered, get another key
    assert reference != data(batch_key(step_rng, "RandAugment", images.at[3, 7, 7].add(1 / 255)))
    assert reference != data(batch_key(step_rng, "RandAugment", images[::-1]))
