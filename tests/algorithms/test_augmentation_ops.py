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


@pytest.mark.parametrize(
    ("factor", "expected"),
    [
        # row r reads column c + factor * (r + 0.5): about the top edge, as PIL's AFFINE (1, factor, 0, 0, 1, 0)
        (2.0, [[2.0, 3.0, 0.0], [0.0, 0.0, 0.0]]),  # whole columns: c + 1, c + 3
        # c + 0.25 and c + 0.75; column 2.25 clamps to the last pixel, 2.75 lies past the edge (fill 0)
        (0.5, [[1.25, 2.25, 3.0], [4.75, 5.75, 0.0]]),
        # c - 0.25 clamps to column 0 in row 0; c - 0.75 = -0.75 lies past the edge in row 1
        (-0.5, [[1.0, 1.75, 2.75], [0.0, 4.25, 5.25]]),
    ],
)
def test_shear_is_about_the_top_left_corner_like_pil(factor, expected):
    x = np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], np.float32) / 8
    np.testing.assert_allclose(shear_x(x, factor), np.asarray(expected) / 8, atol=1e-7)
    np.testing.assert_allclose(shear_y(x.T, factor), np.asarray(expected).T / 8, atol=1e-7)


def pil_float(image: np.ndarray):
    from PIL import Image

    return Image.fromarray(image.astype(np.float32))  # mode 'F': PIL's own bilinear, without 8-bit rounding


@pytest.mark.parametrize("shape", [(5, 7), (8, 8)])
def test_geometric_ops_match_pils_bilinear_transforms(shape):
    from PIL import Image

    affine, bilinear = Image.Transform.AFFINE, Image.Resampling.BILINEAR
    x = levels_image(shape, seed=14)
    image = pil_float(x)
    for level in (0.3, -0.27, 1.3):
        pil_shear_x = image.transform(image.size, affine, (1, level, 0, 0, 1, 0), resample=bilinear)
        pil_shear_y = image.transform(image.size, affine, (1, 0, 0, level, 1, 0), resample=bilinear)
        np.testing.assert_allclose(shear_x(x, level), np.asarray(pil_shear_x), atol=1e-5)
        np.testing.assert_allclose(shear_y(x, level), np.asarray(pil_shear_y), atol=1e-5)
    for level in (2, -1):  # Composer's translate by `level` moves the content by -level
        pil_x = image.transform(image.size, affine, (1, 0, level, 0, 1, 0), resample=bilinear)
        pil_y = image.transform(image.size, affine, (1, 0, 0, 0, 1, level), resample=bilinear)
        np.testing.assert_allclose(translate_x(x, -level), np.asarray(pil_x), atol=1e-6)
        np.testing.assert_allclose(translate_y(x, -level), np.asarray(pil_y), atol=1e-6)
    for degrees in (7, -13, 30):
        np.testing.assert_allclose(rotate(x, float(degrees)), np.asarray(image.rotate(degrees, resample=bilinear)),
                                   atol=1e-5)


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


def test_severity_0_makes_the_geometric_solarize_and_enhancement_augmentations_near_identities():
    # Composer's level is uniform in [0.1, severity]: at severity 0 it lies in (0, 0.1] (here 0.01).
    x = jnp.asarray(levels_image((8, 8, 3), seed=9))
    draws = jnp.asarray([0.9, 0.2, 0.7, 0.6], jnp.float32)
    outputs = every_augmentation(x, draws, 0.0)
    for augmentation, out in zip(AUGMENTATION_SETS["all"], outputs):
        if augmentation.name in ("autocontrast", "equalize", "posterize"):
            continue  # no intensity (autocontrast, equalize) or 4 bits at the weakest (posterize)
        if augmentation.name.startswith("shear"):  # a shear of 0.3 * 0.01 / 10
            assert 0 < np.abs(np.asarray(out) - x).max() < 0.01
            continue
        np.testing.assert_allclose(out, x, atol=1e-6, err_msg=augmentation.name)


def by_name(name: str) -> Augmentation:
    return next(a for a in AUGMENTATION_SETS["all"] if a.name == name)


def test_levels_start_at_composers_floor_of_0_1():
    # draw 0 at severity 10: level 0.1, solarize threshold 256 - int(0.1 * 256 / 10) = 254
    x = jnp.asarray([[253.0, 254.0, 255.0]], jnp.float32)[..., None] / 255
    out = by_name("solarize").apply(x, jnp.asarray([0.0, 0.0, 0.0, 0.0], jnp.float32), 10.0)
    np.testing.assert_allclose(np.asarray(out)[0, :, 0] * 255, [253.0, 1.0, 0.0], atol=1e-4)
    # draw 1 at severity 10: level 10, shear 0.3 (sign draw 0.9: positive), about the top edge
    image = jnp.asarray(levels_image((4, 4, 1), seed=15))
    sheared = by_name("shear_x").apply(image, jnp.asarray([1.0, 0.9, 0.0, 0.0], jnp.float32), 10.0)
    np.testing.assert_allclose(sheared, shear_x(image, 0.3), atol=1e-6)


def test_brightening_is_scaled_by_three_quarters_as_in_composer():
    x = jnp.full((2, 2, 3), 0.1, jnp.float32)
    # coin 0.2 < 0.5: factor 1 + 0.5 * (9 - 1) = 5, brightening, so 0.75 * 5 = 3.75
    up = by_name("brightness").apply(x, jnp.asarray([0.0, 0.0, 0.2, 0.5], jnp.float32), 9.0)
    np.testing.assert_allclose(up, np.full((2, 2, 3), 0.375), rtol=1e-6)
    # coin 0.7: factor 1 - 0.5 * 0.09 * 9 = 0.595, darkening, unscaled
    down = by_name("brightness").apply(x, jnp.asarray([0.0, 0.0, 0.7, 0.5], jnp.float32), 9.0)
    np.testing.assert_allclose(down, np.full((2, 2, 3), 0.0595), rtol=1e-5)
    # contrast and the rest keep the symmetric factor 5
    contrasted = by_name("contrast").apply(x.at[0, 0].set(0.2), jnp.asarray([0.0, 0.0, 0.2, 0.5], jnp.float32), 9.0)
    np.testing.assert_allclose(contrasted, np.asarray(contrast(x.at[0, 0].set(0.2), 5.0)), rtol=1e-6)


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
