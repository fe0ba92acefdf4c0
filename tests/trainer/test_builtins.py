"""The Trainer's own features are plugins: installed from its arguments, traced, replaceable, removable."""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Event, Trainer
from composerjax.callbacks import CheckpointSaver, EvalRunner, SignalHandler, TimeLimit
from composerjax.core.time import Time, Timestamp

X = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def make(**kwargs) -> Trainer:
    kwargs.setdefault("max_duration", "2ep")
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((X, Y), batch_size=16),
                   optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False, **kwargs)


def builtins(trainer: Trainer) -> list[str]:
    return [type(c).__name__ for c in trainer.state.callbacks
            if type(c).__module__.startswith(("composerjax.trainer", "composerjax.checkpoint"))]


class Marker(Callback):
    def __init__(self) -> None:
        self.seen = []

    def run_event(self, event, state, logger) -> None:
        if event in (Event.BATCH_END, Event.BATCH_CHECKPOINT, Event.EPOCH_END, Event.EPOCH_CHECKPOINT):
            self.seen.append((event.name, state.timestamp.batch))


def test_the_arguments_install_the_built_ins_after_the_users_callbacks(tmp_path):
    marker = Marker()
    trainer = make(callbacks=[marker], save_folder=str(tmp_path), save_interval="2ba",
                   eval_dataloader=ArrayLoader((X, Y), batch_size=32), eval_interval="4ba", time_limit="1h")
    assert trainer.state.callbacks[0] is marker
    assert builtins(trainer) == ["CheckpointSaver", "EvalRunner", "TimeLimit", "SignalHandler"]
    assert builtins(make(handle_signals=False)) == []
    trainer.fit()
    trainer.close()
    traces = [(t.name, t.event.name, t.batch) for t in trainer.engine.trace_log]
    assert traces == [("CheckpointSaver", "BATCH_CHECKPOINT", 2), ("EvalRunner", "BATCH_END", 4),
                      ("CheckpointSaver", "EPOCH_CHECKPOINT", 4), ("CheckpointSaver", "BATCH_CHECKPOINT", 6),
                      ("EvalRunner", "BATCH_END", 8), ("CheckpointSaver", "EPOCH_CHECKPOINT", 8)]
    assert all(t.duration_s is not None and t.duration_s > 0 for t in trainer.engine.trace_log)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ep")) == ["ep0-ba2", "ep1-ba4", "ep1-ba6",
                                                                                     "ep2-ba8"]


def test_a_users_own_instance_replaces_the_default(tmp_path):
    saver, runner = CheckpointSaver(tmp_path / "mine", save_interval="3ba"), EvalRunner("5ba")
    trainer = make(callbacks=[saver, runner], eval_dataloader=ArrayLoader((X, Y), batch_size=32))
    assert builtins(trainer) == ["CheckpointSaver", "EvalRunner", "SignalHandler"]
    assert trainer.checkpointer is saver.checkpointer
    trainer.fit()
    trainer.close()
    assert sorted(p.name for p in (tmp_path / "mine").iterdir() if p.name.startswith("ep")) == ["ep0-ba3", "ep1-ba6",
                                                                                              "ep2-ba8"]
    # Not the default '1ep': batch 5, and batch 8 at FIT_END (Composer: the run ended off-interval).
    assert [(t.event.name, t.batch) for t in trainer.engine.trace_log if t.name == "EvalRunner"] == [
        ("BATCH_END", 5), ("FIT_END", 8)]
    with pytest.raises(ValueError, match="save_folder=.* and a CheckpointSaver in callbacks"):
        make(save_folder=str(tmp_path / "other"), callbacks=[CheckpointSaver(tmp_path / "third")])


def test_a_built_in_can_be_removed_like_any_callback(tmp_path):
    trainer = make(eval_dataloader=ArrayLoader((X, Y), batch_size=32))
    trainer.state.callbacks[:] = [c for c in trainer.state.callbacks if not isinstance(c, EvalRunner)]
    trainer.fit()
    assert "eval" not in trainer.state.metrics and not trainer.engine.trace_log
    assert trainer.eval()["MulticlassAccuracy"] >= 0  # evaluating by hand still works


def test_next_due_names_the_batch_a_save_or_an_eval_falls_on():
    assert CheckpointSaver("unused", save_interval="4ba").next_due(Timestamp(batch=5)) == 8
    assert CheckpointSaver("unused", save_interval="4ba").next_due(Timestamp(batch=8)) == 12
    assert CheckpointSaver("unused", save_interval="1ep").next_due(Timestamp(batch=5)) is None
    batches = [(X[:8], Y[:8])]
    assert EvalRunner("3ba", dataloader=batches).next_due(Timestamp(batch=0)) == 3
    assert EvalRunner("3ba").next_due(Timestamp(batch=0)) is None  # nothing to evaluate
    assert EvalRunner(Time(2, "ep"), dataloader=batches).next_due(Timestamp(batch=0)) is None
    assert EvalRunner("40sp", dataloader=batches).next_due(Timestamp(batch=4)) == 5  # decided batch by batch
    assert TimeLimit("1h").next_due(Timestamp()) is None and TimeLimit("1h").seconds == 3600.0


def test_bad_built_in_arguments_name_the_field():
    with pytest.raises(ValueError, match="save_interval='1tok'"):
        CheckpointSaver("unused", save_interval="1tok")
    with pytest.raises(ValueError, match="eval_interval='2dur'"):
        EvalRunner("2dur")
    with pytest.raises(ValueError, match="time_limit='5ep'"):
        TimeLimit("5ep")
    with pytest.raises(ValueError, match="save_num_checkpoints_to_keep=0"):
        CheckpointSaver("unused", num_checkpoints_to_keep=0)


def test_signal_handler_restores_the_previous_handlers_after_fit():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    trainer = make()
    handler = next(c for c in trainer.state.callbacks if isinstance(c, SignalHandler))
    trainer.fit()
    assert signal.getsignal(signal.SIGTERM) is before and handler._previous == {}
