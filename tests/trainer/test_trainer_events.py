"""Tests for the Trainer's event lifecycle: fit, eval and predict order, periodic eval, close."""

from types import SimpleNamespace
from typing import NamedTuple

import jax
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Callback, Event, Trainer

E = Event

TRACED_TRAIN_EVENTS = [
    E.BEFORE_TRAIN_BATCH,
    E.BEFORE_FORWARD,
    E.AFTER_FORWARD,
    E.BEFORE_LOSS,
    E.AFTER_LOSS,
    E.BEFORE_BACKWARD,
    E.AFTER_BACKWARD,
    E.AFTER_TRAIN_BATCH,
    E.AFTER_OPTIMIZER_STEP,
]


class Seen(NamedTuple):
    event: Event
    batch: int
    epoch: int
    batch_in_epoch: int
    traced: bool  # whether state.batch held tracers when the event ran


class EventRecorder(Callback):
    """Record every event with the clock and whether the batch it saw was traced."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []

    def run_event(self, event, state, logger):
        leaves = jax.tree.leaves(state.batch)
        traced = bool(leaves) and isinstance(leaves[0], jax.core.Tracer)
        clock = state.timestamp
        self.seen.append(Seen(event, clock.batch.value, clock.epoch.value, clock.batch_in_epoch.value, traced))

    def take(self) -> list[Seen]:
        seen, self.seen = self.seen, []
        return seen


def events(seen: list[Seen]) -> list[Event]:
    return [s.event for s in seen]


def train_batch_events(first_compile: bool) -> list[Event]:
    traced = TRACED_TRAIN_EVENTS if first_compile else []
    return [E.BEFORE_DATALOADER, E.AFTER_DATALOADER, E.BATCH_START, *traced, E.BATCH_END, E.BATCH_CHECKPOINT]


@pytest.fixture(scope="module")
def recorded_run(classification_arrays, make_tiny_classifier):
    """One trainer (2 epochs of 4 batches), its events per phase: constructor, fit, eval x2, predict."""
    x, y = classification_arrays
    recorder = EventRecorder()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ep",
                      optimizers=optax.sgd(0.1), callbacks=[recorder], progress_bar=False)
    init = recorder.take()
    trainer.fit()
    fit = recorder.take()
    eval_loader = ArrayLoader((x, y), batch_size=16, shuffle=False)
    metrics = trainer.eval(eval_loader)
    first_eval = recorder.take()
    trainer.eval(eval_loader)
    second_eval = recorder.take()
    outputs = trainer.predict(eval_loader)
    predict = recorder.take()
    return SimpleNamespace(trainer=trainer, init=init, fit=fit, first_eval=first_eval, second_eval=second_eval,
                           predict=predict, metrics=metrics, outputs=outputs, x=x, y=y)


# -- fit -----------------------------------------------------------------------------------------
def test_init_runs_in_the_constructor_only(recorded_run):
    assert events(recorded_run.init) == [E.INIT, E.BEFORE_LOAD, E.AFTER_LOAD]  # load events: every construction
    assert E.INIT not in events(recorded_run.fit)


def test_fit_event_order_with_traced_events_on_the_compiling_batch_only(recorded_run):
    expected = [E.FIT_START, E.ITERATION_START]  # one iteration: no state.iteration_length
    for epoch in range(2):
        expected.append(E.EPOCH_START)
        for batch in range(4):
            expected += train_batch_events(first_compile=(epoch == 0 and batch == 0))
        expected += [E.EPOCH_END, E.EPOCH_CHECKPOINT]
    expected.append(E.FIT_END)
    assert events(recorded_run.fit) == expected
    assert recorded_run.trainer.compile_count == 3  # one train step, one eval step, one predict step


def test_traced_events_see_tracers_and_host_events_see_concrete_batches(recorded_run):
    for seen in recorded_run.fit:
        assert seen.traced == seen.event.is_traced, seen
        assert seen.traced == (seen.event in TRACED_TRAIN_EVENTS), seen


def test_clock_advances_before_batch_end_and_epoch_end(recorded_run):
    fit = recorded_run.fit
    batch_starts = [s for s in fit if s.event is E.BATCH_START]
    batch_ends = [s for s in fit if s.event is E.BATCH_END]
    checkpoints = [s for s in fit if s.event is E.BATCH_CHECKPOINT]
    assert [s.batch for s in batch_starts] == list(range(8))
    assert [s.batch for s in batch_ends] == list(range(1, 9))
    assert [s.batch_in_epoch for s in batch_ends] == [1, 2, 3, 4, 1, 2, 3, 4]
    assert [s.batch for s in checkpoints] == list(range(1, 9))
    # Inside the step the host clock still reads the batch being trained.
    assert {s.batch for s in fit if s.traced} == {0}

    epoch_starts = [s for s in fit if s.event is E.EPOCH_START]
    epoch_ends = [s for s in fit if s.event is E.EPOCH_END]
    assert [(s.epoch, s.batch) for s in epoch_starts] == [(0, 0), (1, 4)]
    assert [(s.epoch, s.batch, s.batch_in_epoch) for s in epoch_ends] == [(1, 4, 0), (2, 8, 0)]
    fit_end = fit[-1]
    assert (fit_end.event, fit_end.epoch, fit_end.batch) == (E.FIT_END, 2, 8)


# -- eval ----------------------------------------------------------------------------------------
def test_eval_event_order(recorded_run):
    per_batch = [E.EVAL_BATCH_START, E.EVAL_BATCH_END]
    first_batch = [E.EVAL_BATCH_START, E.EVAL_BEFORE_FORWARD, E.EVAL_AFTER_FORWARD, E.EVAL_BATCH_END]
    # A user's eval(): EVAL_STANDALONE_* around it (EVAL_BEFORE_ALL/AFTER_ALL are for evals during fit).
    assert events(recorded_run.first_eval) == [
        E.EVAL_STANDALONE_START, E.EVAL_START, *first_batch, *per_batch * 3, E.EVAL_END, E.EVAL_STANDALONE_END
    ]
    # Same plan, same shapes: the eval step is not traced again.
    assert events(recorded_run.second_eval) == [
        E.EVAL_STANDALONE_START, E.EVAL_START, *per_batch * 4, E.EVAL_END, E.EVAL_STANDALONE_END
    ]
    assert [s.traced for s in recorded_run.first_eval] == [
        s.event in (E.EVAL_BEFORE_FORWARD, E.EVAL_AFTER_FORWARD) for s in recorded_run.first_eval
    ]
    # eval does not move the training clock.
    assert {(s.batch, s.epoch) for s in recorded_run.first_eval} == {(8, 2)}


def test_eval_metrics_match_an_independent_computation(recorded_run):
    logits = np.concatenate(recorded_run.outputs).astype(np.float64)
    labels = recorded_run.y
    accuracy = np.sum(np.argmax(logits, axis=-1) == labels) / len(labels)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
    cross_entropy = -np.mean(log_probs[np.arange(len(labels)), labels])
    optax_cross_entropy = float(optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean())

    metrics = recorded_run.metrics
    assert set(metrics) == {"CrossEntropy", "MulticlassAccuracy"}
    assert metrics["MulticlassAccuracy"] == accuracy
    assert metrics["CrossEntropy"] == pytest.approx(cross_entropy, rel=1e-5)
    assert metrics["CrossEntropy"] == pytest.approx(optax_cross_entropy, rel=1e-5)
    assert recorded_run.trainer.state.metrics["eval"] == metrics


def test_predict_event_order(recorded_run):
    per_batch = [E.PREDICT_BATCH_START, E.PREDICT_BATCH_END]
    first_batch = [E.PREDICT_BATCH_START, E.PREDICT_BEFORE_FORWARD, E.PREDICT_AFTER_FORWARD, E.PREDICT_BATCH_END]
    assert events(recorded_run.predict) == [E.PREDICT_START, *first_batch, *per_batch * 3, E.PREDICT_END]


# -- periodic eval during fit ----------------------------------------------------------------------
def fit_with_periodic_eval(x, y, model, eval_interval):
    recorder = EventRecorder()
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16), max_duration="2ep", optimizers=optax.sgd(0.1),
                      eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False),
                      eval_interval=eval_interval, callbacks=[recorder], progress_bar=False)
    trainer.fit()
    return trainer, recorder.take()


def test_eval_interval_one_epoch_evaluates_after_each_epoch(classification_arrays, make_tiny_classifier):
    trainer, seen = fit_with_periodic_eval(*classification_arrays, make_tiny_classifier(), "1ep")
    starts = [i for i, s in enumerate(seen) if s.event is E.EVAL_START]
    assert [(seen[i].epoch, seen[i].batch) for i in starts] == [(1, 4), (2, 8)]
    # Composer's position: after EPOCH_END, before EPOCH_CHECKPOINT.
    assert [seen[i - 2].event for i in starts] == [E.EPOCH_END, E.EPOCH_END]
    ends = [i for i, s in enumerate(seen) if s.event is E.EVAL_AFTER_ALL]
    assert [seen[i + 1].event for i in ends] == [E.EPOCH_CHECKPOINT, E.EPOCH_CHECKPOINT]
    assert events(seen).count(E.EVAL_BATCH_END) == 4  # 2 evals x 2 batches of 32
    assert events(seen)[-1] is E.FIT_END
    assert set(trainer.state.metrics["eval"]) == {"CrossEntropy", "MulticlassAccuracy"}


def test_eval_interval_defaults_to_one_epoch_with_eval_data(classification_arrays, make_tiny_classifier):
    _, seen = fit_with_periodic_eval(*classification_arrays, make_tiny_classifier(), None)
    assert [s.epoch for s in seen if s.event is E.EVAL_START] == [1, 2]


def test_eval_interval_in_batches(classification_arrays, make_tiny_classifier):
    _, seen = fit_with_periodic_eval(*classification_arrays, make_tiny_classifier(), "2ba")
    starts = [i for i, s in enumerate(seen) if s.event is E.EVAL_START]
    assert [seen[i].batch for i in starts] == [2, 4, 6, 8]
    assert [seen[i - 2].event for i in starts] == [E.BATCH_END] * 4  # after BATCH_END, before BATCH_CHECKPOINT
    ends = [i for i, s in enumerate(seen) if s.event is E.EVAL_AFTER_ALL]
    assert [seen[i + 1].event for i in ends] == [E.BATCH_CHECKPOINT] * 4
    assert events(seen).count(E.EPOCH_END) == 2


# -- close ---------------------------------------------------------------------------------------
class CountCloses(Callback):
    def __init__(self) -> None:
        self.closes = 0
        self.post_closes = 0

    def close(self, state, logger):
        self.closes += 1

    def post_close(self):
        self.post_closes += 1


def test_close_makes_the_engine_refuse_events_and_is_idempotent(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    counter = CountCloses()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="1ep",
                      callbacks=[counter], progress_bar=False)
    trainer.close()
    with pytest.raises(RuntimeError, match="close"):
        trainer.engine.run_event(Event.BATCH_START)
    with pytest.raises(RuntimeError):
        trainer.fit()
    trainer.close()
    assert (counter.closes, counter.post_closes) == (1, 1)
    assert trainer.engine.closed
