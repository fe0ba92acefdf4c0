"""EvalRunner: evaluation during ``fit``, as a callback on BATCH_END, EPOCH_END, ITERATION_END and FIT_END."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from composerjax.core.callback import Callback
from composerjax.core.evaluator import Evaluator, ensure_evaluators, evaluate_periodically
from composerjax.core.event import Event
from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp, TimeUnit

__all__ = ["EvalRunner"]


class EvalRunner(Callback):
    """Run the evaluators whose interval falls now, in Composer's position, between EVAL_BEFORE_ALL and EVAL_AFTER_ALL.

    The Trainer installs one when it has an ``eval_dataloader``; pass your own in ``callbacks`` to
    choose when (and on which data) it evaluates. At ``BATCH_END``, ``EPOCH_END`` and
    ``ITERATION_END`` (after the other callbacks of the event, so the checkpoint event that
    follows sees the metrics) and at ``FIT_END`` it asks each evaluator's interval rule (see
    :func:`~composerjax.core.evaluator.evaluate_periodically`); if any says yes, it runs
    ``EVAL_BEFORE_ALL``, those evaluators (each ``EVAL_START`` ... ``EVAL_END``) and
    ``EVAL_AFTER_ALL``. Each evaluation is a trace (``EvalRunner/BATCH_END``, ...) with its duration.

    Args:
        eval_interval: the interval of evaluators that have none of their own: an int (epochs), a
            time in any unit (``'1ep'``, ``'100ba'``, ``'5000sp'``, ``'0.25dur'``) or a callable
            ``(state, event) -> bool``; 0 disables.
        dataloader: evaluate this loader (an ``Evaluator``, a list of them, or a ``{label: loader}``
            dict) instead of the Trainer's ``eval_dataloader``.

    Example::

        trainer = Trainer(model, loader, max_duration="2ep", eval_dataloader=val,
                          callbacks=[EvalRunner("50ba")])
    """

    accepts_grouped_batches = True
    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self, eval_interval: int | str | Time | Any = 1, dataloader: Any = None) -> None:
        if callable(eval_interval) and not isinstance(eval_interval, (str, Time)):
            self.eval_interval = eval_interval
        else:
            self.eval_interval = evaluate_periodically(eval_interval)
        self.evaluators: list[Evaluator] = ensure_evaluators(dataloader) if dataloader is not None else []
        self._own = dataloader is not None
        self._evaluate: Callable[[Sequence[Evaluator]], None] | None = None

    def bind(self, evaluate: Callable[[Sequence[Evaluator]], None], evaluators: list[Evaluator]) -> None:
        """Evaluate through ``evaluate`` (the trainer's), on ``evaluators`` unless this runner was given its own."""
        self._evaluate = evaluate
        if not self._own:
            self.evaluators = evaluators

    def rule(self, evaluator: Evaluator) -> Any:
        """When ``evaluator`` runs: its own ``eval_interval``, else this runner's."""
        return evaluator.eval_interval if evaluator.eval_interval is not None else self.eval_interval

    def next_due(self, timestamp: Timestamp) -> int | None:
        """The next batch count an evaluation may fall on (grouped calls stop there)."""
        due = None
        for evaluator in self.evaluators:
            interval = getattr(self.rule(evaluator), "interval", None)
            if interval is None:  # a callable: it may want any batch
                return timestamp.counts.batch + 1
            if interval.unit in (TimeUnit.EPOCH, TimeUnit.ITERATION) or interval.value == 0:
                continue
            if interval.unit is TimeUnit.BATCH:
                every = int(interval.value)
                nxt = (timestamp.counts.batch // every + 1) * every
            else:  # samples, tokens, seconds, fractions: decided batch by batch
                nxt = timestamp.counts.batch + 1
            due = nxt if due is None else min(due, nxt)
        return due

    def _run(self, state: State, event: Event) -> bool:
        if not self.evaluators:
            return False
        executing = [evaluator for evaluator in self.evaluators if self.rule(evaluator)(state, event)]
        if not executing:
            return False
        if self._evaluate is None:
            raise RuntimeError("EvalRunner: not bound to a Trainer (pass it in Trainer(callbacks=[...]))")
        self._evaluate(executing)
        return True

    def batch_end(self, state: State, logger: Any) -> bool:
        return self._run(state, Event.BATCH_END)

    def epoch_end(self, state: State, logger: Any) -> bool:
        return self._run(state, Event.EPOCH_END)

    def iteration_end(self, state: State, logger: Any) -> bool:
        return self._run(state, Event.ITERATION_END)

    def fit_end(self, state: State, logger: Any) -> bool:
        return self._run(state, Event.FIT_END)
