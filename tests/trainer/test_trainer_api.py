"""Tests for the Trainer's public API: predict, fit durations, loss_fn models, model sync, loggers, precision."""

import io
import json
import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, Callback, Event, Time, TimeUnit, Trainer
from composerjax.loggers import FileLogger, InMemoryLogger, ProgressBarLogger

LOSS = "loss/train/total"


def linear_params(classifier) -> dict[str, np.ndarray]:
    """Host copies of a ComposerClassifier(nnx.Linear)'s kernel and bias."""
    return {"kernel": np.array(classifier.module.kernel[...]), "bias": np.array(classifier.module.bias[...])}


def logged_losses(destination: InMemoryLogger) -> list[float]:
    return [value for _, value in destination.data[LOSS]]


# -- predict and the trained model -------------------------------------------------------------
class ReadModelAtBatchEnd(Callback):
    """Copy the parameters ``state.model`` holds at every BATCH_END."""

    def __init__(self) -> None:
        self.params: dict[int, dict[str, np.ndarray]] = {}

    def batch_end(self, state, logger):
        self.params[state.timestamp.batch.value] = linear_params(state.model)


@pytest.fixture(scope="module")
def adam_run(classification_arrays, make_tiny_classifier):
    """2 epochs of adam on the tiny classifier, reading ``state.model`` at every BATCH_END."""
    x, y = classification_arrays
    model = make_tiny_classifier()
    initial = linear_params(model)
    reader = ReadModelAtBatchEnd()
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration="2ep", optimizers=optax.adam(0.05),
                      callbacks=[reader], progress_bar=False)
    trainer.fit()
    return SimpleNamespace(trainer=trainer, initial=initial, reader=reader, compiles_after_fit=trainer.compile_count)


def test_predict_returns_one_host_output_per_batch_equal_to_the_model(adam_run, classification_arrays):
    x, y = classification_arrays
    loader = ArrayLoader((x[:56], y[:56]), batch_size=16, shuffle=False, drop_last=False)
    outputs = adam_run.trainer.predict(loader)
    assert [type(o) for o in outputs] == [np.ndarray] * 4
    assert [o.shape for o in outputs] == [(16, 2), (16, 2), (16, 2), (8, 2)]

    model = adam_run.trainer.state.model
    model.eval()
    for index, output in enumerate(outputs):
        rows = slice(16 * index, min(16 * (index + 1), 56))
        batch = (x[rows], y[rows])
        np.testing.assert_allclose(output, np.asarray(model.forward(batch)), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(output, np.asarray(model.module(batch[0])), rtol=1e-6, atol=1e-6)


def test_state_model_holds_the_trained_parameters_after_fit(adam_run):
    state = adam_run.trainer.state
    trained = linear_params(state.model)
    device = jax.device_get(state.train_state.params)
    np.testing.assert_array_equal(trained["kernel"], device["module"]["kernel"])
    np.testing.assert_array_equal(trained["bias"], device["module"]["bias"])
    assert not np.allclose(trained["kernel"], adam_run.initial["kernel"])
    assert not np.allclose(trained["bias"], adam_run.initial["bias"])
    np.testing.assert_array_equal(adam_run.reader.params[8]["kernel"], trained["kernel"])


def test_reading_state_model_mid_fit_sees_that_batch_and_does_not_disturb_training(
    adam_run, classification_arrays, make_tiny_classifier
):
    # Reading state.model every batch re-uploads it; it must neither retrace nor reset adam's moments.
    assert adam_run.compiles_after_fit == 1
    assert sorted(adam_run.reader.params) == list(range(1, 9))
    x, y = classification_arrays
    twin = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ba",
                   optimizers=optax.adam(0.05), progress_bar=False)
    twin.fit()
    at_two = linear_params(twin.state.model)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(adam_run.reader.params[2][name], at_two[name], rtol=1e-6, atol=1e-7)
        assert not np.allclose(adam_run.reader.params[1][name], at_two[name])
    twin.fit("6ba")
    at_eight = linear_params(twin.state.model)
    for name in ("kernel", "bias"):
        np.testing.assert_allclose(adam_run.reader.params[8][name], at_eight[name], rtol=1e-6, atol=1e-7)


# -- fit durations -------------------------------------------------------------------------------
def tiny_trainer(x, y, model, max_duration, **kwargs):
    kwargs.setdefault("optimizers", optax.sgd(0.1))
    return Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration=max_duration, progress_bar=False,
                   **kwargs)


def test_fit_with_a_duration_trains_that_much_more(classification_arrays, make_tiny_classifier):
    trainer = tiny_trainer(*classification_arrays, make_tiny_classifier(), "1ep")
    trainer.fit()
    clock = trainer.state.timestamp
    assert (clock.epoch, clock.batch, clock.batch_in_epoch) == (1, 4, 0)
    trainer.fit("2ba")
    clock = trainer.state.timestamp
    assert (clock.epoch, clock.batch, clock.batch_in_epoch) == (1, 6, 2)
    assert trainer.state.max_duration == Time(6, TimeUnit.BATCH)
    # Finishing the epoch from mid-epoch takes only its 2 remaining batches.
    trainer.fit("1ep")
    clock = trainer.state.timestamp
    assert (clock.epoch, clock.batch, clock.batch_in_epoch, clock.sample) == (2, 8, 0, 128)


def test_max_duration_in_batches_stops_mid_epoch(classification_arrays, make_tiny_classifier):
    trainer = tiny_trainer(*classification_arrays, make_tiny_classifier(), "6ba")
    trainer.fit()
    clock = trainer.state.timestamp
    assert (clock.epoch, clock.batch, clock.batch_in_epoch, clock.sample) == (1, 6, 2, 96)
    assert int(trainer.state.train_state.clock[0]) == 6  # optimizer steps taken on the device


def test_max_duration_in_samples(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    x96, y96 = np.concatenate([x, x[:32]]), np.concatenate([y, y[:32]])  # 6 batches per epoch
    trainer = tiny_trainer(x96, y96, make_tiny_classifier(), "64sp")
    trainer.fit()
    clock = trainer.state.timestamp
    assert (clock.epoch, clock.batch, clock.batch_in_epoch, clock.sample) == (0, 4, 4, 64)
    assert jax.device_get(trainer.state.train_state.clock).tolist() == [4, 4]  # [steps, steps in max_duration]


class StopAtBatch(Callback):
    def __init__(self, batch: int) -> None:
        self.batch = batch

    def batch_end(self, state, logger):
        if state.timestamp.batch == self.batch:
            state.stop_training()


@pytest.mark.parametrize("max_duration", ["2ep", "10ba"])
def test_stop_training_at_batch_end_ends_after_that_batch(classification_arrays, make_tiny_classifier,
                                                          max_duration):
    trainer = tiny_trainer(*classification_arrays, make_tiny_classifier(), max_duration, callbacks=[StopAtBatch(3)])
    trainer.fit()
    assert trainer.state.timestamp.batch == 3
    assert int(trainer.state.train_state.clock[0]) == 3
    assert trainer.state.max_duration == Time(3, TimeUnit.BATCH)  # recorded exactly, mid-epoch too
    trainer.fit("2ba")  # and training goes on from there
    assert trainer.state.timestamp.batch == 5


# -- plain nnx.Module with loss_fn ----------------------------------------------------------------
@pytest.fixture(scope="module")
def regression_arrays():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]]) + 0.7 + 0.01 * rng.normal(size=(64, 1))).astype(np.float32)
    return x, y


def mse(model, batch):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


def mse_with_metrics(model, batch, rng, step):
    x, y = batch
    error = model(x) - y
    metrics = {"step": step.astype(jnp.float32), "abs_error": jnp.mean(jnp.abs(error)),
               "noise": jax.random.uniform(rng)}
    return jnp.mean(error**2), metrics


def stacked(linear: nnx.Linear) -> np.ndarray:
    """Kernel and bias of an nnx.Linear(4, 1) as one (5,) vector."""
    return np.concatenate([np.asarray(linear.kernel[...])[:, 0], np.asarray(linear.bias[...])])


@pytest.fixture(scope="module", params=[mse, mse_with_metrics], ids=["fn(model,batch)", "fn(model,batch,rng,step)"])
def regression_run(request, regression_arrays):
    x, y = regression_arrays
    model = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    initial = stacked(model)
    memory = InMemoryLogger()
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration="3ep", optimizers=optax.sgd(0.1),
                      loss_fn=request.param, loggers=[memory], log_interval=2, progress_bar=False)
    trainer.fit()
    design = np.concatenate([x, np.ones((64, 1), np.float32)], axis=1).astype(np.float64)
    least_squares = np.linalg.lstsq(design, y.astype(np.float64), rcond=None)[0][:, 0]
    return SimpleNamespace(trainer=trainer, memory=memory, initial=initial, least_squares=least_squares,
                           loss_fn=request.param, x=x, y=y)


def test_loss_fn_model_trains_toward_least_squares(regression_run):
    losses = logged_losses(regression_run.memory)
    assert [step for step, _ in regression_run.memory.data[LOSS]] == list(range(1, 13))
    assert np.all(np.isfinite(losses))
    assert np.mean(losses[8:]) < 0.2 * np.mean(losses[:4])
    trained = stacked(regression_run.trainer.state.model)
    start_gap = np.linalg.norm(regression_run.initial - regression_run.least_squares)
    assert np.linalg.norm(trained - regression_run.least_squares) < 0.5 * start_gap


def test_loss_fn_metrics_reach_step_metrics_and_loggers(regression_run):
    state, data = regression_run.trainer.state, regression_run.memory.data
    if regression_run.loss_fn is mse:
        assert state.step_metrics == {}
        assert [name for name in data if name.startswith("train/")] == []
        return
    assert set(state.step_metrics) == {"step", "abs_error", "noise"}
    assert all(isinstance(value, jax.Array) for value in state.step_metrics.values())
    assert float(state.step_metrics["step"]) == 11.0  # steps count from 0: the 12th batch is step 11
    assert data["train/step"] == [(batch, float(batch - 1)) for batch in range(1, 13)]
    assert [step for step, _ in data["train/abs_error"]] == list(range(1, 13))
    noise = [value for _, value in data["train/noise"]]
    assert len(set(noise)) == 12 and all(0.0 <= value < 1.0 for value in noise)  # a fresh rng every step


def test_loss_fn_model_predict_calls_the_module(regression_run):
    x, y = regression_run.x, regression_run.y
    outputs = regression_run.trainer.predict(ArrayLoader((x, y), batch_size=32, shuffle=False))
    model = regression_run.trainer.state.model
    model.eval()
    np.testing.assert_allclose(np.concatenate(outputs), np.asarray(model(x)), rtol=1e-6, atol=1e-6)


def test_at_eval_loss_fn_gets_step_none_so_a_warmed_up_term_can_count_in_full(regression_arrays):
    # A VAE-style loss: a penalty whose weight warms up with the step in training, in full at eval.
    x, y = regression_arrays
    seen = []

    def loss_with_warmed_up_penalty(model, batch, rng, step):
        seen.append("eval" if step is None else type(step).__name__)
        error = jnp.mean((model(batch[0]) - batch[1]) ** 2)
        weight = 1.0 if step is None else jnp.minimum(1.0, step / 100.0)
        return error + weight * 10.0, {"penalty_weight": jnp.asarray(weight, jnp.float32)}

    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="2ba",
                      optimizers=optax.sgd(0.0), loss_fn=loss_with_warmed_up_penalty, progress_bar=False,
                      run_summary=False)
    trainer.fit()
    results = trainer.eval(ArrayLoader((x, y), batch_size=64, shuffle=False))
    model = trainer.state.model
    expected_error = float(jnp.mean((model(jnp.asarray(x)) - jnp.asarray(y)) ** 2))
    assert results["penalty_weight"] == 1.0
    np.testing.assert_allclose(results["loss"], expected_error + 10.0, rtol=1e-5)
    assert "eval" in seen and seen[0] != "eval"  # traced with a step array in training, None at eval
    trainer.close()


def test_a_loss_fn_doing_arithmetic_on_step_at_eval_is_told_step_is_none(regression_arrays):
    x, y = regression_arrays

    def annealed(model, batch, rng, step):
        return jnp.mean((model(batch[0]) - batch[1]) ** 2) * jnp.minimum(1.0, step / 100)

    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="1ba",
                      loss_fn=annealed, progress_bar=False, run_summary=False)
    trainer.fit()
    with pytest.raises(TypeError, match=r"loss_fn='annealed' failed at eval, where it is called with step=None \(no "
                                        r"optimizer step is taken\): unsupported operand .*NoneType.*Branch on "
                                        r"`step is None` for the eval loss"):
        trainer.eval(ArrayLoader((x, y), batch_size=64, shuffle=False))
    trainer.close()


def test_loss_fn_with_three_arguments_is_rejected(regression_arrays):
    def three(model, batch, rng):
        return mse(model, batch)

    with pytest.raises(ValueError, match="loss_fn"):
        Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader(regression_arrays, batch_size=16), "1ep",
                loss_fn=three, progress_bar=False)


def test_plain_module_without_loss_fn_is_rejected(regression_arrays):
    with pytest.raises(TypeError, match="loss_fn"):
        Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader(regression_arrays, batch_size=16), "1ep",
                progress_bar=False)


# -- host algorithms changing the model ----------------------------------------------------------
class ZeroParamsWithUpdate(Algorithm):
    def match(self, event, state):
        return event is Event.FIT_START

    def apply(self, event, state, logger):
        model = state.model
        nnx.update(model, jax.tree.map(lambda p: p * 0, nnx.state(model, nnx.Param)))
        state.update_model()  # the one documented way to write the model from host code


class ZeroParamsByAssignment(ZeroParamsWithUpdate):
    def apply(self, event, state, logger):
        state.model.module.kernel[...] = jnp.zeros((4, 2))
        state.model.module.bias[...] = jnp.zeros((2,))
        state.update_model()


@pytest.mark.parametrize("algorithm", [ZeroParamsWithUpdate(), ZeroParamsByAssignment()], ids=lambda a: a.name)
def test_host_algorithm_at_fit_start_changes_the_params_the_step_starts_from(
    classification_arrays, make_tiny_classifier, algorithm
):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16, shuffle=False), max_duration="1ba",
                      optimizers=optax.sgd(0.5), algorithms=[algorithm], loggers=[memory], log_interval=1,
                      progress_bar=False)
    trainer.fit()
    # From zero params the logits are 0: p = 1/2 per class, loss = ln 2, grad = x^T (p - onehot) / n.
    xb, yb = x[:16].astype(np.float64), y[:16]
    residual = 0.5 - np.eye(2)[yb]
    expected_kernel = -0.5 * xb.T @ residual / 16
    expected_bias = -0.5 * residual.mean(axis=0)
    assert memory.data[LOSS] == [(1, pytest.approx(np.log(2.0), rel=1e-6))]
    trained = linear_params(trainer.state.model)
    np.testing.assert_allclose(trained["kernel"], expected_kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], expected_bias, rtol=1e-5, atol=1e-6)
    assert [trace.name for trace in trainer.engine.trace_log] == [type(algorithm).__name__]


# -- validation ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"max_duration": "10epochs"}, ValueError, ["max_duration", "10epochs"]),
        ({"eval_interval": "3 weeks"}, ValueError, ["eval_interval"]),
        ({"precision": "fp17"}, ValueError, ["precision", "'amp_bf16'", "'bf16'", "'fp32'"]),
        ({"log_interval": 0}, ValueError, ["log_interval"]),
        ({"device_train_microbatch_size": 0}, ValueError, ["device_train_microbatch_size"]),
        ({"optimizers": "adam"}, TypeError, ["optimizers"]),
        ({"algorithms": [object()]}, TypeError, ["algorithms"]),
        ({"callbacks": [object()]}, TypeError, ["callbacks"]),
    ],
    ids=lambda value: next(iter(value)) if isinstance(value, dict) else "",
)
def test_bad_arguments_raise_naming_the_field(classification_arrays, make_tiny_classifier, kwargs, error, words):
    arguments = {"max_duration": "1ep", "progress_bar": False, **kwargs}
    with pytest.raises(error) as raised:
        Trainer(make_tiny_classifier(), ArrayLoader(classification_arrays, batch_size=16), **arguments)
    for word in words:
        assert word in str(raised.value)


def test_bad_max_duration_lists_the_accepted_units(classification_arrays, make_tiny_classifier):
    with pytest.raises(ValueError, match="max_duration") as raised:
        Trainer(make_tiny_classifier(), ArrayLoader(classification_arrays, batch_size=16), "10epochs",
                progress_bar=False)
    for unit in TimeUnit:
        assert re.search(rf"\b{unit.value}\b", str(raised.value)), unit


@pytest.mark.parametrize("duration", ["0.5dur"])
def test_run_lengths_in_dur_are_refused(classification_arrays, make_tiny_classifier, duration):
    with pytest.raises(ValueError, match=rf"max_duration='{duration}': a run cannot be measured in"):
        Trainer(make_tiny_classifier(), ArrayLoader(classification_arrays, batch_size=16), duration,
                progress_bar=False)


def test_bad_fit_duration_names_duration(adam_run):
    with pytest.raises(ValueError, match="duration"):
        adam_run.trainer.fit("1fortnight")


# -- loggers -------------------------------------------------------------------------------------
class LoggedSoFar(Callback):
    """Count the losses the in-memory logger holds at each BATCH_END, EPOCH_END and FIT_END."""

    def __init__(self, memory: InMemoryLogger) -> None:
        self.memory = memory
        self.counts: list[tuple[str, int, int]] = []

    def _count(self, name, state):
        self.counts.append((name, state.timestamp.batch, len(self.memory.data.get(LOSS, []))))

    def batch_end(self, state, logger):
        self._count("batch_end", state)

    def epoch_end(self, state, logger):
        self._count("epoch_end", state)

    def fit_end(self, state, logger):
        self._count("fit_end", state)


@pytest.fixture(scope="module")
def logged_run(classification_arrays, make_tiny_classifier, tmp_path_factory):
    """10 batches (an epoch of 8, then 2) with log_interval=3 into memory, a JSONL file and a progress bar."""
    x, y = classification_arrays
    model = make_tiny_classifier()
    initial = linear_params(model)
    memory = InMemoryLogger()
    path = tmp_path_factory.mktemp("logs") / "metrics.jsonl"
    bar_stream = io.StringIO()
    probe = LoggedSoFar(memory)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=8), max_duration="10ba", optimizers=optax.sgd(0.3),
                      callbacks=[probe], loggers=[memory, FileLogger(str(path)),
                                                  ProgressBarLogger(stream=bar_stream, force=True)],
                      log_interval=3, progress_bar=False)
    trainer.fit()
    trainer.close()
    return SimpleNamespace(trainer=trainer, memory=memory, path=path, bar=bar_stream.getvalue(), probe=probe,
                           initial=initial, x=x, y=y)


def test_losses_arrive_one_interval_behind_and_all_at_epoch_end_and_fit_end(logged_run):
    assert [step for step, _ in logged_run.memory.data[LOSS]] == list(range(1, 11))
    # With 2 * log_interval pending, the oldest log_interval are fetched: steps 1-3 at batch 6.
    assert logged_run.probe.counts == [
        ("batch_end", 1, 0), ("batch_end", 2, 0), ("batch_end", 3, 0), ("batch_end", 4, 0),
        ("batch_end", 5, 0), ("batch_end", 6, 3), ("batch_end", 7, 3), ("batch_end", 8, 3),
        ("epoch_end", 8, 8),
        ("batch_end", 9, 8), ("batch_end", 10, 8),
        ("fit_end", 10, 10),
    ]


def test_logged_losses_match_an_independent_sgd_loop(logged_run):
    """Replay the 10 sgd steps in float64 numpy: softmax cross-entropy and its gradient by hand."""
    loader = ArrayLoader((logged_run.x, logged_run.y), batch_size=8)  # same seed: same batches
    batches = list(loader) + list(loader)
    kernel, bias = (logged_run.initial[name].astype(np.float64) for name in ("kernel", "bias"))
    expected = []
    for xb, yb in batches[:10]:
        logits = xb.astype(np.float64) @ kernel + bias
        shifted = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(shifted) / np.exp(shifted).sum(axis=1, keepdims=True)
        expected.append(-np.mean(np.log(probs[np.arange(len(yb)), yb])))
        grad_logits = (probs - np.eye(2)[yb]) / len(yb)
        kernel, bias = kernel - 0.3 * xb.T @ grad_logits, bias - 0.3 * grad_logits.sum(axis=0)
    losses = logged_losses(logged_run.memory)
    assert all(isinstance(value, float) and np.isfinite(value) for value in losses)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    trained = linear_params(logged_run.trainer.state.model)
    np.testing.assert_allclose(trained["kernel"], kernel, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(trained["bias"], bias, rtol=1e-5, atol=1e-6)


def test_file_logger_writes_readable_json_lines(logged_run):
    rows = [json.loads(line) for line in logged_run.path.read_text().splitlines()]
    train_rows = [row for row in rows if LOSS in row]
    assert [row["step"] for row in train_rows] == list(range(1, 11))
    assert [row[LOSS] for row in train_rows] == logged_losses(logged_run.memory)


def test_progress_bar_shows_epochs_and_the_latest_loss(logged_run):
    bar = logged_run.bar
    assert "epoch 0" in bar and "epoch 1" in bar
    assert "8/8" in bar and "2/8" in bar
    losses = logged_losses(logged_run.memory)
    assert f"loss={losses[7]:.4g}" in bar  # the loss flushed at the end of epoch 0
    assert f"loss={losses[9]:.4g}" in bar  # the last loss, shown when the bar closes at FIT_END


# -- precision -----------------------------------------------------------------------------------
class OutputDtype(Callback):
    def __init__(self) -> None:
        self.dtypes: list[jnp.dtype] = []

    def after_forward(self, state, logger):
        self.dtypes.append(state.outputs.dtype)


def test_amp_bf16_computes_in_bf16_and_keeps_fp32_weights(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    memory, probe = InMemoryLogger(), OutputDtype()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="3ep",
                      optimizers=optax.adam(0.05), precision="amp_bf16", callbacks=[probe], loggers=[memory],
                      log_interval=4, progress_bar=False)
    trainer.fit()
    assert probe.dtypes == [jnp.bfloat16]
    losses = logged_losses(memory)
    assert len(losses) == 12 and np.all(np.isfinite(losses))
    assert np.mean(losses[8:]) < np.mean(losses[:4])
    state = trainer.state
    float_leaves = jax.tree.leaves((state.train_state.params, state.train_state.opt_state))
    assert {leaf.dtype for leaf in float_leaves if jnp.issubdtype(leaf.dtype, jnp.floating)} == {np.dtype(np.float32)}
    assert state.model.module.kernel[...].dtype == jnp.float32
    assert state.loss.dtype == jnp.float32


def test_bf16_keeps_weights_and_optimizer_state_in_bf16(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    memory, probe = InMemoryLogger(), OutputDtype()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="3ep",
                      optimizers=optax.adam(0.05), precision="bf16", callbacks=[probe], loggers=[memory],
                      log_interval=4, progress_bar=False)
    trainer.fit()
    assert probe.dtypes == [jnp.bfloat16]
    losses = logged_losses(memory)
    assert len(losses) == 12 and np.mean(losses[8:]) < np.mean(losses[:4])
    state = trainer.state
    float_leaves = jax.tree.leaves((state.train_state.params, state.train_state.opt_state))
    assert {leaf.dtype for leaf in float_leaves if jnp.issubdtype(leaf.dtype, jnp.floating)} == {
        np.dtype(jnp.bfloat16)}
    assert state.model.module.kernel[...].dtype == jnp.bfloat16


def test_amp_fp16_is_refused_naming_the_alternative(make_tiny_classifier):
    with pytest.raises(ValueError, match=r"precision='amp_fp16': float16 training needs dynamic loss scaling.*"
                                         r"use 'amp_bf16'"):
        Trainer(make_tiny_classifier(), precision="amp_fp16")
