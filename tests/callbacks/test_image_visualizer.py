"""ImageVisualizer: the first images of the batch reach ``logger.log_images`` at the right steps."""

import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, LoggerDestination, Trainer
from composerjax.callbacks.image_visualizer import ImageVisualizer


class ImageRecorder(LoggerDestination):
    """Keep every ``log_images`` call as ``(name, step, images)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, np.ndarray]] = []

    def log_images(self, images, name, step=None):
        self.calls.append((name, step, np.array(images)))


class FlattenLinear(nnx.Module):
    def __init__(self, features: int, rngs: nnx.Rngs) -> None:
        self.linear = nnx.Linear(features, 2, rngs=rngs)

    def __call__(self, x):
        return self.linear(x.reshape((x.shape[0], -1)))


def image_arrays(channels_last: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """64 images 4x5 with 3 channels, values in [0, 1], and binary labels."""
    images = np.random.default_rng(1).uniform(size=(64, 4, 5, 3)).astype(np.float32)
    labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype(np.int32)
    return (images if channels_last else np.moveaxis(images, -1, 1).copy()), labels


def run(visualizer: ImageVisualizer, channels_last: bool = True, max_duration: str = "2ep",
        eval_data: bool = False) -> ImageRecorder:
    x, y = image_arrays(channels_last)
    recorder = ImageRecorder()
    model = ComposerClassifier(FlattenLinear(60, nnx.Rngs(0)), num_classes=2)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), max_duration=max_duration,
                      optimizers=optax.sgd(0.1), callbacks=[visualizer], loggers=[recorder], progress_bar=False,
                      run_summary=False, eval_dataloader=ArrayLoader((x[:32], y[:32]), batch_size=16, shuffle=False)
                      if eval_data else None)
    trainer.fit()
    return recorder


def test_logs_the_first_images_of_the_batch_every_interval():
    recorder = run(ImageVisualizer(interval="3ba", num_images=3))
    x, _ = image_arrays()
    assert [(name, step) for name, step, _ in recorder.calls] == [("images/train", 3), ("images/train", 6)]
    for _, step, images in recorder.calls:
        first = 16 * ((step - 1) % 4)  # batch `step` is the ((step - 1) % 4)-th of its epoch, unshuffled
        assert images.shape == (3, 4, 5, 3)
        np.testing.assert_array_equal(images, x[first:first + 3])


def test_channels_first_images_arrive_channels_last():
    recorder = run(ImageVisualizer(interval="4ba", num_images=2, channels_last=False), channels_last=False)
    x, _ = image_arrays(channels_last=True)
    assert [step for _, step, _ in recorder.calls] == [4, 8]
    for _, _, images in recorder.calls:
        np.testing.assert_array_equal(images, x[48:50])


def test_epoch_interval_logs_the_last_batch_of_the_epoch_and_the_first_eval_batch():
    recorder = run(ImageVisualizer(interval="1ep", num_images=16), max_duration="2ep", eval_data=True)
    x, _ = image_arrays()
    names_steps = [(name, step) for name, step, _ in recorder.calls]
    # Eval runs after EPOCH_END (interval 1ep): train images, then the first eval batch, per epoch.
    assert names_steps == [("images/train", 4), ("images/eval", 4), ("images/train", 8), ("images/eval", 8)]
    np.testing.assert_array_equal(recorder.calls[0][2], x[48:64])
    np.testing.assert_array_equal(recorder.calls[1][2], x[0:16])


def test_segmentation_mode_logs_masks_scaled_to_the_largest_class():
    images = np.zeros((16, 2, 2, 1), np.float32)
    masks = np.tile(np.array([[0, 1], [2, 4]], np.int32), (16, 1, 1))
    visualizer = ImageVisualizer(interval="1ba", mode="segmentation", num_images=2)
    recorder = ImageRecorder()
    from composerjax import Logger, State

    state = State(model=None)
    state.batch = (images, masks)
    visualizer.batch_end(state, Logger(state, [recorder]))
    assert [(name, step) for name, step, _ in recorder.calls] == [("images/train", 0), ("images/train/masks", 0)]
    np.testing.assert_allclose(recorder.calls[1][2][0, ..., 0], [[0.0, 0.25], [0.5, 1.0]])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval": "0ba"}, "interval='0ba'"),
        ({"interval": "10sp"}, "batches or epochs"),
        ({"interval": "often"}, "interval='often'"),
        ({"mode": "masks"}, "mode='masks'"),
        ({"num_images": 0}, "num_images=0"),
        ({"channels_last": "yes"}, "channels_last='yes'"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ImageVisualizer(**kwargs)
