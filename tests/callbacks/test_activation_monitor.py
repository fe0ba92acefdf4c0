"""ActivationMonitor: per-layer statistics from inside the step equal a plain-jax recomputation."""

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, LoggerDestination, Trainer
from composerjax.callbacks.activation_monitor import ActivationMonitor, activation_statistics


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


def expected_statistics(params, x) -> dict[str, dict[str, float]]:
    hidden = x @ params["module"]["hidden"]["kernel"] + params["module"]["hidden"]["bias"]
    logits = np.maximum(hidden, 0) @ params["module"]["out"]["kernel"] + params["module"]["out"]["bias"]
    return {path: {"mean": float(a.mean()), "max_abs": float(np.abs(a).max()), "l2_norm": float(np.sqrt((a**2).sum()))}
            for path, a in (("module/hidden", hidden), ("module/out", logits))}


def run(classification_arrays, monitor, **trainer_kwargs):
    x, y = classification_arrays
    recorder, copier = MetricRecorder(), CopyParamsAndBatch()
    trainer = Trainer(ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2), ArrayLoader((x, y), batch_size=16),
                      max_duration="6ba", optimizers=optax.sgd(0.5), callbacks=[monitor, copier],
                      loggers=[recorder], progress_bar=False, run_summary=False, log_interval=2, **trainer_kwargs)
    trainer.fit()
    return trainer, recorder, copier


def test_layer_statistics_equal_a_plain_recomputation_at_every_step(classification_arrays):
    trainer, recorder, copier = run(classification_arrays, ActivationMonitor())
    assert sorted(recorder.rows) == [1, 2, 3, 4, 5, 6]
    names = sorted(name for name in recorder.rows[1] if name.startswith("train/activations/"))
    assert names == [f"train/activations/module/{layer}/{stat}" for layer in ("hidden", "out")
                     for stat in ("l2_norm", "max_abs", "mean")]
    for step, row in recorder.rows.items():
        params, x = copier.inputs[step]
        for path, stats in expected_statistics(params, x).items():
            for stat, value in stats.items():
                assert row[f"train/activations/{path}/{stat}"] == pytest.approx(value, rel=1e-5, abs=1e-6)
    assert trainer.compile_count == 1
    assert nnx.Linear.__call__.__name__ == "__call__" and not hasattr(nnx.Linear.__call__, "__wrapped__")


def test_microbatches_average_the_means(classification_arrays):
    _, recorder, copier = run(classification_arrays, ActivationMonitor(), device_train_microbatch_size=8)
    params, x = copier.inputs[3]
    expected = expected_statistics(params, x)
    assert recorder.rows[3]["train/activations/module/hidden/mean"] == pytest.approx(
        expected["module/hidden"]["mean"], rel=1e-5)


def test_ignored_module_types_are_left_out(classification_arrays):
    class Output(nnx.Linear):
        pass

    x, y = classification_arrays
    model = ComposerClassifier(MLP(nnx.Rngs(0)), num_classes=2)
    model.module.out = Output(8, 2, rngs=nnx.Rngs(1))
    recorder = MetricRecorder()
    Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration="2ba", callbacks=[ActivationMonitor((Output,))],
            loggers=[recorder], progress_bar=False, run_summary=False).fit()
    assert sorted(name for name in recorder.rows[2] if "activations" in name) == [
        "train/activations/module/hidden/l2_norm", "train/activations/module/hidden/max_abs",
        "train/activations/module/hidden/mean"]
    assert "__call__" not in Output.__dict__


def test_activation_statistics_pool_every_call_and_skip_integer_leaves():
    stats = activation_statistics([np.array([1.0, -3.0]), (np.array([2.0]), np.array([7], np.int32))])
    assert {k: float(v) for k, v in stats.items()} == pytest.approx(
        {"mean": 0.0, "max_abs": 3.0, "l2_norm": np.sqrt(14.0)})
    with pytest.raises(ValueError, match="no floating-point arrays"):
        activation_statistics([np.array([1], np.int32)])


def test_invalid_ignore_module_types_name_the_argument():
    with pytest.raises(ValueError, match=r"ignore_module_types\[0\]=<class 'int'>"):
        ActivationMonitor(ignore_module_types=[int])


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
            max_duration="2ba", callbacks=[ActivationMonitor()], loggers=[recorder], progress_bar=False,
            run_summary=False).fit()
    layers = {name.split("/")[3] for name in recorder.rows[2] if "activations" in name}
    assert layers == {"inp", "out"}
    assert "no statistics for module/cell" in caplog.text
