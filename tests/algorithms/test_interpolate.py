"""torch's F.interpolate(scale_factor=..., recompute_scale_factor=False), channels last, against hand tables."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from composerjax.algorithms.interpolate import (
    bilinear_sources,
    interpolate_bilinear,
    interpolate_nearest,
    interpolated_size,
    nearest_sources,
)


@pytest.mark.parametrize(
    ("size", "scale_factor", "expected"),
    [
        (4, 0.5, [0, 2]),
        (5, 0.6, [0, 1, 3]),  # floor(i * 1.6667)
        (7, 0.5, [0, 2, 4]),  # 3 pixels, ratio 1 / 0.5 = 2
        (10, 0.35, [0, 2, 5]),  # ratio 2.857, not 10 / 3 (which would give 0, 3, 6)
        (6, 0.75, [0, 1, 2, 4]),
        (3, 1.0, [0, 1, 2]),  # unchanged: a copy
        (3, 2.0, [0, 0, 1, 1, 2, 2]),  # doubled: i // 2
    ],
)
def test_nearest_sources_are_floor_of_i_over_the_scale_factor(size, scale_factor, expected):
    assert nearest_sources(size, scale_factor).tolist() == expected
    assert interpolated_size(size, scale_factor) == len(expected)


def test_nearest_gathers_rows_and_columns_keeping_dtype_and_array_kind():
    x = np.arange(25, dtype=np.int32).reshape(1, 5, 5)
    expected = [[0, 1, 3], [5, 6, 8], [15, 16, 18]]
    out = interpolate_nearest(x, 0.6)
    assert isinstance(out, np.ndarray) and out.dtype == np.int32
    assert out[0].tolist() == expected
    out = interpolate_nearest(jnp.asarray(x)[..., None], 0.6)  # jax stays jax; channels last
    assert isinstance(out, jnp.ndarray) and out.shape == (1, 3, 3, 1)
    assert out[0, ..., 0].tolist() == expected


@pytest.mark.parametrize(
    ("size", "scale_factor", "positions"),
    [
        (4, 0.5, [0.5, 2.5]),
        (5, 0.6, [1 / 3, 2.0, 11 / 3]),  # (i + 0.5) / 0.6 - 0.5
        (7, 0.5, [0.5, 2.5, 4.5]),  # ratio 2, not 7 / 3 (which would give 2/3, 3, 16/3)
    ],
)
def test_bilinear_samples_i_plus_half_over_the_scale_factor_minus_half(size, scale_factor, positions):
    index0, index1, weight0, weight1 = bilinear_sources(size, scale_factor)
    np.testing.assert_array_equal(index0, np.floor(positions).astype(int))
    np.testing.assert_array_equal(index1, np.floor(positions).astype(int) + 1)
    np.testing.assert_allclose(weight1, np.asarray(positions) % 1, atol=1e-6)
    np.testing.assert_allclose(weight0 + weight1, 1.0, atol=1e-7)
    # bilinear on a ramp r * 10 + c is exact: the output is the ramp at the sampled positions
    ramp = (10 * np.arange(size)[:, None] + np.arange(size)[None, :]).astype(np.float32)[None]
    expected = 10 * np.asarray(positions)[:, None] + np.asarray(positions)[None, :]
    np.testing.assert_allclose(interpolate_bilinear(ramp, scale_factor)[0], expected, rtol=1e-6)
    np.testing.assert_allclose(interpolate_bilinear(jnp.asarray(ramp), scale_factor)[0], expected, rtol=1e-6)


def test_bilinear_halving_averages_2x2_blocks_without_antialiasing():
    x = np.random.default_rng(0).normal(size=(2, 6, 6, 3)).astype(np.float32)
    blocks = x.reshape(2, 3, 2, 3, 2, 3).mean(axis=(2, 4))
    np.testing.assert_allclose(interpolate_bilinear(x, 0.5), blocks, rtol=1e-5, atol=1e-6)


def test_bilinear_rounds_integer_images_back_to_their_dtype():
    x = np.array([[[0, 1], [2, 4]]], np.uint8)  # one output pixel, the 2x2 mean 1.75
    out = interpolate_bilinear(x, 0.5)
    assert out.dtype == np.uint8 and out.tolist() == [[[2]]]


def test_bad_scales_and_shapes_are_rejected():
    with pytest.raises(ValueError, match="scale_factor=0.1: a side of 4 pixels would shrink to 0"):
        nearest_sources(4, 0.1)
    with pytest.raises(ValueError, match="scale_factor=-1"):
        bilinear_sources(4, -1)
    with pytest.raises(ValueError, match=r"expected \(N, H, W\) or \(N, H, W, C\)"):
        interpolate_nearest(np.zeros((4, 4)), 0.5)
