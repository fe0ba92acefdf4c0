"""The order of a run's events, written once: the fit loop, step grouping and ``explain`` all walk it.

A *driver* does the work at each point (run an event's plugins, fetch a batch, run the compiled
step); :func:`walk_fit` decides the order of a fit, and the tuples below the order of a batch,
an epoch's end, an evaluation and a prediction pass. The real loop
(``composerjax.trainer.fit_loop.FitLoop``) runs plugins and steps; ``composerjax explain`` walks the
same order with a driver that only asks ``match``; step grouping walks :data:`BATCH` to predict
what the next batches would run.
"""

from __future__ import annotations

from typing import Protocol

from composerjax.core.event import Event

__all__ = ["BATCH", "FETCH", "EPOCH_CLOSE", "EVAL_BATCH", "EVAL_CLOSE", "EVAL_DURING_FIT", "EVAL_OPEN",
           "EVAL_STANDALONE", "ITERATION_CLOSE", "PREDICT_BATCH", "PREDICT_CLOSE",
           "PREDICT_OPEN", "STEP", "FitDriver", "walk_fit"]

#: Where the compiled step runs inside :data:`BATCH` and :data:`EVAL_BATCH`.
STEP = "step"
#: Where the next batch is taken from the loader inside :data:`BATCH`.
FETCH = "fetch"

#: One training batch, in order: the host events around the loader and the compiled step (its
#: traced events run inside it). The timestamp moves to the next batch between ``STEP`` and
#: ``BATCH_END``.
BATCH: tuple[Event | str, ...] = (Event.BEFORE_DATALOADER, FETCH, Event.AFTER_DATALOADER, Event.BATCH_START, STEP,
                                  Event.BATCH_END, Event.BATCH_CHECKPOINT)

#: The host events of a batch before the step, and after it.
BEFORE_STEP: tuple[Event, ...] = (Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START)
AFTER_STEP: tuple[Event, ...] = (Event.BATCH_END, Event.BATCH_CHECKPOINT)
#: Every host event of a training batch.
BATCH_HOST_EVENTS: tuple[Event, ...] = BEFORE_STEP + AFTER_STEP

#: The end of an epoch, after its last batch (the timestamp has moved to the next epoch).
EPOCH_CLOSE: tuple[Event, ...] = (Event.EPOCH_END, Event.EPOCH_CHECKPOINT)
#: The end of an iteration (``state.iteration_length`` epochs), after its last epoch's close.
ITERATION_CLOSE: tuple[Event, ...] = (Event.ITERATION_END, Event.ITERATION_CHECKPOINT)

#: One evaluator's pass: the events before its batches, one batch, and the events after them.
EVAL_OPEN: tuple[Event, ...] = (Event.EVAL_START,)
EVAL_BATCH: tuple[Event | str, ...] = (Event.EVAL_BATCH_START, STEP, Event.EVAL_BATCH_END)
EVAL_CLOSE: tuple[Event, ...] = (Event.EVAL_END,)
#: Around the evaluators that run during ``fit`` (after BATCH_END / EPOCH_END, or at FIT_END), and
#: around a ``Trainer.eval()`` the user calls.
EVAL_DURING_FIT: tuple[Event, Event] = (Event.EVAL_BEFORE_ALL, Event.EVAL_AFTER_ALL)
EVAL_STANDALONE: tuple[Event, Event] = (Event.EVAL_STANDALONE_START, Event.EVAL_STANDALONE_END)

#: A prediction pass, likewise.
PREDICT_OPEN: tuple[Event, ...] = (Event.PREDICT_START,)
PREDICT_BATCH: tuple[Event | str, ...] = (Event.PREDICT_BATCH_START, STEP, Event.PREDICT_BATCH_END)
PREDICT_CLOSE: tuple[Event, ...] = (Event.PREDICT_END,)


class FitDriver(Protocol):
    """What :func:`walk_fit` asks of whoever runs (or only predicts) a fit."""

    def event(self, event: Event) -> None:
        """Run (or record) ``event``."""

    def done(self) -> bool:
        """Whether ``max_duration`` is reached."""

    def at_iteration_start(self) -> bool:
        """Whether no epoch of the current iteration has run yet (Composer's ITERATION_START rule)."""

    def at_epoch_start(self) -> bool:
        """Whether no batch of the current epoch has run yet."""

    def start_epoch(self) -> None:
        """Begin a pass over the train data."""

    def group(self) -> int:
        """How many batches the next compiled call may run at once (0 or 1: one batch, with its events)."""

    def batch_points(self) -> tuple[Event | str, ...]:
        """:data:`BATCH`, or the part of it that can do anything now (``FETCH`` and ``STEP`` always)."""

    def train_group(self, count: int) -> bool:
        """Run ``count`` batches as one call; False if the data ran out first."""

    def next_batch(self) -> bool:
        """Fetch the next batch; False at the end of the data."""

    def train_step(self) -> None:
        """Run the compiled step on the batch and move the timestamp to the next batch."""

    def epoch_complete(self) -> bool:
        """Whether the batch that just ran was the epoch's last."""

    def stop(self) -> bool:
        """After a batch or a group: whether training stops here (the same answer on every process)."""

    def end_epoch(self) -> None:
        """Close the epoch: move the timestamp to the next epoch."""

    def end_iteration(self) -> bool:
        """After an epoch's close: whether the iteration is complete (the timestamp then moves to the next)."""

    def end_fit(self) -> None:
        """Right before ``FIT_END``: the last chance to flush what the batches left pending."""


def walk_fit(driver: FitDriver) -> None:
    """Drive one ``fit``: FIT_START, epochs of batches with their events, FIT_END.

    Example::

        walk_fit(FitLoop(trainer))   # what Trainer.fit does
    """
    driver.event(Event.FIT_START)
    while not driver.done():
        if driver.at_iteration_start():
            driver.event(Event.ITERATION_START)
        if driver.at_epoch_start():
            driver.event(Event.EPOCH_START)
        epoch_ended = True
        driver.start_epoch()
        while True:
            count = driver.group()
            if count > 1:
                if not driver.train_group(count):
                    break
            else:
                ran = True
                for point in driver.batch_points():
                    if point is STEP:
                        driver.train_step()
                    elif point is FETCH:
                        if not driver.next_batch():
                            ran = False
                            break
                    else:
                        driver.event(point)  # type: ignore[arg-type]
                if not ran:
                    break
            if driver.epoch_complete():
                break
            if driver.stop():
                epoch_ended = False
                break
        if epoch_ended:
            driver.end_epoch()
            for event in EPOCH_CLOSE:
                driver.event(event)
            if driver.end_iteration():
                for event in ITERATION_CLOSE:
                    driver.event(event)
        if driver.stop():
            break
    driver.end_fit()
    driver.event(Event.FIT_END)
