"""Evaluators: a labelled eval dataloader with its metrics, batch limit and interval, as Composer's.

``Trainer(eval_dataloader=...)`` takes a loader, an :class:`Evaluator`, a list of evaluators or a
``{label: loader}`` dict; each evaluator's metrics are logged as ``metrics/<label>/<MetricName>``.
:func:`evaluate_periodically` turns an ``eval_interval`` into the ``(state, event) -> bool`` rule
the trainer asks at ``BATCH_END``, ``EPOCH_END`` and ``FIT_END``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from composerjax.core.event import Event
from composerjax.core.time import Time, TimeUnit
from composerjax.core.timestamp import UNIT_FIELDS

__all__ = ["Evaluator", "ensure_evaluators", "evaluate_periodically"]

IntervalRule = Callable[[Any, Event], bool]


class Evaluator:
    """A labelled eval dataloader: which metrics, how many batches, and how often during ``fit``.

    Args:
        label: the name metrics are logged under: ``metrics/<label>/<MetricName>``.
        dataloader: any re-iterable of batches (an ``ArrayLoader``, a list of batches, ...).
        metric_names: regular expressions matched (``re.match``) against the names of the
            model's ``get_metrics(is_train=False)``; every metric when None.
        subset_num_batches: evaluate on at most this many batches; None takes the Trainer's
            ``eval_subset_num_batches``, -1 the whole loader.
        eval_interval: how often to evaluate during ``fit``: an int (epochs), a time string or
            :class:`Time` in any unit (``'1ep'``, ``'500ba'``, ``'10000sp'``, ``'0.25dur'``), or a
            callable ``(state, event) -> bool`` asked at ``BATCH_END``, ``EPOCH_END`` and
            ``FIT_END``; 0 disables; None takes the Trainer's ``eval_interval``. Intervals also
            evaluate at the end of ``fit`` when the last evaluation did not fall on its last batch.

    Example:
        >>> import numpy as np
        >>> batches = [(np.zeros((4, 2), np.float32), np.zeros(4, np.int32))]
        >>> evaluator = Evaluator("val", batches, metric_names=["MulticlassAccuracy"], eval_interval="100ba")
        >>> evaluator.label, evaluator.eval_interval.__name__
        ('val', 'batch_interval_100ba')
    """

    def __init__(self, label: str, dataloader: Iterable[Any], metric_names: list[str] | None = None,
                 subset_num_batches: int | None = None,
                 eval_interval: int | str | Time | IntervalRule | None = None) -> None:
        if not isinstance(label, str) or not label or "/" in label:
            raise ValueError(f"Evaluator(label={label!r}): expected a non-empty string without '/' (it names "
                             "the metrics: metrics/<label>/<name>)")
        if dataloader is None or not hasattr(dataloader, "__iter__"):
            raise ValueError(f"Evaluator(label={label!r}, dataloader={dataloader!r}): expected a re-iterable of "
                             "batches (an ArrayLoader, a list of batches, ...)")
        if metric_names is not None and (isinstance(metric_names, str) or not isinstance(metric_names, (list, tuple))
                                         or not all(isinstance(name, str) for name in metric_names)):
            raise ValueError(f"Evaluator(label={label!r}, metric_names={metric_names!r}): expected a list of metric "
                             "names or regular expressions, or None for every metric")
        if subset_num_batches is not None and (isinstance(subset_num_batches, bool)
                                               or not isinstance(subset_num_batches, int)
                                               or subset_num_batches == 0 or subset_num_batches < -1):
            raise ValueError(f"Evaluator(label={label!r}, subset_num_batches={subset_num_batches!r}): expected a "
                             "positive number of batches, -1 for the whole loader, or None")
        self.label = label
        self.dataloader = dataloader
        self.metric_names = list(metric_names) if metric_names is not None else None
        self.subset_num_batches = subset_num_batches
        self.eval_interval = eval_interval  # type: ignore[assignment]

    @property
    def eval_interval(self) -> IntervalRule | None:
        """The rule ``(state, event) -> bool`` deciding when to evaluate during fit (None: the Trainer's)."""
        return self._eval_interval

    @eval_interval.setter
    def eval_interval(self, value: int | str | Time | IntervalRule | None) -> None:
        if value is None or callable(value) and not isinstance(value, (str, Time)):
            self._eval_interval = value
        else:
            self._eval_interval = evaluate_periodically(value, field=f"Evaluator({self.label!r}).eval_interval")

    def __repr__(self) -> str:
        return f"Evaluator(label={self.label!r}, metric_names={self.metric_names!r})"


def _is_loader(value: Any) -> bool:
    """A dataloader, as opposed to a batch: iterable, and not a tuple/list/dict/array of arrays."""
    return (hasattr(value, "__iter__") and not isinstance(value, (tuple, list, dict, str, bytes, np.ndarray))
            and not hasattr(value, "shape"))


def ensure_evaluators(eval_dataloader: Any, field: str = "eval_dataloader") -> list[Evaluator]:
    """Normalise ``eval_dataloader`` (a loader, an Evaluator, a list of them or ``{label: loader}``).

    A single loader becomes ``Evaluator('eval', loader)``. A list holding Evaluators or loaders is
    a list of evaluators (a plain loader in it is labelled ``'eval'``); any other list is one
    loader of batches. Labels must be unique.

    Raises:
        ValueError: naming ``field``, the offending entry and what is accepted.

    Example:
        >>> import numpy as np
        >>> batch = (np.zeros((2, 2), np.float32), np.zeros(2, np.int32))
        >>> [e.label for e in ensure_evaluators({"val": [batch], "test": [batch]})]
        ['val', 'test']
    """
    if eval_dataloader is None:
        return []
    if isinstance(eval_dataloader, Evaluator):
        evaluators = [eval_dataloader]
    elif isinstance(eval_dataloader, Mapping):
        evaluators = []
        for label, loader in eval_dataloader.items():
            if isinstance(loader, Evaluator):
                raise ValueError(f"{field}[{label!r}] is an Evaluator; pass Evaluators in a list, or loaders in a "
                                 "{label: loader} dict")
            evaluators.append(Evaluator(label, loader))
    elif isinstance(eval_dataloader, (list, tuple)) and eval_dataloader and all(
            isinstance(item, Evaluator) or _is_loader(item) for item in eval_dataloader):
        evaluators = [item if isinstance(item, Evaluator) else Evaluator("eval", item) for item in eval_dataloader]
    else:
        evaluators = [Evaluator("eval", eval_dataloader)]
    labels = [e.label for e in evaluators]
    repeated = sorted({label for label in labels if labels.count(label) > 1})
    if repeated:
        raise ValueError(f"{field}: the label(s) {repeated} name more than one evaluator; give each loader its own "
                         "label with Evaluator(label, loader) or a {label: loader} dict")
    return evaluators


def evaluate_periodically(eval_interval: int | str | Time, field: str = "eval_interval") -> IntervalRule:
    """The rule deciding when to evaluate during fit, as Composer's ``create_interval_scheduler``.

    With an interval in ``ep`` it answers True at ``EPOCH_END`` when the epoch count crosses a
    multiple of it; in ``ba``, ``sp``, ``tok`` or ``sec`` at ``BATCH_END`` when that counter
    crosses a multiple; in ``dur`` at ``BATCH_END`` every ``ceil(interval * max_duration)``
    batches (or samples, for an ``sp`` max_duration); in ``iter`` at ``ITERATION_END``. At
    ``FIT_END`` it answers True once training is complete (``max_duration`` reached) unless its
    last evaluation was at the last batch. An interval of 0 never evaluates.

    Raises:
        ValueError: naming ``field`` and the value, for a negative or unparsable interval.

    Example:
        >>> rule = evaluate_periodically("2ep")
        >>> rule.__name__
        'epoch_interval_2ep'
    """
    try:
        interval = Time.from_input(eval_interval, TimeUnit.EPOCH)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}={eval_interval!r}: {error}") from error
    unit, every = interval.unit, interval.value
    if every < 0 or (unit is TimeUnit.DURATION and every > 1):
        raise ValueError(f"{field}={eval_interval!r}: expected a non-negative interval (at most 1 in 'dur'; 0 "
                         "disables evaluation)")
    event_of_unit = (Event.EPOCH_END if unit is TimeUnit.EPOCH else
                     Event.ITERATION_END if unit is TimeUnit.ITERATION else Event.BATCH_END)
    last_batch_seen = -1

    def rule(state: Any, event: Event) -> bool:
        nonlocal last_batch_seen
        if every == 0:
            return False
        previous, now = state.previous_timestamp, state.timestamp
        if previous is None or state.max_duration is None:
            return False
        batch = now.counts.batch  # plain numbers: this runs every batch
        if event is Event.FIT_END:
            if state.get_elapsed_duration() >= 1.0 and batch != last_batch_seen:
                last_batch_seen = batch
                return True
            return False
        if event is not event_of_unit:
            return False
        if unit is TimeUnit.DURATION:
            due = _duration_due(state, every, previous, now)
        else:
            before, after = getattr(previous.counts, UNIT_FIELDS[unit]), getattr(now.counts, UNIT_FIELDS[unit])
            due = math.floor(before / every) != math.floor(after / every)
        if due:
            last_batch_seen = batch
        return due

    rule.__name__ = f"{_RULE_NAMES[event_of_unit]}_{interval}"
    rule.interval = interval  # type: ignore[attr-defined]  # read by EvalRunner.next_due
    return rule


_RULE_NAMES = {Event.EPOCH_END: "epoch_interval", Event.ITERATION_END: "iteration_interval",
               Event.BATCH_END: "batch_interval"}


def _duration_due(state: Any, fraction: float, previous: Any, now: Any) -> bool:
    """Whether a ``dur`` interval falls on this batch (Composer's rule, per unit of max_duration)."""
    duration = state.max_duration
    if duration.unit is TimeUnit.EPOCH:
        if not state.dataloader_len:
            raise ValueError(f"eval_interval in 'dur' with max_duration={duration} needs a train dataloader "
                             "with a length")
        period = math.ceil(duration.value * fraction * state.dataloader_len)
        return period > 0 and now.counts.batch % period == 0
    if duration.unit is TimeUnit.BATCH:
        period = math.ceil(duration.value * fraction)
        return period > 0 and now.counts.batch % period == 0
    period = math.ceil(duration.value * fraction)
    if period <= 0:
        return False
    before, after = previous.get(duration.unit).value, now.get(duration.unit).value
    return math.floor(before / period) != math.floor(after / period)
