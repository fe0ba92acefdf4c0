"""Tests for image batches and the PNG encoder TensorBoard images use."""

import io

import numpy as np
import pytest
from PIL import Image

from composerjax.loggers.images import encode_png, image_batch, to_uint8


@pytest.mark.parametrize(
    ("shape", "channels_last", "expected"),
    [
        ((5, 6), True, (1, 5, 6, 1)),
        ((5, 6), False, (1, 5, 6, 1)),
        ((5, 6, 3), True, (1, 5, 6, 3)),
        ((3, 5, 6), False, (1, 5, 6, 3)),
        ((2, 5, 6, 4), True, (2, 5, 6, 4)),
        ((2, 2, 5, 6), False, (2, 5, 6, 2)),
    ],
)
def test_image_batch_shapes(shape, channels_last, expected):
    assert image_batch(np.zeros(shape), channels_last).shape == expected


def test_image_batch_of_a_list_stacks_images_in_order():
    batch = image_batch([np.full((2, 2, 3), value) for value in (0.1, 0.2, 0.3)])
    assert batch.shape == (3, 2, 2, 3)
    np.testing.assert_array_equal(batch[:, 0, 0, 0], [0.1, 0.2, 0.3])


def test_image_batch_rejects_an_empty_list():
    with pytest.raises(ValueError, match=r"images=\[\]"):
        image_batch([])


def test_to_uint8_scales_floats_from_unit_range_and_clips_integers():
    np.testing.assert_array_equal(to_uint8(np.array([-0.5, 0.0, 0.25, 1.0, 3.0])), [0, 0, 64, 255, 255])
    np.testing.assert_array_equal(to_uint8(np.array([-3, 7, 300])), [0, 7, 255])
    np.testing.assert_array_equal(to_uint8(np.array([True, False])), [255, 0])


@pytest.mark.parametrize(("channels", "mode"), [(1, "L"), (2, "LA"), (3, "RGB"), (4, "RGBA")])
def test_encode_png_decodes_to_the_same_pixels(channels, mode):
    pixels = np.random.default_rng(channels).integers(0, 256, size=(7, 5, channels), dtype=np.uint8)
    decoded = Image.open(io.BytesIO(encode_png(pixels)))
    assert decoded.mode == mode and decoded.size == (5, 7)
    np.testing.assert_array_equal(np.asarray(decoded).reshape(7, 5, channels), pixels)
