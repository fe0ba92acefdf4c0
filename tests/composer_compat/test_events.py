"""Composer's event meanings: AFTER_TRAIN_BATCH before the update, eval events, loads, iterations, callbacks."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, Callback, Event, Trainer
from composerjax.algorithms.gradient_clipping import GradientClipping
from composerjax.data import ArrayLoader

E = Event


class Recorder(Callback):
    """Every event, in order, with the batch count it ran at (traced events: while the step traced)."""

    def __init__(self) -> None:
        self.seen: list[tuple[Event, int]] = []

    def run_event(self, event, state, logger):
        self.seen.append((event, int(state.timestamp.batch)))

    def events(self) -> list[Event]:
        return [event for event, _ in self.seen]


def make(classification_arrays, model, **kwargs) -> Trainer:
    x, y = classification_arrays
    arguments = dict(max_duration="1ep", optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False)
    arguments.update(kwargs)
    return Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), **arguments)


# -- one batch with microbatches ---------------------------------------------------------------------
class CountPerStep(Algorithm):
    """Counts, inside the compiled step, how often AFTER_BACKWARD and AFTER_TRAIN_BATCH run per batch."""

    events = frozenset({E.AFTER_BACKWARD, E.AFTER_TRAIN_BATCH})

    def init_state(self, state):
        return {"backward": jnp.zeros((), jnp.int32), "train_batch": jnp.zeros((), jnp.int32)}

    def match(self, event, state):
        return event in self.events

    def apply(self, event, state, logger):
        own = dict(state.algorithm_state[self.name])
        key = "backward" if event is E.AFTER_BACKWARD else "train_batch"
        own[key] = own[key] + 1
        state.algorithm_state[self.name] = own


def test_event_order_of_one_batch_with_microbatches(classification_arrays, make_tiny_classifier):
    recorder, counter = Recorder(), CountPerStep()
    trainer = make(classification_arrays, make_tiny_classifier(), max_duration="1ba", callbacks=[recorder],
                   algorithms=[counter], device_train_microbatch_size=4)
    trainer.fit()
    assert recorder.events() == [
        E.INIT, E.BEFORE_LOAD, E.AFTER_LOAD, E.FIT_START, E.ITERATION_START, E.EPOCH_START, E.BEFORE_DATALOADER,
        E.AFTER_DATALOADER, E.BATCH_START, E.BEFORE_TRAIN_BATCH, E.BEFORE_FORWARD, E.AFTER_FORWARD, E.BEFORE_LOSS,
        E.AFTER_LOSS, E.BEFORE_BACKWARD, E.AFTER_BACKWARD, E.AFTER_TRAIN_BATCH, E.AFTER_OPTIMIZER_STEP, E.BATCH_END,
        E.BATCH_CHECKPOINT, E.FIT_END,
    ]
    counts = jax.device_get(trainer.state.train_state.algorithm_state["CountPerStep"])
    # Composer: the forward/backward events once per microbatch (16 / 4), AFTER_TRAIN_BATCH once per batch.
    assert int(counts["backward"]) == 4 and int(counts["train_batch"]) == 1


# -- AFTER_TRAIN_BATCH: the gradients, before the optimizer update -----------------------------------
class ZeroGrads(Algorithm):
    events = frozenset({E.AFTER_TRAIN_BATCH})

    def match(self, event, state):
        return event is E.AFTER_TRAIN_BATCH

    def apply(self, event, state, logger):
        state.grads = jax.tree.map(jnp.zeros_like, state.grads)


@pytest.mark.parametrize("optimizer", [optax.sgd(0.5, momentum=0.9), optax.adam(0.1)], ids=["sgd", "adam"])
def test_zeroing_grads_at_after_train_batch_leaves_the_parameters_unchanged(classification_arrays,
                                                                            make_tiny_classifier, optimizer):
    model = make_tiny_classifier()
    before = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    trainer = make(classification_arrays, model, max_duration="2ep", optimizers=optimizer, algorithms=[ZeroGrads()])
    trainer.fit()
    after = jax.device_get(trainer.state.train_state.params)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
        np.testing.assert_array_equal(a, b)


def test_gradient_clipping_clips_the_whole_batch_gradient_at_after_train_batch(classification_arrays):
    x, y = classification_arrays
    model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
    params = jax.device_get(nnx.to_pure_dict(nnx.state(model, nnx.Param)))

    def loss_fn(p, xb, yb):
        logits = xb @ p["kernel"] + p["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    def loss(module, batch):
        return optax.softmax_cross_entropy_with_integer_labels(module(batch[0]), batch[1]).mean()

    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), max_duration="1ba",
                      optimizers=optax.sgd(1.0), loss_fn=loss, device_train_microbatch_size=4, progress_bar=False,
                      algorithms=[GradientClipping("norm", 0.01)], run_summary=False)
    trainer.fit()
    grads = jax.grad(loss_fn)(params, x[:16], y[:16])
    scale = min(1.0, 0.01 / float(optax.tree.norm(grads)))
    assert scale < 1.0  # the threshold bites
    expected = jax.tree.map(lambda p, g: p - scale * g, params, grads)
    for a, b in zip(jax.tree.leaves(jax.device_get(trainer.state.train_state.params)), jax.tree.leaves(expected)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


# -- evaluation events -------------------------------------------------------------------------------
def test_standalone_eval_fires_standalone_events_and_fit_evals_fire_before_and_after_all(classification_arrays,
                                                                                           make_tiny_classifier):
    x, y = classification_arrays
    recorder = Recorder()
    trainer = make(classification_arrays, make_tiny_classifier(), max_duration="4ba", callbacks=[recorder],
                   eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False), eval_interval="2ba")
    trainer.fit()
    during = recorder.events()
    assert E.EVAL_STANDALONE_START not in during and E.EVAL_STANDALONE_END not in during
    starts = [i for i, event in enumerate(during) if event is E.EVAL_BEFORE_ALL]
    assert [recorder.seen[i][1] for i in starts] == [2, 4]
    # Composer's position: BATCH_END, EVAL_BEFORE_ALL, EVAL_START ... EVAL_END, EVAL_AFTER_ALL, BATCH_CHECKPOINT.
    for i in starts:
        assert during[i - 1] is E.BATCH_END and during[i + 1] is E.EVAL_START
        after = during.index(E.EVAL_AFTER_ALL, i)
        assert during[after - 1] is E.EVAL_END and during[after + 1] is E.BATCH_CHECKPOINT
    recorder.seen.clear()
    trainer.eval()
    standalone = recorder.events()
    assert standalone[0] is E.EVAL_STANDALONE_START and standalone[-1] is E.EVAL_STANDALONE_END
    assert standalone[1] is E.EVAL_START and standalone[-2] is E.EVAL_END
    assert E.EVAL_BEFORE_ALL not in standalone and E.EVAL_AFTER_ALL not in standalone


def test_before_and_after_load_fire_on_every_construction(classification_arrays, make_tiny_classifier):
    for _ in range(2):
        recorder = Recorder()
        make(classification_arrays, make_tiny_classifier(), callbacks=[recorder])
        assert recorder.events() == [E.INIT, E.BEFORE_LOAD, E.AFTER_LOAD]


# -- iterations ----------------------------------------------------------------------------------------
def test_iteration_events_follow_state_iteration_length(classification_arrays, make_tiny_classifier):
    recorder = Recorder()
    trainer = make(classification_arrays, make_tiny_classifier(), max_duration="4ep", callbacks=[recorder])
    trainer.state.iteration_length = "2ep"
    trainer.fit()
    seen = [(event, batch) for event, batch in recorder.seen if event.name.startswith("ITERATION")]
    assert seen == [(E.ITERATION_START, 0), (E.ITERATION_END, 8), (E.ITERATION_CHECKPOINT, 8),
                    (E.ITERATION_START, 8), (E.ITERATION_END, 16), (E.ITERATION_CHECKPOINT, 16)]
    events = recorder.events()
    assert events[events.index(E.ITERATION_END) - 1] is E.EPOCH_CHECKPOINT
    assert int(trainer.state.timestamp.iteration) == 2 and int(trainer.state.timestamp.epoch_in_iteration) == 0


def test_iter_durations_train_that_many_iterations(classification_arrays, make_tiny_classifier):
    trainer = make(classification_arrays, make_tiny_classifier(), max_duration="3iter")
    trainer.state.iteration_length = 1
    trainer.fit()
    assert int(trainer.state.timestamp.epoch) == 3 and int(trainer.state.timestamp.iteration) == 3


def test_iter_durations_without_an_iteration_length_are_refused(classification_arrays, make_tiny_classifier):
    trainer = make(classification_arrays, make_tiny_classifier(), max_duration="2iter")
    with pytest.raises(ValueError, match=r"max_duration='2iter': 'iter' durations need state.iteration_length"):
        trainer.fit()


def test_without_an_iteration_length_iteration_start_fires_once(classification_arrays, make_tiny_classifier):
    recorder = Recorder()
    make(classification_arrays, make_tiny_classifier(), max_duration="3ep", callbacks=[recorder]).fit()
    assert recorder.events().count(E.ITERATION_START) == 1
    assert E.ITERATION_END not in recorder.events()


# -- callbacks written against Composer's method names -------------------------------------------------
def test_a_callback_has_a_method_for_every_event_and_each_is_called():
    assert all(callable(getattr(Callback, event.value, None)) for event in Event)

    class ComposerStyle(Callback):
        def __init__(self) -> None:
            self.called: list[str] = []

    for event in Event:
        def method(self, state, logger, name=event.value):
            self.called.append(name)
        setattr(ComposerStyle, event.value, method)
    callback = ComposerStyle()
    for event in Event:
        callback.run_event(event, None, None)
    assert callback.called == [event.value for event in Event]
