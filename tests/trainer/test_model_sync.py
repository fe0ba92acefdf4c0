"""The caller's own module object holds the trained values after fit, despite buffer donation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer


def test_callers_module_is_usable_and_trained_after_fit(classification_arrays):
    x, y = classification_arrays
    module = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    initial = np.asarray(module.kernel[...]).copy()
    trainer = Trainer(ComposerClassifier(module, 2), ArrayLoader((x, y), 16), "2ep", optax.adam(1e-2),
                      progress_bar=False)
    trainer.fit()
    trained = jax.device_get(trainer.state.train_state.params["module"]["kernel"])
    np.testing.assert_array_equal(np.asarray(module.kernel[...]), trained)  # no "Array has been deleted"
    assert not np.allclose(trained, initial)
    np.testing.assert_allclose(np.asarray(module(x[:3])), x[:3] @ trained + np.asarray(module.bias[...]), rtol=1e-5)
    trainer.fit("1ep")  # training continues from the synced values without a retrace
    assert trainer.compile_count == 1
    assert not np.allclose(np.asarray(module.kernel[...]), trained)


class ZeroWeightsForEval(Algorithm):
    """Host algorithm: swap other weights in for eval through state.params, restore after."""

    def match(self, event, state):
        return event in (Event.EVAL_START, Event.EVAL_END)

    def apply(self, event, state, logger):
        if event == Event.EVAL_START:
            self.saved = state.params
            state.params = jax.tree.map(jnp.zeros_like, state.params)
        else:
            state.params = self.saved


def test_params_swapped_on_host_events_reach_eval_and_come_back(classification_arrays):
    x, y = classification_arrays
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), 16), "1ep",
                      optax.adam(1e-2), algorithms=[ZeroWeightsForEval()], progress_bar=False)
    trainer.fit()
    before = jax.device_get(trainer.state.params)
    results = trainer.eval(ArrayLoader((x, y), 64, shuffle=False))
    # zero weights: uniform logits, loss ln 2, argmax picks class 0
    assert results["CrossEntropy"] == pytest.approx(np.log(2), rel=1e-6)
    assert results["MulticlassAccuracy"] == pytest.approx(float(np.mean(y == 0)))
    after = jax.device_get(trainer.state.params)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(trainer.state.model.module.kernel[...]), after["module"]["kernel"])


def test_tokens_per_batch_counts_tokens_and_token_durations_stop_exactly():
    tokens = np.random.default_rng(0).integers(0, 16, size=(32, 8)).astype(np.int32)
    targets = np.roll(tokens, -1, axis=1)
    model = nnx.Sequential(nnx.Embed(16, 8, rngs=nnx.Rngs(0)), nnx.Linear(8, 16, rngs=nnx.Rngs(1)))
    loss = lambda m, b: optax.softmax_cross_entropy_with_integer_labels(m(b[0]), b[1]).mean()
    trainer = Trainer(model, ArrayLoader((tokens, targets), 4, shuffle=False), "160tok", optax.sgd(0.1),
                      loss_fn=loss, tokens_per_batch=lambda batch: batch[0].size, progress_bar=False,
                      run_summary=False)
    trainer.fit()
    assert trainer.state.timestamp.batch == 5  # 32 tokens per batch
    assert trainer.state.timestamp.token == 160
    with pytest.raises(TypeError, match="tokens_per_batch=3"):
        Trainer(model, ArrayLoader((tokens, targets), 4), "1ba", loss_fn=loss, tokens_per_batch=3)


# -- typed device state, explicit sync --------------------------------------------------------------
class ReadsTheModel(Algorithm):
    """Reads state.model (and state.params) at every BATCH_END, as a monitoring plugin would."""

    events = frozenset({Event.BATCH_END})

    def apply(self, event, state, logger):
        self.kernel = np.asarray(state.model.module.kernel[...])
        state.params  # noqa: B018 - reading only


def test_reading_the_model_never_marks_it_changed_nor_re_uploads_it(classification_arrays, monkeypatch):
    from composerjax.core import TrainState
    from composerjax.step.runner import StepRunner

    taken = []
    take_model = StepRunner.take_model
    monkeypatch.setattr(StepRunner, "take_model", lambda self: (taken.append(1), take_model(self))[1])
    x, y = classification_arrays
    reader = ReadsTheModel()
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), 16), "1ep",
                      optax.sgd(0.1), algorithms=[reader], progress_bar=False, run_summary=False)
    assert isinstance(trainer.state.train_state, TrainState)
    assert TrainState._fields == ("params", "rest", "opt_state", "algorithm_state", "clock")
    trainer.fit()
    assert taken == [] and not trainer.state.model_changed
    np.testing.assert_array_equal(reader.kernel, jax.device_get(trainer.state.train_state.params["module"]["kernel"]))
    assert int(trainer.state.train_state.clock[0]) == 4


def test_update_model_is_the_one_way_host_edits_reach_the_step(classification_arrays):
    x, y = classification_arrays
    trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), 16), "1ba",
                      optax.sgd(0.0), progress_bar=False, run_summary=False)
    trainer.state.model.module.bias[...] = jnp.full((2,), 7.0)  # edited, not written: the step never sees it
    trainer.fit()
    assert not np.allclose(jax.device_get(trainer.state.train_state.params["module"]["bias"]), 7.0)
    trainer.state.model.module.bias[...] = jnp.full((2,), 7.0)
    trainer.state.update_model()
    assert trainer.state.model_changed
    trainer.fit("1ba")
    np.testing.assert_array_equal(jax.device_get(trainer.state.train_state.params["module"]["bias"]), [7.0, 7.0])
