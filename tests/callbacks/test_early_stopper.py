"""EarlyStopper: scripted eval metrics and step-dependent train losses stop training at exact batches."""

from __future__ import annotations

import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Time, Trainer
from composerjax.callbacks.early_stopper import EarlyStopper, resolve_comparison


class ScriptedEval(Callback):
    """Listed before the stopper: replaces each evaluation's metrics with the next scripted value."""

    def __init__(self, name: str, values: list[float]) -> None:
        self.name, self.values, self.seen = name, list(values), []

    def eval_end(self, state, logger):
        value = self.values.pop(0)
        state.metrics["eval"] = {**state.metrics["eval"], self.name: value}
        self.seen.append((state.timestamp.batch, value))


def fit_with_scripted_eval(arrays, make_model, stopper, script, **kwargs) -> Trainer:
    x, y = arrays
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration="10ep",
                      optimizers=optax.sgd(0.1), eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False),
                      callbacks=[script, stopper], progress_bar=False, run_summary=False, **kwargs)
    trainer.fit()
    return trainer


def test_stops_when_patience_in_batches_runs_out(classification_arrays, make_tiny_classifier):
    # Evaluations at batches 2, 4, 6, ...: best 0.7 at batch 6; 0.7 again is no improvement;
    # 12 - 6 = 6 > 4 batches of patience at batch 12.
    script = ScriptedEval("accuracy", [0.5, 0.6, 0.7, 0.65, 0.7, 0.69, 0.99, 0.99])
    stopper = EarlyStopper("accuracy", "eval", patience="4ba")
    trainer = fit_with_scripted_eval(classification_arrays, make_tiny_classifier, stopper, script,
                                     eval_interval="2ba")
    assert trainer.state.timestamp.batch == 12
    assert [batch for batch, _ in script.seen] == [2, 4, 6, 8, 10, 12]
    assert (stopper.best, stopper.best_batch) == (0.7, 6)


def test_min_delta_and_integer_patience_in_epochs(classification_arrays, make_tiny_classifier):
    # Loss-like: lower is better. Evaluations each epoch (4 batches); 0.85 beats the best 0.9 by
    # less than min_delta, so the best stays at epoch 2 and epoch 5 is 3 > 2 epochs later.
    script = ScriptedEval("cross_entropy", [1.0, 0.9, 0.95, 0.85, 0.92, 0.1])
    stopper = EarlyStopper("cross_entropy", min_delta=0.06, patience=2)
    trainer = fit_with_scripted_eval(classification_arrays, make_tiny_classifier, stopper, script)
    assert trainer.state.timestamp.epoch == 5
    assert trainer.state.timestamp.batch == 20
    assert (stopper.best, stopper.best_epoch) == (0.9, 2)


def test_monitors_train_loss_from_logged_values(classification_arrays):
    # The loss grows with the step: epoch means 1.5, 5.5, 9.5; the best is epoch 1's, and at the
    # end of epoch 3 it is 2 > 1 epochs old.
    def rising_loss(model, batch, rng, step):
        return jnp.asarray(step, jnp.float32) + 0.0 * jnp.sum(model(batch[0]))

    x, y = classification_arrays
    stopper = EarlyStopper("loss", "train", patience=1)
    trainer = Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="10ep",
                      optimizers=optax.sgd(0.1), loss_fn=rising_loss, callbacks=[stopper], progress_bar=False,
                      run_summary=False)
    trainer.fit()
    assert trainer.state.timestamp.batch == 12
    assert (stopper.best, stopper.best_epoch) == (1.5, 1)
    assert trainer.compile_count == 1


def test_train_loss_with_patience_in_batches_is_checked_at_batch_end(classification_arrays):
    # As Composer: with patience in batches a train metric is checked at every batch end. The loss
    # is the step number, so the best stays batch 1's; each value reaches the host when the trainer
    # fetches it (log_interval=1: one batch behind), and 3 > 2 batches after the best, it stops.
    def rising_loss(model, batch, rng, step):
        return jnp.asarray(step, jnp.float32) + 0.0 * jnp.sum(model(batch[0]))

    x, y = classification_arrays
    stopper = EarlyStopper("loss", "train", comp="lt", patience="2ba")
    trainer = Trainer(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=16), max_duration="10ep",
                      optimizers=optax.sgd(0.1), loss_fn=rising_loss, callbacks=[stopper], progress_bar=False,
                      run_summary=False, log_interval=1)
    trainer.fit()
    assert stopper.best == 0.0
    assert trainer.state.timestamp.batch == stopper.best_batch + 3


def test_only_the_monitored_evaluator_counts(classification_arrays, make_tiny_classifier):
    # Two evaluators each epoch; the stopper watches 'b' only. 'a' is scripted to look worse every
    # time, which would stop training after epoch 2 if its evaluations were read as 'b's.
    class Script(Callback):
        def eval_end(self, state, logger):
            label = state.dataloader_label
            value = {"a": 1.0 - 0.1 * int(state.timestamp.epoch), "b": 0.5 + 0.1 * int(state.timestamp.epoch)}[label]
            state.metrics[label] = {**state.metrics[label], "MulticlassAccuracy": value}

    x, y = classification_arrays
    loader = ArrayLoader((x, y), batch_size=32, shuffle=False)
    stopper = EarlyStopper("MulticlassAccuracy", "b", patience=1)
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="4ep",
                      optimizers=optax.sgd(0.1), eval_dataloader={"a": loader, "b": loader},
                      callbacks=[Script(), stopper], progress_bar=False, run_summary=False)
    trainer.fit()
    assert trainer.state.timestamp.epoch == 4
    assert (stopper.best, stopper.best_epoch) == (pytest.approx(0.9), 4)


def test_missing_metric_names_what_there_is(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="1ep",
                      eval_dataloader=ArrayLoader((x, y), batch_size=32), callbacks=[EarlyStopper("f1")],
                      progress_bar=False, run_summary=False)
    with pytest.raises(ValueError, match=r"monitor='f1'.*\['CrossEntropy', 'MulticlassAccuracy'\]"):
        trainer.fit()


def test_state_dict_round_trip_and_comparisons():
    stopper = EarlyStopper()
    stopper.load_state_dict({"best": 0.8, "best_epoch": 3, "best_batch": 12})
    assert stopper.state_dict() == {"best": 0.8, "best_epoch": 3, "best_batch": 12}
    assert stopper.patience == Time(1, "ep")
    assert resolve_comparison("<=", "accuracy")(0.5, 0.5) is True
    assert resolve_comparison(None, "val_error")(0.1, 0.2) is True


@pytest.mark.parametrize("kwargs, message", [
    ({"monitor": ""}, "monitor=''"),
    ({"comp": "bigger"}, "comp='bigger'"),
    ({"min_delta": -0.1}, "min_delta=-0.1"),
    ({"patience": "10sp"}, "patience='10sp'"),
    ({"patience": -1}, "patience=-1"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopper(**kwargs)
