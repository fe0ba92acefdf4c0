"""Tests for the Logger facade: step defaults, dispatch, and one fetch per log_images/log_table call."""

import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composerjax import Timestamp
from composerjax.loggers import InMemoryLogger, Logger, LoggerDestination, is_process_zero


class Recording(LoggerDestination):
    """Records every call it receives, in order."""

    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append(("metrics", metrics, step))

    def log_hyperparameters(self, hyperparameters):
        self.calls.append(("hyperparameters", hyperparameters))

    def log_traces(self, traces):
        self.calls.append(("traces", traces))

    def log_images(self, images, name, step=None):
        self.calls.append(("images", images, name, step))

    def log_table(self, columns, rows, name, step=None):
        self.calls.append(("table", columns, rows, name, step))


class MetricsOnly(LoggerDestination):
    def __init__(self):
        self.metrics = []

    def log_metrics(self, metrics, step=None):
        self.metrics.append((step, metrics))


@pytest.fixture
def count_device_gets(monkeypatch):
    """Count jax.device_get calls (the real function still runs)."""
    calls = []
    real = jax.device_get

    def counting(value):
        calls.append(value)
        return real(value)

    monkeypatch.setattr(jax, "device_get", counting)
    return calls


def test_destinations_is_one_list_that_mutations_reach():
    first, second = Recording(), Recording()
    logger = Logger(None, [first])
    destinations = logger.destinations
    destinations.append(second)
    assert logger.destinations is destinations
    logger.log_metrics({"loss": 1.5}, step=3)
    assert first.calls == second.calls == [("metrics", {"loss": 1.5}, 3)]


def test_every_method_reaches_every_destination_with_the_state_batch_as_default_step():
    state = SimpleNamespace(timestamp=Timestamp(batch=7))
    destinations = [Recording(), Recording()]
    logger = Logger(state, destinations)
    logger.log_metrics({"loss": 0.5})
    logger.log_metrics({"loss": 0.25}, step=2)
    logger.log_hyperparameters({"lr": 0.1})
    logger.log_traces({"A/BATCH_START": "trace"})
    logger.log_table(["a"], [[1]], name="t")
    for destination in destinations:
        assert destination.calls == [
            ("metrics", {"loss": 0.5}, 7),
            ("metrics", {"loss": 0.25}, 2),
            ("hyperparameters", {"lr": 0.1}),
            ("traces", {"A/BATCH_START": "trace"}),
            ("table", ["a"], [[1]], "t", 7),
        ]


def test_log_images_fetches_a_list_of_device_images_once_and_hands_over_one_nhwc_batch(count_device_gets):
    destination = Recording()
    logger = Logger(SimpleNamespace(timestamp=Timestamp(batch=4)), [destination, MetricsOnly()])
    images = [jnp.full((2, 3), 0.25), jnp.full((2, 3), 0.75)]  # two (H, W) grey images
    logger.log_images(images, name="samples")
    assert len(count_device_gets) == 1
    (kind, batch, name, step), = destination.calls
    assert (kind, name, step) == ("images", "samples", 4)
    assert type(batch) is np.ndarray and batch.shape == (2, 2, 3, 1)
    np.testing.assert_array_equal(batch[:, 0, 0, 0], [0.25, 0.75])


def test_log_images_channels_first_batch_is_moved_to_channels_last():
    destination = Recording()
    images = np.arange(2 * 3 * 4 * 5).reshape(2, 3, 4, 5)  # N, C, H, W
    Logger(None, [destination]).log_images(images, name="x", step=1, channels_last=False)
    batch = destination.calls[0][1]
    assert batch.shape == (2, 4, 5, 3)
    np.testing.assert_array_equal(batch[1, 2, 3], images[1, :, 2, 3])


def test_log_images_and_log_table_fetch_nothing_when_no_destination_handles_them(count_device_gets):
    metrics_only = MetricsOnly()
    logger = Logger(None, [metrics_only])
    logger.log_images(jnp.zeros((4, 4, 3)), name="x", step=1)
    logger.log_table(["a"], [[jnp.float32(1.0)]], name="t", step=1)
    assert count_device_gets == []
    assert metrics_only.metrics == []


def test_log_table_fetches_device_values_once_as_plain_python_numbers(count_device_gets):
    destination = Recording()
    logger = Logger(None, [destination])
    logger.log_table(("name", "score", "count"), [("a", jnp.float32(0.5), np.int64(3)), ["b", 1.25, jnp.int32(4)]],
                     name="scores", step=9)
    assert len(count_device_gets) == 1
    assert destination.calls == [("table", ["name", "score", "count"], [["a", 0.5, 3], ["b", 1.25, 4]], "scores", 9)]
    rows = destination.calls[0][2]
    assert [type(value) for value in rows[0]] == [str, float, int]


def test_log_table_rejects_a_row_of_the_wrong_length_and_non_string_columns():
    logger = Logger(None, [Recording()])
    with pytest.raises(ValueError, match=r"row 1 has 1 values; expected one per column \(2: \['a', 'b'\]\)"):
        logger.log_table(["a", "b"], [[1, 2], [3]], name="t")
    with pytest.raises(ValueError, match="columns='ab'"):
        logger.log_table("ab", [[1, 2]], name="t")
    with pytest.raises(ValueError, match="name=''"):
        logger.log_table(["a"], [[1]], name="")


def test_log_images_rejects_shapes_that_are_not_images():
    logger = Logger(None, [Recording()])
    with pytest.raises(ValueError, match=r"images of shape \(4, 4, 5\): 5 channels"):
        logger.log_images(np.zeros((4, 4, 5)), name="x", step=0)
    with pytest.raises(ValueError, match=r"images of shape \(4,\)"):
        logger.log_images(np.zeros(4), name="x", step=0)
    with pytest.raises(ValueError, match="must share one shape"):
        logger.log_images([np.zeros((4, 4)), np.zeros((4, 5))], name="x", step=0)
    with pytest.raises(ValueError, match="name=3"):
        logger.log_images(np.zeros((4, 4)), name=3)


def test_in_memory_logger_keeps_every_kind_of_value_in_order():
    memory = InMemoryLogger()
    logger = Logger(None, [memory])
    logger.log_metrics({"loss": 0.5, "acc": 0.25}, step=1)
    logger.log_metrics({"loss": 0.375}, step=2)
    logger.log_hyperparameters({"lr": 0.1, "batch_size": 16})
    logger.log_hyperparameters({"lr": 0.05})
    logger.log_images(np.ones((2, 2)), name="img", step=3)
    logger.log_table(["a"], [[1], [2]], name="t", step=4)
    assert memory.data == {"loss": [(1, 0.5), (2, 0.375)], "acc": [(1, 0.25)]}
    assert memory.latest("loss") == 0.375
    assert memory.hyperparameters == {"lr": 0.05, "batch_size": 16}
    (step, image), = memory.images["img"]
    assert step == 3 and image.shape == (1, 2, 2, 1)
    assert memory.tables == {"t": [(4, ["a"], [[1], [2]])]}
    with pytest.raises(KeyError, match=r"'lr' was never logged; logged metrics: \['acc', 'loss'\]"):
        memory.latest("lr")


def test_is_process_zero_follows_jax_process_index(monkeypatch):
    assert is_process_zero()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    assert not is_process_zero()


# -- the Trainer's side: auto_log_hparams, fit_error, upload_file --------------------------------
def _tiny_trainer(classification_arrays, make_tiny_classifier, destination, **kwargs):
    import optax

    from composerjax import ArrayLoader, Trainer

    x, y = classification_arrays
    return Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ba",
                   optimizers=optax.sgd(0.1), loggers=[destination], progress_bar=False, run_summary=False, **kwargs)


@pytest.mark.parametrize("auto_log_hparams", [False, True])
def test_auto_log_hparams_logs_the_runs_settings_at_the_first_fit_start(classification_arrays, make_tiny_classifier,
                                                                      auto_log_hparams):
    memory = InMemoryLogger()
    trainer = _tiny_trainer(classification_arrays, make_tiny_classifier, memory, auto_log_hparams=auto_log_hparams,
                            run_name="hp-run")
    assert "run_name" not in memory.hyperparameters  # not before FIT_START
    trainer.fit()
    if auto_log_hparams:
        assert memory.hyperparameters["run_name"] == "hp-run"
        assert {k: memory.hyperparameters[k] for k in trainer.hparams} == trainer.hparams
    else:
        assert "run_name" not in memory.hyperparameters  # Composer's default: off
    with pytest.raises(ValueError, match="auto_log_hparams='yes'"):
        _tiny_trainer(classification_arrays, make_tiny_classifier, memory, auto_log_hparams="yes")


def test_destinations_hear_fit_error_and_get_verified_checkpoints(classification_arrays, make_tiny_classifier,
                                                                  tmp_path):
    from composerjax import Callback

    class Keeper(LoggerDestination):
        def __init__(self):
            self.errors, self.files = [], []

        def fit_error(self, state, logger, error):
            self.errors.append(type(error).__name__)

        def upload_file(self, state, remote_file_name, file_path, *, overwrite=False):
            self.files.append((remote_file_name, int(state.timestamp.batch), os.path.isdir(file_path)))

    class Explode(Callback):
        def batch_end(self, state, logger):
            if state.timestamp.batch == 3:
                raise RuntimeError("boom")

    keeper = Keeper()
    assert keeper.can_upload_files() and not InMemoryLogger().can_upload_files()
    trainer = _tiny_trainer(classification_arrays, make_tiny_classifier, keeper, save_folder=str(tmp_path),
                            save_interval="1ba", run_name="r")
    trainer.fit()
    # Each verified checkpoint once, under Composer's remote name, with the clock of its save; and the pointer.
    assert [f for f in keeper.files if not f[0].endswith(".symlink")] == [
        ("r/checkpoints/ep0-ba1", 1, True), ("r/checkpoints/ep0-ba2", 2, True)]
    assert [f for f in keeper.files if f[0].endswith(".symlink")] == [("r/checkpoints/latest.symlink", 1, False),
                                                                      ("r/checkpoints/latest.symlink", 2, False)]
    trainer.state.callbacks.append(Explode())
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(duration="2ba")
    assert keeper.errors == ["RuntimeError"]
