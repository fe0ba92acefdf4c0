"""EMA: the average against a numpy recursion, evaluation with the averaged weights, restored weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Event, Trainer
from composerjax.algorithms.ema import EMA, compute_ema, ema_decay, model_buffers

BATCH = 16  # 64 samples: 4 batches per epoch


def classification_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)


class ParamsAfterEachBatch(Callback):
    """Keeps the trained weights after every batch (one fetch per batch: fine in a test)."""

    def __init__(self) -> None:
        self.history: list[dict] = []

    def batch_end(self, state, logger):
        self.history.append(jax.device_get(state.params))


def make_trainer(algorithms: list, max_duration: str, callbacks: list = (), model=None) -> Trainer:
    x, y = classification_data()
    model = model or ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2)
    return Trainer(model, ArrayLoader((x, y), BATCH, shuffle=False), max_duration, optax.sgd(0.5),
                   algorithms=algorithms, callbacks=list(callbacks), progress_bar=False)


def numpy_ema(snapshots: list[dict], decay: float) -> dict:
    """The first update copies the weights, then ``ema = decay * ema + (1 - decay) * weights``."""
    ema = jax.tree.map(lambda w: np.asarray(w, np.float64), snapshots[0])
    for weights in snapshots[1:]:
        ema = jax.tree.map(lambda e, w: decay * e + (1 - decay) * w, ema, weights)
    return ema


def assert_tree_close(actual, expected, rtol=1e-6, atol=1e-6) -> None:
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)


def test_compute_ema_and_the_half_life_decay():
    new = compute_ema({"w": jnp.array([2.0, 4.0])}, {"w": jnp.array([0.0, 8.0])}, 0.25)
    np.testing.assert_allclose(new["w"], [1.5, 5.0])
    assert ema_decay("10ba", "5ba") == pytest.approx(0.5 ** 0.5)
    assert ema_decay("0ba", "1ba") == 0.0
    assert EMA(half_life="4ep").smoothing == pytest.approx(0.5 ** 0.25)
    assert EMA(half_life=None, smoothing=0.9).smoothing == 0.9


def test_ema_every_batch_equals_the_numpy_recursion():
    record = ParamsAfterEachBatch()
    ema = EMA(half_life="2ba")
    trainer = make_trainer([ema], "6ba", [record])
    initial = jax.device_get(trainer.state.algorithm_state["EMA"]["params"])
    assert_tree_close(initial, jax.device_get(trainer.state.params), rtol=0, atol=0)  # starts as a copy
    trainer.fit()
    own = trainer.state.train_state.algorithm_state["EMA"]
    assert bool(own["started"])
    assert_tree_close(own["params"], numpy_ema(record.history, 0.5 ** 0.5))
    assert_tree_close(ema.ema_params(trainer.state), own["params"], rtol=0, atol=0)
    assert trainer.compile_count == 1
    # the model keeps the trained weights after fit (as in Composer)
    assert_tree_close(trainer.state.params, record.history[-1], rtol=0, atol=0)


def test_ema_start_and_update_interval_pick_the_update_batches():
    record = ParamsAfterEachBatch()
    trainer = make_trainer([EMA(half_life="4ba", update_interval="2ba", ema_start="3ba")], "8ba", [record])
    trainer.fit()
    snapshots = [record.history[t - 1] for t in (4, 6, 8)]  # even batch counts from batch 3 on
    assert_tree_close(trainer.state.algorithm_state["EMA"]["params"], numpy_ema(snapshots, 0.5 ** 0.5))
    updated = [t.batch for t in trainer.engine.trace_log if t.key == "EMA/AFTER_OPTIMIZER_STEP"]
    assert updated == [3, 5, 7]  # steps counted from 0
    assert trainer.compile_count == 2  # a step with the update, one without


def test_ema_start_as_a_fraction_of_an_epoch_run_starts_mid_epoch():
    trainer = make_trainer([EMA(half_life="4ba", ema_start="0.5dur")], "2ep")  # 8 batches
    trainer.fit()
    updated = [t.batch for t in trainer.engine.trace_log if t.key == "EMA/AFTER_OPTIMIZER_STEP"]
    assert updated == [3, 4, 5, 6, 7]  # from the step after which half the run's batches are done


def test_ema_in_epochs_updates_at_epoch_ends():
    record = ParamsAfterEachBatch()
    trainer = make_trainer([EMA(half_life="1ep")], "3ep", [record])
    trainer.fit()
    snapshots = [record.history[t - 1] for t in (4, 8, 12)]
    assert_tree_close(trainer.state.algorithm_state["EMA"]["params"], numpy_ema(snapshots, 0.5))
    assert trainer.compile_count == 1  # no traced work: the plan never changes


def test_eval_uses_the_averaged_weights_and_restores_the_trained_ones():
    x, y = classification_data()
    loader = ArrayLoader((x, y), BATCH, shuffle=False)
    ema = EMA(half_life="2ba")
    trainer = make_trainer([ema], "4ba")
    trainer.fit()
    trained = jax.device_get(trainer.state.params)
    averaged = jax.device_get(ema.ema_params(trainer.state))
    results = trainer.eval(loader)
    after = jax.device_get(trainer.state.params)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(a, b)  # bit-identical

    def eval_with(params: dict) -> dict:
        model = ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(1)), 2)
        nnx.update(model, nnx.State(params))
        return make_trainer([], "1ba", model=model).eval(loader)

    expected = eval_with(averaged)
    assert results.keys() == expected.keys()
    for name in results:
        assert results[name] == pytest.approx(expected[name], rel=1e-6)
    assert results["CrossEntropy"] != pytest.approx(eval_with(trained)["CrossEntropy"], rel=1e-4)
    # training goes on from the trained weights (nothing aliased or donated twice)
    trainer.fit("1ba")
    assert trainer.state.timestamp.batch == 5


def test_eval_before_the_average_starts_uses_the_trained_weights():
    x, y = classification_data()
    loader = ArrayLoader((x, y), BATCH, shuffle=False)
    ema = EMA(half_life="2ba", ema_start="3ba")
    trainer = make_trainer([ema], "4ba")
    trainer.fit("2ba")
    trained = jax.device_get(trainer.state.params)
    assert not ema.match(Event.EVAL_START, trainer.state)
    before = trainer.eval(loader)
    model = ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(1)), 2)
    nnx.update(model, nnx.State(trained))
    assert before["CrossEntropy"] == pytest.approx(make_trainer([], "1ba", model=model).eval(loader)["CrossEntropy"],
                                                    rel=1e-6)


class BuffersAfterEachBatch(Callback):
    """Keeps the batch-norm running statistics after every batch."""

    def __init__(self) -> None:
        self.history: list[dict] = []

    def batch_end(self, state, logger):
        self.history.append(jax.device_get(model_buffers(state.model)))


def batch_norm_classifier(seed: int = 0) -> ComposerClassifier:
    rngs = nnx.Rngs(seed)
    return ComposerClassifier(nnx.Sequential(nnx.Linear(4, 3, rngs=rngs), nnx.BatchNorm(3, momentum=0.5, rngs=rngs),
                                             nnx.relu, nnx.Linear(3, 2, rngs=rngs)), 2)


@pytest.mark.parametrize(("half_life", "duration", "updates"), [("2ba", "3ba", (1, 2, 3)), ("1ep", "2ep", (4, 8))])
def test_batch_norm_statistics_are_averaged_like_the_weights(half_life, duration, updates):
    params, buffers = ParamsAfterEachBatch(), BuffersAfterEachBatch()
    ema = EMA(half_life=half_life)
    trainer = make_trainer([ema], duration, [params, buffers], model=batch_norm_classifier())
    initial = jax.device_get(ema.ema_buffers(trainer.state))
    np.testing.assert_array_equal(initial["module"]["layers"][1]["mean"], np.zeros(3))  # a copy of the model's
    np.testing.assert_array_equal(initial["module"]["layers"][1]["var"], np.ones(3))
    trainer.fit()
    decay = 0.5 ** 0.5 if half_life == "2ba" else 0.5
    expected = numpy_ema([buffers.history[t - 1] for t in updates], decay)
    assert_tree_close(ema.ema_buffers(trainer.state), expected)
    assert_tree_close(ema.ema_params(trainer.state), numpy_ema([params.history[t - 1] for t in updates], decay))
    # the statistics really moved, and the model keeps the trained ones (as Composer keeps its buffers)
    assert not np.allclose(expected["module"]["layers"][1]["mean"], buffers.history[-1]["module"]["layers"][1]["mean"])
    assert_tree_close(model_buffers(trainer.state.model), buffers.history[-1], rtol=0, atol=0)
    # checkpointed with the train state
    saved = trainer.state.state_dict()["train_state"]["algorithm_state"]["EMA"]["buffers"]
    assert_tree_close(saved, expected)


def test_eval_uses_the_averaged_batch_norm_statistics_and_restores_the_trained_ones():
    x, y = classification_data()
    loader = ArrayLoader((x, y), BATCH, shuffle=False)
    ema = EMA(half_life="2ba")
    trainer = make_trainer([ema], "3ba", model=batch_norm_classifier())
    trainer.fit()
    trained_buffers = jax.device_get(model_buffers(trainer.state.model))
    averaged_params = jax.device_get(ema.ema_params(trainer.state))
    averaged_buffers = jax.device_get(ema.ema_buffers(trainer.state))
    results = trainer.eval(loader)
    assert_tree_close(model_buffers(trainer.state.model), trained_buffers, rtol=0, atol=0)  # back, bit for bit

    def eval_with(params: dict, buffers: dict) -> float:
        model = batch_norm_classifier(seed=1)
        nnx.update(model, nnx.State(params))
        nnx.update(model, nnx.State(buffers))
        return make_trainer([], "1ba", model=model).eval(loader)["CrossEntropy"]

    assert results["CrossEntropy"] == pytest.approx(eval_with(averaged_params, averaged_buffers), rel=1e-6)
    assert results["CrossEntropy"] != pytest.approx(eval_with(averaged_params, trained_buffers), rel=1e-5)
    # training goes on from the trained values exactly as without the evaluation
    trainer.fit("1ba")
    twin = make_trainer([EMA(half_life="2ba")], "3ba", model=batch_norm_classifier())
    twin.fit()
    twin.fit("1ba")
    assert_tree_close(trainer.state.train_state.rest, twin.state.train_state.rest, rtol=0, atol=0)
    assert_tree_close(trainer.state.params, twin.state.params, rtol=0, atol=0)
    assert_tree_close(ema.ema_buffers(trainer.state), twin.state.algorithm_state["EMA"]["buffers"], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"half_life": None}, "half_life=None and smoothing=None"),
        ({"smoothing": 0.9}, "pass half_life=None"),
        ({"half_life": None, "smoothing": 1.0}, "smoothing=1.0"),
        ({"half_life": "10sp"}, "half_life='10sp'"),
        ({"half_life": "ten"}, "half_life='ten'"),
        ({"half_life": "10ba", "update_interval": "1ep"}, "unit of half_life"),
        ({"ema_start": "10sp"}, "ema_start='10sp'"),
        ({"ema_start": "1.5dur"}, "ema_start='1.5dur'"),
        ({"update_interval": "0ba"}, "update_interval='0ba'"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EMA(**kwargs)
