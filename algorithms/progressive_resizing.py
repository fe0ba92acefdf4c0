"""Progressive resizing: train on downscaled images first, growing them back to full size.

Image sizes follow a schedule in training progress: ``initial_scale`` for the first ``delay_fraction``,
then a linear ramp to full size reached at ``1 - finetune_fraction``, then full size. Each scale is
pinned so the width is a multiple of ``size_increment`` pixels, as in Composer, so a run sees only a
handful of distinct shapes: the compiled step is built once per shape, and
:meth:`ProgressiveResizing.planned_sizes` lists them before training starts. Resizing is torch's
nearest-neighbour ``F.interpolate``, as Composer's.

Images are ``(N, H, W)`` or ``(N, H, W, C)`` (channels last, as flax convolutions take them).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from composerjax import Algorithm, Event, Logger, State
from composerjax.algorithms.interpolate import interpolate_nearest, interpolated_size
from composerjax.algorithms.schedule_times import planned_progress

__all__ = ["resizing_scale", "pinned_scale", "scaled_size", "resize_batch", "ProgressiveResizing"]

_MODES = ("resize", "crop")


def resizing_scale(progress: float, initial_scale: float, delay_fraction: float, finetune_fraction: float) -> float:
    """Return the scale factor at ``progress`` (fraction of training elapsed) of the resizing schedule.

    ``initial_scale`` until ``delay_fraction``, then linear up to 1 at ``1 - finetune_fraction``, then 1.

    Example:
        >>> resizing_scale(0.25, 0.5, delay_fraction=0.5, finetune_fraction=0.2)
        0.5
        >>> round(resizing_scale(0.65, 0.5, delay_fraction=0.5, finetune_fraction=0.2), 6)
        0.75
        >>> resizing_scale(0.9, 0.5, delay_fraction=0.5, finetune_fraction=0.2)
        1.0
    """
    if progress < delay_fraction:
        return initial_scale
    ramp = 1.0 - finetune_fraction - delay_fraction
    ramp_done = 1.0 if ramp <= 0 else min((progress - delay_fraction) / ramp, 1.0)
    return initial_scale + (1.0 - initial_scale) * ramp_done


def pinned_scale(width: int, scale: float, size_increment: int) -> float:
    """Return ``scale`` adjusted so that the new width is a multiple of ``size_increment``, as Composer pins it.

    ``round(width * scale / size_increment) * size_increment / width``, at least one increment (Composer
    would ask for a zero width).

    Example:
        >>> pinned_scale(28, 0.6, 4)  # 16.8 pixels -> 16
        0.5714285714285714
    """
    new_width = max(round(width * scale / size_increment) * size_increment, size_increment)
    return new_width / width


def scaled_size(height: int, width: int, scale: float, size_increment: int) -> tuple[int, int]:
    """Return the ``(height, width)`` of images resized at ``scale`` pinned to a ``size_increment`` width.

    Both sides are ``floor(side * s)`` (``F.interpolate``'s sizes) for the :func:`pinned_scale` ``s``;
    an ``s`` of 1 or more keeps the full size.

    Example:
        >>> scaled_size(32, 32, 0.5, 4)
        (16, 16)
        >>> scaled_size(28, 28, 0.6, 4)
        (16, 16)
        >>> scaled_size(28, 28, 0.95, 4)
        (28, 28)
    """
    factor = pinned_scale(width, scale, size_increment)
    if factor >= 1.0:
        return height, width
    return interpolated_size(height, factor), interpolated_size(width, factor)


def _spatial_shape(array: Any, name: str) -> tuple[int, int]:
    if np.ndim(array) not in (3, 4):
        raise ValueError(f"{name} has shape {np.shape(array)}; expected images of shape (N, H, W) or (N, H, W, C)")
    return int(np.shape(array)[1]), int(np.shape(array)[2])


def resize_batch(
    x: Any,
    y: Any,
    scale_factor: float,
    mode: str = "resize",
    resize_targets: bool = False,
    rng: np.random.Generator | None = None,
) -> tuple[Any, Any]:
    """Shrink a batch of images by ``scale_factor``, cropping or resampling, as Composer's ``resize_batch``.

    ``mode='resize'`` is torch's nearest-neighbour ``F.interpolate(x, scale_factor=scale_factor,
    mode='nearest', recompute_scale_factor=False)`` (see
    :func:`~composerjax.algorithms.interpolate.interpolate_nearest`): sides ``floor(side * scale_factor)``,
    output pixel ``i`` copied from ``floor(i / scale_factor)``.
    ``mode='crop'`` takes one random crop of ``int(scale_factor * side)`` pixels at the same place in
    every image, its corner drawn from ``rng`` in ``[0, side - crop)``, as Composer draws it. With
    ``resize_targets`` the targets (``(N, H', W')`` or ``(N, H', W', C)`` maps, e.g. segmentation
    masks) get the same nearest resize, or the crop region scaled to their size. A ``scale_factor``
    of 1 or more returns the batch unchanged.

    Args:
        x: images ``(N, H, W)`` or ``(N, H, W, C)``, numpy or jax.
        y: targets, returned unchanged unless ``resize_targets``.
        scale_factor: the scale factor; at least 1 changes nothing.
        mode: ``'resize'`` or ``'crop'``.
        resize_targets: shrink the targets too.
        rng: the generator that places the crop (required for ``mode='crop'``).

    Returns:
        ``(x, y)`` resized.

    Example:
        >>> x = np.arange(16).reshape(1, 4, 4)
        >>> x_small, y_small = resize_batch(x, np.arange(1), 0.5)
        >>> x_small[0].tolist(), y_small.tolist()
        ([[0, 2], [8, 10]], [0])
    """
    if mode not in _MODES:
        raise ValueError(f"mode={mode!r}: expected one of {', '.join(map(repr, _MODES))}")
    height, width = _spatial_shape(x, "x")
    if resize_targets:
        target_height, target_width = _spatial_shape(y, "y (resize_targets=True)")
    if scale_factor >= 1:
        return x, y
    if mode == "resize":
        x = interpolate_nearest(x, scale_factor)
        return x, (interpolate_nearest(y, scale_factor) if resize_targets else y)
    if rng is None:
        raise ValueError("resize_batch(mode='crop') needs rng, a numpy Generator placing the crop")
    crop_height, crop_width = int(scale_factor * height), int(scale_factor * width)
    if crop_height < 1 or crop_width < 1:
        raise ValueError(f"scale_factor={scale_factor!r}: a crop of {height}x{width} images would be empty")
    top = int(rng.integers(0, height - crop_height))
    left = int(rng.integers(0, width - crop_width))
    x = x[:, top:top + crop_height, left:left + crop_width]
    if resize_targets:
        target_top, target_left = int(target_height / height * top), int(target_width / width * left)
        y = y[:, target_top:target_top + int(scale_factor * target_height),
              target_left:target_left + int(scale_factor * target_width)]
    return x, y


class ProgressiveResizing(Algorithm):
    """Train on smaller images early on: images grow from ``initial_scale`` of their size back to full size.

    Runs on the host at ``AFTER_DATALOADER``: the batch the step receives is already resized, so the
    compiled step is built once per distinct size (see :meth:`planned_sizes`). Eval batches are not
    resized.

    Args:
        mode: ``'resize'`` (nearest neighbour, torch's ``F.interpolate``) or ``'crop'`` (one random
            crop per batch, placed by a numpy generator seeded from the run's seed and the batch number).
        initial_scale: the scale of the images at the start, in ``(0, 1]``.
        finetune_fraction: the fraction of training at the end spent on full-size images.
        delay_fraction: the fraction of training at the start spent at ``initial_scale``.
        size_increment: widths are rounded to multiples of this many pixels; larger values mean
            fewer distinct sizes, hence fewer compiles.
        resize_targets: resize the targets too (segmentation masks).
        input_key: where the images are in the batch.
        target_key: where the targets are in the batch.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(rngs=nnx.Rngs(0)), 10), loader, '10ep',
                          algorithms=[ProgressiveResizing(initial_scale=0.5, size_increment=4)])
        trainer.state.algorithms[0].planned_sizes(trainer.state, (32, 32))  # the sizes it will compile
    """

    def __init__(
        self,
        mode: str = "resize",
        initial_scale: float = 0.5,
        finetune_fraction: float = 0.2,
        delay_fraction: float = 0.5,
        size_increment: int = 4,
        resize_targets: bool = False,
        input_key: int | str = 0,
        target_key: int | str = 1,
    ) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: expected one of {', '.join(map(repr, _MODES))}")
        if not 0 < initial_scale <= 1:
            raise ValueError(f"initial_scale={initial_scale!r}: expected a number in (0, 1]")
        if not 0 <= finetune_fraction <= 1:
            raise ValueError(f"finetune_fraction={finetune_fraction!r}: expected a number in [0, 1]")
        if not 0 <= delay_fraction <= 1:
            raise ValueError(f"delay_fraction={delay_fraction!r}: expected a number in [0, 1]")
        if delay_fraction + finetune_fraction > 1:
            raise ValueError(f"delay_fraction + finetune_fraction = {delay_fraction + finetune_fraction!r}: expected "
                             "at most 1 (the ramp cannot have negative length)")
        if isinstance(size_increment, bool) or not isinstance(size_increment, int) or size_increment < 1:
            raise ValueError(f"size_increment={size_increment!r}: expected a positive integer (pixels)")
        self.mode = mode
        self.initial_scale = initial_scale
        self.finetune_fraction = finetune_fraction
        self.delay_fraction = delay_fraction
        self.size_increment = size_increment
        self.resize_targets = resize_targets
        self.input_key = input_key
        self.target_key = target_key
        self._full_size: tuple[int, int] | None = None
        self._crop_seed: list[int] | None = None

    def scale_at(self, progress: float) -> float:
        """The scale factor (before rounding to ``size_increment``) at ``progress`` of training."""
        return resizing_scale(progress, self.initial_scale, self.delay_fraction, self.finetune_fraction)

    def size_at(self, progress: float, image_size: tuple[int, int]) -> tuple[int, int]:
        """The ``(height, width)`` that full-size ``image_size`` images have at ``progress``."""
        return scaled_size(*image_size, self.scale_at(progress), self.size_increment)

    def planned_sizes(self, state: State, image_size: tuple[int, int] | None = None) -> list[tuple[int, int]]:
        """The distinct image sizes of the whole run, in order: the compiled train step is built once per size.

        Args:
            state: the trainer's state (its ``max_duration`` must be in batches, or in epochs with a
                sized dataloader).
            image_size: the full ``(height, width)``; by default the size of the last batch seen.
        """
        if image_size is None:
            if self._full_size is None:
                raise ValueError("planned_sizes: pass image_size=(height, width); no batch has been seen yet")
            image_size = self._full_size
        sizes: dict[tuple[int, int], None] = {}
        for progress in planned_progress(state):
            sizes.setdefault(self.size_at(progress, image_size), None)
        return list(sizes)

    events = frozenset({Event.AFTER_DATALOADER})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        x = state.batch_get_item(self.input_key)
        y = state.batch_get_item(self.target_key) if self.resize_targets else None
        self._full_size = _spatial_shape(x, f"batch[{self.input_key!r}]")
        scale = self.scale_at(state.progress)
        rng = None
        if self.mode == "crop":
            if self._crop_seed is None:
                self._crop_seed = [int(word) for word in np.asarray(jax.random.key_data(state.rng)).ravel()]
            rng = np.random.default_rng([*self._crop_seed, state.timestamp.batch.value])
        width = self._full_size[1]
        factor = pinned_scale(width, scale, self.size_increment)
        new_x, new_y = resize_batch(x, y, factor, self.mode, self.resize_targets, rng)
        if new_x is not x:
            state.batch_set_item(self.input_key, new_x)
        if self.resize_targets and new_y is not y:
            state.batch_set_item(self.target_key, new_y)
        height, width = _spatial_shape(new_x, "resized images")
        logger.log_metrics({"progressive_resizing/height": height, "progressive_resizing/width": width,
                            "progressive_resizing/scale_factor": scale})

    def __repr__(self) -> str:
        return (f"ProgressiveResizing(mode={self.mode!r}, initial_scale={self.initial_scale}, "
                f"finetune_fraction={self.finetune_fraction}, delay_fraction={self.delay_fraction}, "
                f"size_increment={self.size_increment})")
