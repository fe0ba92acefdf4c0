"""Tests for TensorboardLogger: event files read back with TensorBoard's own reader."""

import io
from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.loggers import InMemoryLogger, TensorboardLogger

LOSS = "loss/train/total"
SAMPLES = np.linspace(0.0, 1.0, 2 * 3 * 4 * 3, dtype=np.float32).reshape(2, 3, 4, 3)  # two 3x4 RGB images


class ImagesAndTableAtEpochEnd(Callback):
    def epoch_end(self, state, logger):
        logger.log_images(jnp.asarray(SAMPLES), name="samples")
        logger.log_images(np.full((3, 4), 255, np.uint8), name="white")
        logger.log_table(["class", "count"], [["zero", jnp.int32(30)], ["one", 34]], name="classes")


def read_events(log_dir):
    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "images": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def decode_png(event):
    return np.asarray(Image.open(io.BytesIO(event.encoded_image_string)))


def text_of(accumulator, tag):
    return [(event.step, event.tensor_proto.string_val[0].decode()) for event in accumulator.Tensors(tag)]


@pytest.fixture(scope="module")
def tensorboard_run(classification_arrays, make_tiny_classifier, tmp_path_factory):
    """6 batches (4 per epoch, eval after epoch 0 and at fit end), log_interval=2, into TensorboardLogger()."""
    x, y = classification_arrays
    run_dir = tmp_path_factory.mktemp("run")
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
                      eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False), optimizers=optax.sgd(0.1),
                      callbacks=[ImagesAndTableAtEpochEnd()], loggers=[memory, TensorboardLogger()],
                      log_interval=2, progress_bar=False, run_dir=str(run_dir))
    trainer.fit()
    before_close = read_events(run_dir / "tensorboard")
    trainer.close()
    return SimpleNamespace(trainer=trainer, memory=memory, before_close=before_close,
                           events=read_events(run_dir / "tensorboard"))


def test_training_losses_are_scalars_at_their_steps(tensorboard_run):
    scalars = tensorboard_run.events.Scalars(LOSS)
    logged = tensorboard_run.memory.data[LOSS]
    assert [event.step for event in scalars] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_array_equal([event.value for event in scalars], np.float32([value for _, value in logged]))


def test_eval_metrics_are_scalars_at_the_batch_they_were_computed(tensorboard_run):
    accuracy = tensorboard_run.events.Scalars("metrics/eval/MulticlassAccuracy")
    assert [event.step for event in accuracy] == [4, 6]  # after epoch 0, and at the end of fit (batch 6)
    logged = [value for _, value in tensorboard_run.memory.data["metrics/eval/MulticlassAccuracy"]]
    np.testing.assert_array_equal([event.value for event in accuracy], np.float32(logged))


def test_scalars_are_on_disk_when_fit_returns(tensorboard_run):
    assert len(tensorboard_run.before_close.Scalars(LOSS)) == 6


def test_hyperparameters_are_text_and_an_hparams_session(tensorboard_run):
    run_name = tensorboard_run.trainer.state.run_name
    (step, table), *_ = text_of(tensorboard_run.events, "hyperparameters/text_summary")
    assert step == 0
    assert f"| run_summary/run_name | {run_name} |" in table
    assert "| run_summary/parameters | 10 |" in table
    content = tensorboard_run.events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = HParamsPluginData.FromString(content).session_start_info.hparams
    assert hparams["run_summary/run_name"].string_value == run_name
    assert hparams["run_summary/parameters"].number_value == 10
    assert hparams["run_summary/algorithms"].string_value == "[]"
    # compiled_steps/0 is a dict: flattened
    assert hparams["compiled_steps/0/kind"].string_value == "train"


def test_images_are_pngs_with_the_logged_pixels(tensorboard_run):
    events = tensorboard_run.events
    for index in range(2):
        (event,) = events.Images(f"samples/{index}")
        assert (event.step, event.width, event.height) == (4, 4, 3)
        np.testing.assert_array_equal(decode_png(event), np.round(SAMPLES[index] * 255).astype(np.uint8))
    (white,) = events.Images("white")
    np.testing.assert_array_equal(decode_png(white), np.full((3, 4), 255, np.uint8))


def test_tables_are_markdown_text(tensorboard_run):
    assert text_of(tensorboard_run.events, "classes/text_summary") == [
        (4, "| class | count |\n|---|---|\n| zero | 30 |\n| one | 34 |")
    ]


def test_without_a_log_dir_or_a_run_folder_writing_says_what_to_pass():
    with pytest.raises(RuntimeError, match=r"pass TensorboardLogger\(log_dir=\.\.\.\)"):
        TensorboardLogger().log_metrics({"loss": 1.0}, step=1)


def test_constructor_validation_names_the_argument():
    with pytest.raises(TypeError, match=r"log_dir=5"):
        TensorboardLogger(5)
    with pytest.raises(ValueError, match=r"flush_secs=0"):
        TensorboardLogger(flush_secs=0)
