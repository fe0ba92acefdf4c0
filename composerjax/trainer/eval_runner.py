"""EvalRunner: evaluation during ``fit``, as a callback on BATCH_END and EPOCH_END."""

from __future__ import annotations

from typing import Any

from composerjax.core.callback import Callback
from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp, TimeUnit

__all__ = ["EvalRunner"]


class EvalRunner(Callback):
    """Evaluate every ``eval_interval`` during ``fit`` (Composer's position: after BATCH_END / EPOCH_END).

    The Trainer installs one when it has an ``eval_dataloader``; pass your own in ``callbacks``
    to choose when (and on which data) it evaluates. It runs after the other callbacks of the
    event, so the checkpoint event that follows sees the metrics. Each evaluation is a trace
    (``EvalRunner/BATCH_END`` or ``EvalRunner/EPOCH_END``) with its duration.

    Args:
        eval_interval: a positive number of epochs or batches (``'1ep'``, ``'100ba'``; an int
            counts epochs).
        dataloader: the data to evaluate on (default: the Trainer's ``eval_dataloader``).

    Example::

        trainer = Trainer(model, loader, max_duration="2ep", eval_dataloader=val,
                          callbacks=[EvalRunner("50ba")])
    """

    accepts_grouped_batches = True
    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self, eval_interval: Time | str | int = "1ep", dataloader: Any = None) -> None:
        from composerjax.trainer.validation import check_interval

        try:
            interval = eval_interval if isinstance(eval_interval, Time) else Time.from_input(eval_interval,
                                                                                              TimeUnit.EPOCH)
        except (TypeError, ValueError) as error:
            raise ValueError(f"eval_interval: {error}") from error
        check_interval(interval, "eval_interval", given=eval_interval)
        self.eval_interval = interval
        self.dataloader = dataloader
        self._evaluate: Any = None

    def attach_trainer(self, trainer: Any) -> None:
        """Evaluate through ``trainer`` (its pending logs flushed first)."""
        self._evaluate = trainer._eval_during_fit

    def next_due(self, timestamp: Timestamp) -> int | None:
        """The next batch count an evaluation falls on (grouped calls stop there)."""
        if self.eval_interval.unit != TimeUnit.BATCH:
            return None
        every = int(self.eval_interval.value)
        return (timestamp.batch // every + 1) * every

    def due(self, counter: int, unit: TimeUnit) -> bool:
        """Whether an evaluation falls on ``counter`` batches or epochs done."""
        return self.eval_interval.unit == unit and counter > 0 and counter % int(self.eval_interval.value) == 0

    def batch_end(self, state: State, logger: Any) -> bool:
        if not self.due(state.timestamp.batch, TimeUnit.BATCH):
            return False
        self._evaluate(self.dataloader)
        return True

    def epoch_end(self, state: State, logger: Any) -> bool:
        if not self.due(state.timestamp.epoch, TimeUnit.EPOCH):
            return False
        self._evaluate(self.dataloader)
        return True
