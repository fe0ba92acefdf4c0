"""ActivationMonitor: Composer's per-layer statistics from inside the step equal a plain-numpy recomputation."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, LoggerDestination, Time, Trainer
from composerjax.callbacks.activation_monitor import ActivationMonitor, activation_statistics, layer_activations
from composerjax.loggers.wandb_logger import WandBLogger


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(4, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


class MetricRecorder(LoggerDestination):
    def __init__(self) -> None:
        self.rows: dict[int, dict[str, float]] = {}

    def log_metrics(self, metrics, step=None):
        self.rows.setdefault(step, {}).update(metrics)


class CopyParamsAndBatch(Callback):
    """Host copies of the parameters and batch each step starts from (a test-only sync per batch)."""

    def __init__(self) -> None:
        self.inputs: dict[int, tuple] = {}

    def batch_start(self, state, logger):
        self.inputs[state.timestamp.batch.value + 1] = (jax.device_get(state.params), np.array(state.batch[0]))


def composer_statistics(a: np.ndarray) -> dict[str, float]:
    """Composer's formulas (activation_monitor.py), in numpy: each over the last axis, then the mean."""
    diffs = a - a.mean(-1, keepdims=True)
    kurtosis = (diffs ** 4).mean(-1) / ((diffs ** 2).mean(-1) ** 2)
    return {"l2_norm": float(np.linalg.norm(a, axis=-1).mean()), "average": float(a.mean()),
            "kurtosis": float(kurtosis.mean()), "max": float(a.max(-1).mean())}


def expected_statistics(params, x) -> dict[str, float]:
    hidden = x @ params["module"]["hidden"]["kernel"] + params["module"]["hidden"]["bias"]
    relu = np.maximum(hidden, 0)
    logits = relu @ params["module"]["out"]["kernel"] + params["module"]["out"]["bias"]
    arrays = {"module.hidden_input.0": x, "module.hidden_output.0": hidden, "module.out_input.0": relu,
              "module.out_output.0": logits}
    return {f"activations/{stat}/{name}": value for name, a in arrays.items()
            for stat, value in composer_statistics(a).items()}


def run(classification_arrays, monitor, loggers_extra=(), **trainer_kwargs):
    x, y = classification_arrays
    recorder, copier = MetricRecorder(), CopyParamsAndBatch()
    trainer = Trainer(ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2), ArrayLoader((x, y), batch_size=16),
                      max_duration="6ba", optimizers=optax.sgd(0.5), callbacks=[monitor, copier],
                      loggers=[recorder, *loggers_extra], progress_bar=False, run_summary=False, log_interval=2,
                      **trainer_kwargs)
    trainer.fit()
    return trainer, recorder, copier


def test_layer_statistics_equal_composers_formulas_every_interval(classification_arrays):
    trainer, recorder, copier = run(classification_arrays, ActivationMonitor(interval=2))
    assert sorted(recorder.rows) == [1, 2, 3, 4, 5, 6]
    logged = {step: {name: value for name, value in row.items() if "activations" in name}
              for step, row in recorder.rows.items()}
    # As Composer: the batches that start at a multiple of the interval (0, 2, 4 done) = batches 1, 3, 5.
    assert [step for step, row in logged.items() if row] == [1, 3, 5]
    for step in (1, 3, 5):
        params, x = copier.inputs[step]
        expected = {f"train/{name}": value for name, value in expected_statistics(params, x).items()}
        assert sorted(logged[step]) == sorted(expected)
        for name, value in expected.items():
            assert logged[step][name] == pytest.approx(value, rel=1e-4, abs=1e-5)
    assert trainer.compile_count == 1
    assert nnx.Linear.__call__.__name__ == "__call__" and not hasattr(nnx.Linear.__call__, "__wrapped__")


def test_composer_defaults_and_epoch_interval(classification_arrays):
    monitor = ActivationMonitor()
    assert (monitor.interval, monitor.ignore_module_types, monitor.only_log_wandb) == (Time(25, "ba"), (), True)
    x, y = classification_arrays
    recorder = MetricRecorder()
    Trainer(ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2), ArrayLoader((x, y), batch_size=16),
            max_duration="4ep", callbacks=[ActivationMonitor(interval="2ep")], loggers=[recorder],
            progress_bar=False, run_summary=False, log_interval=1).fit()
    # 4 batches per epoch: the first batch of epochs 0 and 2 (batches 1 and 9).
    assert [step for step, row in sorted(recorder.rows.items()) if any("activations" in k for k in row)] == [1, 9]


def test_microbatches_average_the_means(classification_arrays):
    _, recorder, copier = run(classification_arrays, ActivationMonitor(interval=1), device_train_microbatch_size=8)
    params, x = copier.inputs[3]
    expected = expected_statistics(params, x)
    assert recorder.rows[3]["train/activations/average/module.hidden_output.0"] == pytest.approx(
        expected["activations/average/module.hidden_output.0"], rel=1e-5)


def test_only_log_wandb_sends_the_statistics_to_wandb_alone(classification_arrays):
    class RecordingWandB(WandBLogger):
        """A WandBLogger that records what it is given and never starts a W&B run."""

        def __init__(self) -> None:
            super().__init__()
            self.rows: dict[int, dict[str, float]] = {}

        def init(self, state, logger):
            pass

        def post_close(self):
            pass

        def log_hyperparameters(self, hyperparameters):
            pass

        def log_metrics(self, metrics, step=None):
            self.rows.setdefault(step, {}).update(metrics)

    wandb_logger = RecordingWandB()
    _, recorder, copier = run(classification_arrays, ActivationMonitor(interval=4), loggers_extra=[wandb_logger])
    assert not any("activations" in name for row in recorder.rows.values() for name in row)
    activations = {step: {k: v for k, v in row.items() if k.startswith("activations/")}
                   for step, row in wandb_logger.rows.items()}
    assert [step for step, row in activations.items() if row] == [1, 5]
    params, x = copier.inputs[5]
    for name, value in expected_statistics(params, x).items():
        assert activations[5][name] == pytest.approx(value, rel=1e-4, abs=1e-5)


def test_ignored_module_types_are_left_out(classification_arrays):
    class Output(nnx.Linear):
        pass

    x, y = classification_arrays
    model = ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2)
    model.module.out = Output(8, 2, rngs=nnx.Rngs(1))
    recorder = MetricRecorder()
    Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration="2ba",
            callbacks=[ActivationMonitor(1, (Output,))], loggers=[recorder], progress_bar=False,
            run_summary=False).fit()
    assert {name.split("/")[3] for name in recorder.rows[2] if "activations" in name} == {
        "module.hidden_input.0", "module.hidden_output.0"}
    assert "__call__" not in Output.__dict__
    # Composer's meaning of strings: module paths that contain them.
    recorder = MetricRecorder()
    Trainer(ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2), ArrayLoader((x, y), batch_size=16),
            max_duration="2ba", callbacks=[ActivationMonitor(1, ["hid"])], loggers=[recorder], progress_bar=False,
            run_summary=False).fit()
    assert {name.split("/")[3] for name in recorder.rows[2] if "activations" in name} == {
        "module.out_input.0", "module.out_output.0"}


def test_activation_statistics_and_names_follow_composer():
    a = np.array([[1.0, -3.0, 0.5], [2.0, 2.5, -1.0]], np.float32)
    stats = {k: float(v) for k, v in activation_statistics(a).items()}
    assert stats == pytest.approx(composer_statistics(a.astype(np.float64)), rel=1e-6)
    arrays = layer_activations("m.fc", (a, [a, np.ones(2, np.int32)], None), (a, a))
    assert sorted(arrays) == ["m.fc_0_input.1", "m.fc_input.0", "m.fc_output.0", "m.fc_output.1"]


def test_invalid_ignore_module_types_name_the_argument():
    with pytest.raises(ValueError, match=r"ignore_module_types\[0\]=<class 'int'>"):
        ActivationMonitor(ignore_module_types=[int])
    with pytest.raises(ValueError, match=r"interval='3sp'"):
        ActivationMonitor(interval="3sp")


class ScannedCell(nnx.Module):
    """A layer called inside the model's own lax.scan: its outputs belong to the scan's trace."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.inp = nnx.Linear(4, 4, rngs=rngs)
        self.cell = nnx.Linear(4, 4, rngs=rngs)
        self.out = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        state, _ = jax.lax.scan(lambda h, _: (jax.nn.tanh(self.cell(h)), None), self.inp(x), None, length=3)
        return self.out(state)


def test_layers_inside_a_scan_of_the_model_are_skipped_with_a_warning(classification_arrays, caplog):
    x, y = classification_arrays
    recorder = MetricRecorder()
    Trainer(ComposerClassifier(ScannedCell(nnx.Rngs(0)), num_classes=2), ArrayLoader((x, y), batch_size=16),
            max_duration="2ba", callbacks=[ActivationMonitor(1)], loggers=[recorder], progress_bar=False,
            run_summary=False).fit()
    layers = {name.split("/")[3].split("_")[0] for name in recorder.rows[2] if "activations" in name}
    assert layers == {"module.inp", "module.out"}
    assert "no statistics for module.cell" in caplog.text
