"""Images for loggers: normalise what users log to an ``(N, H, W, C)`` batch, encode one image as PNG."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import numpy as np

__all__ = ["image_batch", "to_uint8", "encode_png"]

_PNG_COLOR_TYPE = {1: 0, 2: 4, 3: 2, 4: 6}  # channels -> PNG colour type (grey, grey+alpha, RGB, RGBA)


def image_batch(images: Any, channels_last: bool = True) -> np.ndarray:
    """Return host ``images`` as an ``(N, H, W, C)`` array with ``C`` in 1-4.

    Accepts one ``(H, W)`` or ``(H, W, C)`` image, an ``(N, H, W, C)`` batch, or a list of same-shaped
    images; with ``channels_last=False``, ``(C, H, W)`` and ``(N, C, H, W)``.

    Example:
        >>> image_batch(np.zeros((8, 8))).shape
        (1, 8, 8, 1)
        >>> image_batch([np.zeros((3, 8, 6))] * 2, channels_last=False).shape
        (2, 8, 6, 3)
    """
    if isinstance(images, (list, tuple)):
        if not images:
            raise ValueError("images=[]: expected at least one image")
        shapes = {np.shape(image) for image in images}
        if len(shapes) > 1:
            raise ValueError(f"images: a list of images must share one shape; got shapes {sorted(shapes)}")
        batch = np.stack([np.asarray(image) for image in images])
        if batch.ndim == 3:  # a list of (H, W) images
            batch = batch[..., None] if channels_last else batch[:, None]
    else:
        batch = np.asarray(images)
        if batch.ndim == 2:
            batch = batch[None, ..., None] if channels_last else batch[None, None]
        elif batch.ndim == 3:
            batch = batch[None]
    if batch.ndim != 4:
        raise ValueError(f"images of shape {np.shape(images)}: expected (H, W), (H, W, C), (N, H, W, C) or a "
                         "list of images")
    if not channels_last:
        batch = np.moveaxis(batch, 1, -1)
    if batch.shape[-1] not in _PNG_COLOR_TYPE:
        layout = "(..., H, W, C)" if channels_last else "(..., C, H, W)"
        raise ValueError(f"images of shape {np.shape(images)}: {batch.shape[-1]} channels in layout {layout}; "
                         "expected 1, 2, 3 or 4 (pass channels_last=False for channels-first images)")
    return batch


def to_uint8(image: np.ndarray) -> np.ndarray:
    """Scale an image to uint8: floats are read as [0, 1], bools as {0, 1}, other integers as [0, 255].

    Example:
        >>> to_uint8(np.array([0.0, 0.5, 2.0])).tolist()
        [0, 128, 255]
    """
    if image.dtype == np.uint8:
        return image
    if image.dtype == np.bool_:
        return image.astype(np.uint8) * 255
    if np.issubdtype(image.dtype, np.floating):
        return np.round(np.clip(image, 0.0, 1.0) * 255).astype(np.uint8)
    return np.clip(image, 0, 255).astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    """Encode one ``(H, W, C)`` image (``C`` in 1-4; see ``to_uint8`` for value ranges) as PNG bytes.

    Example:
        >>> encode_png(np.zeros((2, 3, 3)))[:8]
        b'\\x89PNG\\r\\n\\x1a\\n'
    """
    pixels = to_uint8(np.asarray(image))
    height, width, channels = pixels.shape
    # Each scanline starts with its filter type; 0 (none) keeps the encoder trivial.
    scanlines = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, width * channels)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, _PNG_COLOR_TYPE[channels], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(scanlines.tobytes()))
            + _chunk(b"IEND", b""))


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
