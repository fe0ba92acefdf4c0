"""Image resizing that reproduces ``torch.nn.functional.interpolate`` with a ``scale_factor``, on channels-last images.

Composer's ProgressiveResizing and SelectiveBackprop call ``F.interpolate(x, scale_factor=s,
recompute_scale_factor=False)``: the output side is ``floor(side * s)`` and the source of each output
pixel is found with the ratio ``1 / s`` (not ``side / new_side``), with no antialiasing. The functions
here compute the same source pixels and weights (in float32, as torch does on the CPU) and apply
them with plain indexing, so numpy images stay numpy (host-side algorithms) and jax arrays stay jax
(traced ones). Images are ``(N, H, W)`` or ``(N, H, W, C)``; axes 1 and 2 are resized.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["bilinear_sources", "interpolate_bilinear", "interpolate_nearest", "interpolated_size", "nearest_sources"]


def interpolated_size(size: int, scale_factor: float) -> int:
    """The side ``F.interpolate`` gives a side of ``size`` pixels: ``floor(size * scale_factor)`` in double precision.

    Example:
        >>> interpolated_size(5, 0.6), interpolated_size(7, 0.5)
        (3, 3)
    """
    return int(math.floor(float(size) * scale_factor))


def _check(size: int, scale_factor: float) -> int:
    if not (isinstance(scale_factor, (int, float)) and not isinstance(scale_factor, bool) and scale_factor > 0):
        raise ValueError(f"scale_factor={scale_factor!r}: expected a positive number")
    out_size = interpolated_size(size, scale_factor)
    if out_size < 1:
        raise ValueError(f"scale_factor={scale_factor!r}: a side of {size} pixels would shrink to {out_size}; "
                         "expected a scale that keeps at least one pixel")
    return out_size


def nearest_sources(size: int, scale_factor: float) -> np.ndarray:
    """The source index of each output pixel of torch's ``mode='nearest'``: ``min(floor(i / scale_factor), size - 1)``.

    ``1 / scale_factor`` and the product are float32, as in torch; an unchanged or doubled side is
    an exact copy or ``i // 2``, as torch special-cases them.

    Example:
        >>> nearest_sources(5, 0.6).tolist()  # 1 / 0.6 = 1.6667: floor(0, 1.67, 3.33)
        [0, 1, 3]
    """
    out_size = _check(size, scale_factor)
    positions = np.arange(out_size)
    if out_size == size:
        return positions
    if out_size == 2 * size:
        return positions >> 1
    ratio = np.float32(1.0 / scale_factor)
    return np.minimum(np.floor(positions.astype(np.float32) * ratio).astype(np.int64), size - 1)


def bilinear_sources(size: int, scale_factor: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(index0, index1, weight0, weight1)`` of torch's ``mode='bilinear', align_corners=False``, no antialias.

    Output pixel ``i`` reads the source position ``(i + 0.5) / scale_factor - 0.5`` (float32,
    clamped at 0), blending its two neighbours ``index0 = floor(position)`` and ``index1 = index0 + 1``
    (the last pixel stands in for the one past the edge) with ``weight1 = position - index0``.

    Example:
        >>> index0, index1, weight0, weight1 = bilinear_sources(4, 0.5)  # positions 0.5, 2.5
        >>> index0.tolist(), index1.tolist(), weight1.tolist()
        ([0, 2], [1, 3], [0.5, 0.5])
    """
    out_size = _check(size, scale_factor)
    ratio = np.float32(1.0 / scale_factor)
    position = ratio * (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
    position = np.maximum(position, np.float32(0.0))
    index0 = np.minimum(np.floor(position).astype(np.int64), size - 1)
    weight1 = np.clip(position - index0.astype(np.float32), 0.0, 1.0).astype(np.float32)
    index1 = np.where(index0 < size - 1, index0 + 1, index0)
    return index0, index1, (np.float32(1.0) - weight1).astype(np.float32), weight1


def _spatial_sizes(images: Any) -> tuple[int, int]:
    if np.ndim(images) not in (3, 4):
        raise ValueError(f"images of shape {np.shape(images)}: expected (N, H, W) or (N, H, W, C)")
    return int(np.shape(images)[1]), int(np.shape(images)[2])


def interpolate_nearest(images: Any, scale_factor: float) -> Any:
    """``F.interpolate(images, scale_factor=..., mode='nearest', recompute_scale_factor=False)``, channels last.

    A gather of the rows and columns :func:`nearest_sources` names: values and dtype are kept
    exactly (integer masks stay integer).

    Example:
        >>> x = np.arange(16).reshape(1, 4, 4)
        >>> interpolate_nearest(x, 0.5)[0].tolist()
        [[0, 2], [8, 10]]
    """
    height, width = _spatial_sizes(images)
    rows, cols = nearest_sources(height, scale_factor), nearest_sources(width, scale_factor)
    return images[:, rows][:, :, cols]


def _blend_axis(images: Any, axis: int, sources: tuple[np.ndarray, ...]) -> Any:
    index0, index1, weight0, weight1 = sources
    shape = (-1,) + (1,) * (images.ndim - axis - 1)
    first = images[(slice(None),) * axis + (index0,)]
    second = images[(slice(None),) * axis + (index1,)]
    return first * weight0.reshape(shape) + second * weight1.reshape(shape)


def interpolate_bilinear(images: Any, scale_factor: float) -> Any:
    """``F.interpolate(images, scale_factor=..., mode='bilinear', align_corners=False, recompute_scale_factor=False)``.

    Channels last, no antialiasing: each output pixel blends the four source pixels
    :func:`bilinear_sources` names (rows, then columns), in float32; integer images are rounded
    back to their dtype.

    Example:
        >>> x = np.arange(16, dtype=np.float32).reshape(1, 4, 4)
        >>> interpolate_bilinear(x, 0.5)[0].tolist()  # the mean of each 2x2 block
        [[2.5, 4.5], [10.5, 12.5]]
    """
    height, width = _spatial_sizes(images)
    dtype = images.dtype
    as_float = images.astype(np.float32) if np.issubdtype(dtype, np.integer) else images
    blended = _blend_axis(as_float, 1, bilinear_sources(height, scale_factor))
    blended = _blend_axis(blended, 2, bilinear_sources(width, scale_factor))
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        rounded = blended.round() if hasattr(blended, "round") else blended
        return rounded.clip(info.min, info.max).astype(dtype)
    return blended.astype(dtype)
