"""Image visualizer: log a few of the batch's input images every interval, to see what the model sees."""

from __future__ import annotations

from typing import Any

import numpy as np

from composerjax import Callback, Logger, State, Time, TimeUnit
from composerjax.core.time import parse_time

__all__ = ["ImageVisualizer"]

_MODES = ("input", "segmentation")


class ImageVisualizer(Callback):
    """Log the first ``num_images`` input images of the training batch every ``interval``.

    The images come from the host batch (``state.batch``, as the dataloader and host algorithms left
    it; augmentations applied inside the compiled step are not visible here) and go to
    ``logger.log_images`` under ``images/train`` at the current batch as step. Only destinations
    that handle images (TensorBoard, in-memory, ...) receive them, and a device batch is fetched
    only then. The first batch of every evaluation is logged under ``images/eval``.

    In ``'segmentation'`` mode the targets (integer class masks ``(N, H, W)``) are logged as well,
    under ``images/train/masks`` (and ``images/eval/masks``), scaled so that the largest class is
    white.

    Args:
        interval: how often to log: a time string or Time in batches (``'100ba'``) or epochs
            (``'1ep'``, logged at the end of the epoch from its last batch); an int means batches.
        mode: ``'input'`` (the images) or ``'segmentation'`` (the images and their target masks).
        num_images: how many images of the batch to log (fewer if the batch is smaller).
        channels_last: whether images are ``(N, H, W, C)``; False for ``(N, C, H, W)``.
        input_key: where the images are in the batch (tuple/list index or dict key).
        target_key: where the targets are in the batch (used in ``'segmentation'`` mode).

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.image_visualizer import ImageVisualizer

        trainer = Trainer(model, loader, max_duration='10ep',
                          callbacks=[ImageVisualizer(interval='200ba', num_images=16)],
                          loggers=[TensorBoardLogger()])
    """

    def __init__(
        self,
        interval: int | str | Time = "100ba",
        mode: str = "input",
        num_images: int = 8,
        channels_last: bool = True,
        input_key: int | str = 0,
        target_key: int | str = 1,
    ) -> None:
        self.interval = _batch_or_epoch_interval(interval)
        if mode not in _MODES:
            raise ValueError(f"mode={mode!r}: expected one of {list(_MODES)}")
        if isinstance(num_images, bool) or not isinstance(num_images, int) or num_images < 1:
            raise ValueError(f"num_images={num_images!r}: expected a positive integer")
        if not isinstance(channels_last, bool):
            raise ValueError(f"channels_last={channels_last!r}: expected True or False")
        self.mode = mode
        self.num_images = num_images
        self.channels_last = channels_last
        self.input_key = input_key
        self.target_key = target_key
        self._eval_logged = False

    def batch_end(self, state: State, logger: Logger) -> None:
        interval = self.interval
        if interval.unit == TimeUnit.BATCH and state.timestamp.batch.value % interval.value == 0:
            self._log(state, logger, "images/train")

    def epoch_end(self, state: State, logger: Logger) -> None:
        interval = self.interval
        if interval.unit == TimeUnit.EPOCH and state.timestamp.epoch.value % interval.value == 0:
            self._log(state, logger, "images/train")

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval_logged = False

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        if not self._eval_logged:
            self._eval_logged = True
            self._log(state, logger, "images/eval")

    def _log(self, state: State, logger: Logger, name: str) -> None:
        step = state.timestamp.batch.value
        images = state.batch_get_item(self.input_key)[: self.num_images]
        logger.log_images(images, name=name, step=step, channels_last=self.channels_last)
        if self.mode == "segmentation":
            masks = state.batch_get_item(self.target_key)[: self.num_images]
            logger.log_images(_mask_images(masks), name=f"{name}/masks", step=step)


def _mask_images(masks: Any) -> np.ndarray:
    """Integer class masks ``(N, H, W)`` as grey images in [0, 1]: class ``k`` of ``K`` is ``k / max(K - 1, 1)``."""
    masks = np.asarray(masks)
    if masks.ndim != 3:
        raise ValueError(f"segmentation masks of shape {masks.shape}: expected integer class masks (N, H, W)")
    top = max(int(masks.max()), 1)
    return (masks.astype(np.float32) / top)[..., None]


def _batch_or_epoch_interval(interval: int | str | Time) -> Time:
    """``interval`` as a positive Time in batches or epochs; an int means batches."""
    return parse_time(interval, "interval", (TimeUnit.BATCH, TimeUnit.EPOCH), TimeUnit.BATCH, minimum=1,
                      expected="a positive number of batches or epochs, such as '100ba', '1ep' or 100")
