"""Closing a Trainer: ``with trainer:``, the exit hook for Trainers never closed, and how runs end.

What reaches real trackers when a script exits or is signalled is tested end to end, with fresh
processes, in ``tests/loggers/test_tracker_readback.py``.
"""

import gc
import signal
import sys
import weakref

import optax
import pytest

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.loggers import LoggerDestination
from composerjax.loggers.logger import RunOutcome, closing_outcome
from composerjax.trainer import TrainingInterrupted, exit_hook


class RecordClose(LoggerDestination):
    """Records what it sees when closed: the exception being handled, and how a tracker would end the run."""

    def __init__(self, closed: list | None = None, name: str = "") -> None:
        self.closed = closed if closed is not None else []
        self.name = name
        self.handled: type | None = None
        self.outcome: RunOutcome | None = None
        self.failed = False

    def fit_error(self, state, logger, error):
        self.failed = True

    def post_close(self):
        self.handled = sys.exc_info()[0]
        self.outcome = closing_outcome(self.failed)
        self.closed.append(self.name)


class FailAtBatch2(Callback):
    def batch_end(self, state, logger):
        if state.timestamp.batch.value == 2:
            raise RuntimeError("boom")


@pytest.fixture
def make_trainer(classification_arrays, make_tiny_classifier):
    def make(*loggers, callbacks=()):
        x, y = classification_arrays
        return Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="4ba",
                       optimizers=optax.sgd(0.1), loggers=list(loggers), callbacks=list(callbacks), log_interval=1,
                       progress_bar=False, run_summary=False)

    return make


def test_a_with_block_gives_the_trainer_and_closes_it(make_trainer):
    recorder = RecordClose()
    trainer = make_trainer(recorder)
    assert trainer in exit_hook.open_trainers()
    with trainer as entered:
        assert entered is trainer
        trainer.fit()
        assert not trainer.engine.closed
    assert trainer.engine.closed and recorder.closed == [""]
    assert recorder.handled is None and recorder.outcome == RunOutcome("finished", 0)
    assert trainer not in exit_hook.open_trainers()


def test_an_exception_leaving_the_with_block_propagates_and_the_run_ends_failed(make_trainer):
    recorder = RecordClose()
    with pytest.raises(ValueError, match="after fit"):
        with make_trainer(recorder) as trainer:
            trainer.fit()
            raise ValueError("after fit")
    assert trainer.engine.closed
    assert recorder.handled is ValueError and recorder.outcome == RunOutcome("failed", 1)


def test_a_fit_that_failed_inside_the_with_block_ends_the_run_failed(make_trainer):
    recorder = RecordClose()
    with pytest.raises(RuntimeError, match="boom"):
        with make_trainer(recorder, callbacks=[FailAtBatch2()]) as trainer:
            trainer.fit()
    assert recorder.failed and recorder.outcome == RunOutcome("failed", 1)


def test_a_trainer_nobody_holds_is_garbage_collected_and_forgotten(make_trainer):
    trainer = make_trainer(RecordClose())
    collected = weakref.ref(trainer)
    assert trainer in exit_hook.open_trainers()
    del trainer
    gc.collect()
    assert collected() is None  # the exit hook holds it weakly


def test_at_exit_the_open_trainers_are_closed_newest_first_even_if_one_fails(make_trainer, monkeypatch, capsys):
    closed = []
    older, failing, newer = (make_trainer(RecordClose(closed, "older")), make_trainer(RecordClose(closed, "failing")),
                             make_trainer(RecordClose(closed, "newer")))
    already = make_trainer(RecordClose(closed, "already"))
    already.close()
    closed.clear()
    monkeypatch.setattr(failing, "close", lambda: (_ for _ in ()).throw(OSError("disk gone")))
    others = [t for t in exit_hook.open_trainers() if t not in (older, failing, newer)]
    for other in others:  # trainers other tests left open are not closed by this test
        exit_hook.forget(other)
    try:
        exit_hook.close_open_trainers()
    finally:
        for other in others:
            exit_hook.register(other)
    assert closed == ["newer", "older"]
    err = capsys.readouterr().err
    assert f"closing Trainer {failing.state.run_name!r} at exit failed:" in err and "OSError: disk gone" in err
    assert [t for t in exit_hook.open_trainers() if t in (older, failing, newer, already)] == []


def test_closing_outcome_reads_the_exception_being_handled():
    assert closing_outcome() == RunOutcome("finished", 0)
    assert closing_outcome(failed=True) == RunOutcome("failed", 1)
    for error, expected in [(TrainingInterrupted(signal.SIGTERM), RunOutcome("interrupted", 143)),
                            (TrainingInterrupted(signal.SIGINT), RunOutcome("interrupted", 130)),
                            (KeyboardInterrupt(), RunOutcome("interrupted", 130)),
                            (SystemExit(0), RunOutcome("finished", 0)),
                            (SystemExit(2), RunOutcome("failed", 1)),
                            (RuntimeError("x"), RunOutcome("failed", 1))]:
        try:
            raise error
        except BaseException:
            assert closing_outcome() == expected, error
