"""The compiled train step: traced algorithms against plain-JAX references, plans and compiles."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, Callback, ComposerClassifier, Event, Trainer

LR = 0.1


def regression_data(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32) + 0.1).astype(np.float32)
    return x, y


def mse(model: nnx.Module, batch: tuple) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


def make_trainer(algorithms=(), callbacks=(), batch_size=16, shuffle=False, optimizer=None, **kwargs) -> Trainer:
    x, y = regression_data()
    return Trainer(
        nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
        ArrayLoader((x, y), batch_size=batch_size, shuffle=shuffle, drop_last=kwargs.pop("drop_last", True)),
        max_duration=kwargs.pop("max_duration", "1ba"),
        optimizers=optimizer or optax.sgd(LR),
        loss_fn=mse,
        algorithms=list(algorithms),
        callbacks=list(callbacks),
        progress_bar=False,
        **kwargs,
    )


def reference_step(params: dict, batch: tuple, loss_scale: float = 1.0, grad_scale: float = 1.0,
                   input_scale: float = 1.0) -> dict:
    """One SGD step on a linear model written with plain jax."""

    def loss(p: dict) -> jax.Array:
        x = batch[0] * input_scale
        return loss_scale * jnp.mean((x @ p["kernel"] + p["bias"] - batch[1]) ** 2)

    grads = jax.grad(loss)(params)
    return jax.tree.map(lambda p, g: p - LR * grad_scale * g, params, grads)


def initial_params() -> dict:
    linear = nnx.Linear(4, 1, rngs=nnx.Rngs(0))
    return {"kernel": linear.kernel[...], "bias": linear.bias[...]}


def first_batch() -> tuple:
    x, y = regression_data()
    return x[:16], y[:16]


class ScaleLoss(Algorithm):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def match(self, event, state):
        return event == Event.AFTER_LOSS

    def apply(self, event, state, logger):
        state.loss = state.loss * self.factor


class ScaleGrads(Algorithm):
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def match(self, event, state):
        return event == Event.AFTER_BACKWARD

    def apply(self, event, state, logger):
        state.grads = jax.tree.map(lambda g: g * self.factor, state.grads)


class ScaleInputs(Algorithm):
    def __init__(self, factor: float, event: Event = Event.BEFORE_FORWARD) -> None:
        self.factor, self.event = factor, event

    def match(self, event, state):
        return event == self.event

    def apply(self, event, state, logger):
        state.batch_set_item(0, state.batch_get_item(0) * self.factor)


def trained_params(trainer: Trainer) -> dict:
    trainer.fit()
    return jax.device_get(trainer.state.train_state.params)


@pytest.mark.parametrize(
    ("algorithm", "reference_kwargs"),
    [
        (ScaleLoss(3.0), {"loss_scale": 3.0}),
        (ScaleGrads(0.5), {"grad_scale": 0.5}),
        (ScaleInputs(2.0), {"input_scale": 2.0}),
        (ScaleInputs(2.0, Event.BEFORE_TRAIN_BATCH), {"input_scale": 2.0}),
    ],
    ids=["loss", "grads", "inputs-before-forward", "inputs-before-train-batch"],
)
def test_traced_algorithm_changes_the_update_exactly_like_plain_jax(algorithm, reference_kwargs):
    params = trained_params(make_trainer([algorithm]))
    expected = reference_step(initial_params(), first_batch(), **reference_kwargs)
    np.testing.assert_allclose(params["kernel"], expected["kernel"], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(params["bias"], expected["bias"], rtol=1e-6, atol=1e-7)
    # and differs from the unmodified update
    baseline = reference_step(initial_params(), first_batch())
    assert not np.allclose(params["kernel"], baseline["kernel"])


def test_without_algorithms_the_step_equals_plain_sgd():
    params = trained_params(make_trainer())
    expected = reference_step(initial_params(), first_batch())
    np.testing.assert_allclose(params["kernel"], expected["kernel"], rtol=1e-6, atol=1e-7)


class RunningMean(Algorithm):
    """Device state across steps: a running mean of the kernel, updated after the optimizer."""

    def init_state(self, state):
        return {"mean": jnp.zeros((4, 1)), "count": jnp.zeros((), jnp.int32)}

    def match(self, event, state):
        return event == Event.AFTER_OPTIMIZER_STEP

    def apply(self, event, state, logger):
        own = state.algorithm_state[self.name]
        count = own["count"] + 1
        mean = own["mean"] + (state.params["kernel"] - own["mean"]) / count
        state.algorithm_state[self.name] = {"mean": mean, "count": count}


def test_algorithm_state_is_carried_across_steps_and_equals_the_reference():
    trainer = make_trainer([RunningMean()], max_duration="4ba")
    trainer.fit()
    own = jax.device_get(trainer.state.train_state.algorithm_state["RunningMean"])
    params, kernels = initial_params(), []
    x, y = regression_data()
    for i in range(4):
        params = reference_step(params, (x[16 * i: 16 * (i + 1)], y[16 * i: 16 * (i + 1)]))
        kernels.append(params["kernel"])
    assert int(own["count"]) == 4
    np.testing.assert_allclose(own["mean"], np.mean(kernels, axis=0), rtol=1e-5)


class RecordClock(Callback):
    """Callbacks may add arrays to step_metrics at traced events."""

    def after_train_batch(self, state, logger):
        state.step_metrics["step"] = state.step
        state.step_metrics["progress"] = state.progress
        state.step_metrics["bits"] = jax.random.bits(state.step_rng, (), jnp.uint32)


def test_step_progress_and_step_rng_are_traced_per_step():
    seen = []

    class Collect(Callback):
        def batch_end(self, state, logger):
            seen.append(state.step_metrics)  # device arrays; fetched once below

    trainer = make_trainer(callbacks=[RecordClock(), Collect()], max_duration="8ba")
    trainer.fit()
    fetched = jax.device_get(seen)
    assert [int(m["step"]) for m in fetched] == list(range(8))
    np.testing.assert_allclose([m["progress"] for m in fetched], np.arange(8) / 8)
    bits = [int(m["bits"]) for m in fetched]
    assert len(set(bits)) == 8  # a fresh key every step
    assert trainer.compile_count == 1
    # Same seed, same keys: the step rng is a pure function of (seed, step).
    seen.clear()
    make_trainer(callbacks=[RecordClock(), Collect()], max_duration="8ba").fit()
    assert [int(m["bits"]) for m in jax.device_get(seen)] == bits


class FromBatch(Algorithm):
    """Matches only from a given batch on: the plan changes once."""

    def __init__(self, start: int) -> None:
        self.start = start

    def match(self, event, state):
        return event == Event.AFTER_LOSS and state.timestamp.batch >= self.start

    def apply(self, event, state, logger):
        state.loss = state.loss * 0.5


def test_compile_count_stays_at_one_with_a_fixed_plan():
    trainer = make_trainer([ScaleLoss(2.0)], batch_size=4, max_duration="50ba")
    trainer.fit()
    assert trainer.state.timestamp.batch == 50
    assert trainer.compile_count == 1


def test_compile_count_rises_only_when_the_plan_or_shapes_change():
    trainer = make_trainer([FromBatch(10)], batch_size=4, max_duration="50ba")
    trainer.fit()
    assert trainer.compile_count == 2  # before and after batch 10
    traced = [t for t in trainer.engine.trace_log if t.traced]
    assert [t.batch for t in traced] == list(range(10, 50))
    assert {t.key for t in traced} == {"FromBatch/AFTER_LOSS"}

    uneven = make_trainer(batch_size=24, drop_last=False, max_duration="6ba")  # 64 = 24 + 24 + 16
    uneven.fit()
    assert uneven.compile_count == 2


def test_host_state_holds_no_tracers_after_traced_algorithms_ran():
    trainer = make_trainer([ScaleLoss(2.0), ScaleInputs(2.0), RunningMean()], callbacks=[RecordClock()],
                           max_duration="3ba")
    trainer.fit()
    state = trainer.state
    leaves = jax.tree.leaves((state.batch, state.loss, state.step_metrics, state.train_state, state.algorithm_state))
    assert leaves and not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)
    assert isinstance(state.batch[0], np.ndarray)  # the host batch, not the scaled traced one
    assert state.outputs is None and state.grads is None
    float(state.loss)  # concrete


class DictBatchTargets(Algorithm):
    def match(self, event, state):
        return event == Event.BEFORE_LOSS

    def apply(self, event, state, logger):
        state.batch_set_item("y", state.batch_get_item("y") + 1.0)


def test_batch_items_of_dict_batches_are_replaced_in_step():
    x, y = regression_data()
    trainer = Trainer(
        nnx.Linear(4, 1, rngs=nnx.Rngs(0)),
        ArrayLoader({"x": x, "y": y}, batch_size=16, shuffle=False),
        max_duration="1ba",
        optimizers=optax.sgd(LR),
        loss_fn=lambda model, batch: jnp.mean((model(batch["x"]) - batch["y"]) ** 2),
        algorithms=[DictBatchTargets()],
        progress_bar=False,
    )
    params = trained_params(trainer)
    expected = reference_step(initial_params(), (x[:16], y[:16] + 1.0))
    np.testing.assert_allclose(params["kernel"], expected["kernel"], rtol=1e-6)


class MicrobatchSize(Callback):
    def before_forward(self, state, logger):
        state.step_metrics["microbatch"] = jnp.asarray(state.batch[0].shape[0])


def test_microbatches_give_the_full_batch_update():
    # A per-sample model (no batch norm): the mean loss over microbatches is the full-batch mean.
    x = np.random.default_rng(1).normal(size=(96, 8)).astype(np.float32)
    y = np.random.default_rng(2).integers(0, 10, size=96).astype(np.int32)

    def run(microbatch):
        rngs = nnx.Rngs(0)
        mlp = nnx.Sequential(nnx.Linear(8, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 10, rngs=rngs))
        model = ComposerClassifier(mlp, 10)
        trainer = Trainer(model, ArrayLoader((x, y), batch_size=32, shuffle=False), "3ba",
                          optax.adam(1e-2), device_train_microbatch_size=microbatch,
                          callbacks=[MicrobatchSize()], progress_bar=False)
        trainer.fit()
        return trainer

    full, micro = run(None), run(8)
    assert int(micro.state.step_metrics["microbatch"]) == 8
    assert int(full.state.step_metrics["microbatch"]) == 32
    np.testing.assert_allclose(float(micro.state.loss), float(full.state.loss), rtol=1e-5)
    full_params, micro_params = full.state.train_state.params, micro.state.train_state.params
    for a, b in zip(jax.tree.leaves(full_params), jax.tree.leaves(micro_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_microbatch_size_must_divide_the_batch():
    trainer = make_trainer(device_train_microbatch_size=5)
    with pytest.raises(ValueError, match="device_train_microbatch_size=5"):
        trainer.fit()


def test_eval_and_predict_steps_are_compiled_once_and_cached():
    x, y = regression_data()
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 3, rngs=nnx.Rngs(0)), 3),
                      ArrayLoader((x, (y[:, 0] > 0).astype(np.int32)), 16), "1ep", optax.sgd(LR),
                      progress_bar=False)
    loader = ArrayLoader((x, (y[:, 0] > 0).astype(np.int32)), 16, shuffle=False)
    trainer.fit()
    assert trainer.compile_count == 1
    trainer.eval(loader)
    trainer.eval(loader)
    assert trainer.compile_count == 2
    trainer.predict(loader)
    trainer.predict(loader)
    assert trainer.compile_count == 3
