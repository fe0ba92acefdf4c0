"""ProgressiveResizing: the schedule's closed form, torch's nearest resize and crops, one compile per planned size."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Callback, ComposerClassifier, Event, Logger, State, Timestamp, Trainer
from composerjax.algorithms.progressive_resizing import (
    ProgressiveResizing,
    pinned_scale,
    resize_batch,
    resizing_scale,
    scaled_size,
)
from composerjax.data import ArrayLoader
from composerjax.models import SmallResNet


def closed_form_scale(progress: float, initial: float, delay: float, finetune: float) -> float:
    if progress < delay:
        return initial
    if progress >= 1 - finetune:
        return 1.0
    return initial + (1 - initial) * (progress - delay) / (1 - finetune - delay)


@pytest.mark.parametrize("progress", [0.0, 0.3, 0.49, 0.5, 0.6, 0.65, 0.79, 0.8, 0.95])
def test_scale_follows_the_closed_form(progress):
    assert resizing_scale(progress, 0.5, 0.5, 0.2) == pytest.approx(closed_form_scale(progress, 0.5, 0.5, 0.2))


@pytest.mark.parametrize("progress", [0.0, 0.5, 0.55, 0.6, 0.7, 0.75, 0.8])
def test_size_is_the_scaled_width_rounded_to_the_increment(progress):
    algorithm = ProgressiveResizing(initial_scale=0.5, delay_fraction=0.5, finetune_fraction=0.2, size_increment=4)
    scale = closed_form_scale(progress, 0.5, 0.5, 0.2)
    width = 4 * round(32 * scale / 4)
    expected = (32, 32) if width >= 32 else (width, width)
    assert algorithm.size_at(progress, (32, 32)) == expected
    assert width % 4 == 0


def test_scaled_size_pins_the_width_and_floors_both_sides_like_composer():
    assert scaled_size(16, 32, 0.5, 4) == (8, 16)
    assert scaled_size(8, 8, 0.1, 4) == (4, 4)  # never below one increment
    assert scaled_size(8, 8, 1.0, 4) == (8, 8)
    assert scaled_size(8, 8, 0.9, 4) == (8, 8)  # 7.2 rounds to the full width 8
    # width 20 * 0.35 = 7 (increment 7); height floor(10 * 7 / 20) = 3
    assert pinned_scale(20, 0.35, 7) == 0.35 and scaled_size(10, 20, 0.35, 7) == (3, 7)


def gathered(x: np.ndarray, rows: list[int], cols: list[int]) -> np.ndarray:
    return x[:, rows][:, :, cols]


@pytest.mark.parametrize(
    ("shape", "scale_factor", "rows", "cols"),
    [
        ((4, 4), 0.5, [0, 2], [0, 2]),  # floor(i * 2)
        ((5, 5), 0.6, [0, 1, 3], [0, 1, 3]),  # floor(i * 1.667) = floor(0, 1.67, 3.33)
        # 1 / 0.35 = 2.857 for both sides (torch's ratio is 1 / scale_factor, not 10 / 3 for the rows)
        ((10, 20), 0.35, [0, 2, 5], [0, 2, 5, 8, 11, 14, 17]),
        ((6, 6), 0.75, [0, 1, 2, 4], [0, 1, 2, 4]),  # floor(i * 1.333)
    ],
)
def test_resize_mode_is_torch_nearest_with_the_given_scale_factor(shape, scale_factor, rows, cols):
    x = np.random.default_rng(0).normal(size=(2, *shape, 3)).astype(np.float32)
    y = np.arange(2)
    x_small, y_small = resize_batch(x, y, scale_factor, "resize")
    np.testing.assert_array_equal(x_small, gathered(x, rows, cols))
    assert y_small is y
    x_small, _ = resize_batch(x[..., 0], y, scale_factor, "resize")  # channel-less images too
    np.testing.assert_array_equal(x_small, gathered(x[..., 0], rows, cols))


def test_a_scale_factor_of_one_returns_the_batch_untouched():
    x = np.zeros((2, 8, 8), np.float32)
    y = np.zeros(2, np.int32)
    assert resize_batch(x, y, 1.0) == (x, y)
    assert resize_batch(x, y, 1.25, "crop")[0] is x


def test_crop_mode_takes_the_same_window_of_inputs_and_targets():
    x = np.arange(2 * 8 * 8, dtype=np.float32).reshape(2, 8, 8)
    masks = np.arange(2 * 8 * 8, dtype=np.int32).reshape(2, 8, 8) % 5
    x_crop, y_crop = resize_batch(x, masks, 0.5, "crop", resize_targets=True, rng=np.random.default_rng(3))
    draws = np.random.default_rng(3)
    top, left = int(draws.integers(0, 4)), int(draws.integers(0, 4))  # Composer: randint(8 - 4), in [0, 4)
    np.testing.assert_array_equal(x_crop, x[:, top:top + 4, left:left + 4])
    np.testing.assert_array_equal(y_crop, masks[:, top:top + 4, left:left + 4])


def test_crop_of_smaller_targets_takes_the_scaled_window():
    x = np.arange(8 * 8, dtype=np.float32).reshape(1, 8, 8)
    masks = np.arange(4 * 4).reshape(1, 4, 4)
    _, y_crop = resize_batch(x, masks, 0.5, "crop", resize_targets=True, rng=np.random.default_rng(5))
    draws = np.random.default_rng(5)
    top, left = int(draws.integers(0, 4)), int(draws.integers(0, 4))
    np.testing.assert_array_equal(y_crop, masks[:, top // 2:top // 2 + 2, left // 2:left // 2 + 2])


def test_targets_are_resized_nearest_like_the_images():
    x = np.ones((1, 8, 8), np.float32)
    masks = np.arange(64, dtype=np.int32).reshape(1, 8, 8)
    soft = masks.astype(np.float32) / 64
    _, y_small = resize_batch(x, masks, 0.5, "resize", resize_targets=True)
    assert y_small.dtype == np.int32
    np.testing.assert_array_equal(y_small, gathered(masks, [0, 2, 4, 6], [0, 2, 4, 6]))
    _, soft_small = resize_batch(x, soft, 0.5, "resize", resize_targets=True)  # float maps: nearest too
    np.testing.assert_array_equal(soft_small, gathered(soft, [0, 2, 4, 6], [0, 2, 4, 6]))


class RecordBatches(Callback):
    """Keep the images the step receives (AFTER_DATALOADER callbacks run after the algorithms)."""

    def __init__(self) -> None:
        self.images: list[np.ndarray] = []

    def after_dataloader(self, state, logger) -> None:
        self.images.append(np.asarray(state.batch[0]))


def image_data(n: int = 40, size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(n, size, size)).astype(np.float32), rng.integers(0, 2, n).astype(np.int32)


def test_a_run_compiles_once_per_planned_size_and_feeds_exact_resizes():
    algorithm = ProgressiveResizing(initial_scale=0.5, delay_fraction=0.0, finetune_fraction=0.0, size_increment=4)
    recorder = RecordBatches()
    x, y = image_data()
    model = ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), num_classes=2)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=4, shuffle=False), max_duration="1ep",
                      optimizers=optax.sgd(0.01), algorithms=[algorithm], callbacks=[recorder], progress_bar=False)
    planned = algorithm.planned_sizes(trainer.state, (16, 16))
    trainer.fit()

    # One epoch of 10 batches, progressing per batch: scale 0.5 + 0.05 * step, the width 16 * scale
    # rounded to a multiple of 4, full size once it rounds to 16.
    widths = [8, 8, 8, 12, 12, 12, 12, 12, 16, 16]
    assert [image.shape[1:] for image in recorder.images] == [(w, w) for w in widths]
    assert [algorithm.size_at(step / 10, (16, 16)) for step in range(10)] == [(w, w) for w in widths]
    assert planned == [(8, 8), (12, 12), (16, 16)]
    assert trainer.compile_count == len(planned)
    assert algorithm.planned_sizes(trainer.state) == planned  # the full size is remembered from the batches

    # torch's nearest indices floor(i * 16 / width): 1 / 0.5 = 2 and 1 / 0.75 = 1.3333334 in float32
    sources = {8: list(range(0, 16, 2)), 12: [0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14], 16: list(range(16))}
    for step, (image, width) in enumerate(zip(recorder.images, widths)):
        original = x[4 * step:4 * step + 4]
        np.testing.assert_array_equal(image, gathered(original, sources[width], sources[width]))


def crop_at(algorithm: ProgressiveResizing, batch: tuple, step: int, seed: int = 0) -> np.ndarray:
    """Apply the algorithm on the host at AFTER_DATALOADER of batch ``step``; return the images."""
    state = State(model=None, max_duration="10ba", rng=jax.random.key(seed))
    state.batch, state.timestamp = batch, Timestamp(batch=step)
    algorithm.apply(Event.AFTER_DATALOADER, state, Logger(state))
    return np.asarray(state.batch[0])


def test_crops_are_windows_placed_by_a_generator_seeded_from_the_run_rng_and_the_step():
    x, y = image_data(n=4)
    for seed, step in [(0, 0), (0, 1), (1, 0)]:
        algorithm = ProgressiveResizing("crop", initial_scale=0.5, delay_fraction=1.0, finetune_fraction=0.0)
        crop = crop_at(algorithm, (x, y), step, seed)
        key_words = np.asarray(jax.random.key_data(jax.random.key(seed))).ravel().tolist()
        draws = np.random.default_rng([*key_words, step])
        top, left = int(draws.integers(0, 8)), int(draws.integers(0, 8))
        np.testing.assert_array_equal(crop, x[:, top:top + 8, left:left + 8])


def test_planned_sizes_needs_a_known_number_of_batches():
    algorithm = ProgressiveResizing()
    with pytest.raises(ValueError, match="max_duration"):
        algorithm.planned_sizes(State(model=None, max_duration="40sp"), (16, 16))
    with pytest.raises(ValueError, match="image_size"):
        algorithm.planned_sizes(State(model=None, max_duration="4ba"))
    assert algorithm.planned_sizes(State(model=None, max_duration="4ba"), (16, 16)) == [(8, 8), (16, 16)]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "nearest"}, "mode"),
        ({"initial_scale": 0.0}, "initial_scale"),
        ({"initial_scale": 1.5}, "initial_scale"),
        ({"finetune_fraction": -0.1}, "finetune_fraction"),
        ({"delay_fraction": 1.2}, "delay_fraction"),
        ({"delay_fraction": 0.6, "finetune_fraction": 0.6}, "delay_fraction \\+ finetune_fraction"),
        ({"size_increment": 0}, "size_increment"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ProgressiveResizing(**kwargs)


def test_non_image_inputs_are_rejected():
    with pytest.raises(ValueError, match="expected images"):
        resize_batch(np.zeros((4, 3)), np.zeros(4), 0.5)
