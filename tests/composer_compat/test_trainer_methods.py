"""Composer's Trainer methods: fit's keyword arguments, eval, predict, and the precision names."""

import jax
import numpy as np
import optax
import pytest

from composerjax import Callback, Trainer
from composerjax.data import ArrayLoader


def make(classification_arrays, model, **kwargs) -> Trainer:
    x, y = classification_arrays
    arguments = dict(max_duration="1ep", optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False)
    arguments.update(kwargs)
    return Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), **arguments)


def params_of(trainer):
    return jax.device_get(trainer.state.train_state.params)


def test_fit_duration_trains_that_much_more(classification_arrays, make_tiny_classifier):
    trainer = make(classification_arrays, make_tiny_classifier())
    trainer.fit()
    trainer.fit(duration="3ba")
    assert int(trainer.state.timestamp.batch) == 7 and str(trainer.state.max_duration) == "7ba"


def test_fit_reset_time_restarts_the_clock_and_the_step_count(classification_arrays, make_tiny_classifier):
    class Steps(Callback):
        def __init__(self):
            self.steps = []

        def after_train_batch(self, state, logger):  # traced: the step number the step sees
            state.step_metrics["step"] = state.step

        def batch_end(self, state, logger):
            self.steps.append(state.step_metrics["step"])

    steps = Steps()
    trainer = make(classification_arrays, make_tiny_classifier(), callbacks=[steps])
    trainer.fit()
    trainer.fit(duration="2ba", reset_time=True)
    assert int(trainer.state.timestamp.batch) == 2 and str(trainer.state.max_duration) == "2ba"
    assert [int(s) for s in jax.device_get(steps.steps)] == [0, 1, 2, 3, 0, 1]


def test_fit_train_dataloader_replaces_the_data(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    trainer = make(classification_arrays, make_tiny_classifier())
    trainer.fit()  # 4 batches of 16
    trainer.fit(train_dataloader=ArrayLoader((x[:32], y[:32]), batch_size=8), duration="1ep")  # 4 of 8
    assert trainer.state.dataloader_len == 4
    assert (int(trainer.state.timestamp.batch), int(trainer.state.timestamp.sample)) == (8, 64 + 32)


def test_fit_device_train_microbatch_size_changes_the_split_not_the_result(classification_arrays,
                                                                          make_tiny_classifier):
    whole = make(classification_arrays, make_tiny_classifier())
    whole.fit()
    split = make(classification_arrays, make_tiny_classifier())
    split.fit(device_train_microbatch_size=4)
    assert split.microbatch_size == 4
    for a, b in zip(jax.tree.leaves(params_of(whole)), jax.tree.leaves(params_of(split))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fit_refuses_a_precision_it_cannot_apply(classification_arrays, make_tiny_classifier):
    trainer = make(classification_arrays, make_tiny_classifier())
    with pytest.raises(ValueError, match=r"fit\(precision='amp_bf16'\): the precision is compiled into the train step"):
        trainer.fit(precision="amp_bf16")
    trainer.fit(precision="fp32")  # the same precision is fine
    assert int(trainer.state.timestamp.batch) == 4


def test_predict_subset_and_return_outputs(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    seen = []

    class Outputs(Callback):
        def predict_batch_end(self, state, logger):
            seen.append(state.outputs.shape)

    trainer = make(classification_arrays, make_tiny_classifier(), callbacks=[Outputs()])
    loader = ArrayLoader((x, y), batch_size=16, shuffle=False)
    outputs = trainer.predict(loader, subset_num_batches=2)
    assert [o.shape for o in outputs] == [(16, 2), (16, 2)]
    assert trainer.predict(loader, return_outputs=False) == []
    assert seen == [(16, 2)] * 6
    with pytest.raises(ValueError, match=r"predict\(subset_num_batches=0\)"):
        trainer.predict(loader, subset_num_batches=0)


def test_train_metrics_are_off_by_default_and_logged_per_batch_when_asked(classification_arrays):
    from flax import nnx

    from composerjax import ComposerClassifier
    from composerjax.loggers import InMemoryLogger
    from composerjax.metrics import MulticlassAccuracy

    x, y = classification_arrays
    memory = InMemoryLogger()
    make(classification_arrays, ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), loggers=[memory],
         log_interval=1).fit()
    assert not [name for name in memory.data if name.startswith("metrics/train/")]

    memory = InMemoryLogger()
    module = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    logits = np.asarray(module(x))  # sgd(0.0): the weights never move, so each batch sees these logits
    model = ComposerClassifier(module, 2, train_metrics=[MulticlassAccuracy(num_classes=2)])
    make(classification_arrays, model, optimizers=optax.sgd(0.0), loggers=[memory], log_interval=1).fit()
    logged = [value for _, value in memory.data["metrics/train/MulticlassAccuracy"]]
    expected = [float(np.mean(np.argmax(logits[i:i + 16], -1) == y[i:i + 16])) for i in range(0, 64, 16)]
    assert logged == expected
