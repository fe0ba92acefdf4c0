"""EarlyStopper: stop training when a monitored metric has not improved for a while.

Also holds what both stoppers (this one and ``ThresholdStopper``) need to read a metric: eval metrics
from ``state.metrics`` at ``EVAL_END``, train values from what the trainer logs.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from composerjax import Callback, Logger, LoggerDestination, State, Time, TimeUnit

__all__ = ["COMPARISONS", "EarlyStopper", "LoggedValues", "MetricReader", "resolve_comparison"]

#: Accepted ``comp`` names: ``comp(value, reference)`` is True when ``value`` is better. Composer takes
#: 'greater'/'gt' and 'less'/'lt'; the others are this project's additions.
COMPARISONS: dict[str, Callable[[float, float], bool]] = {
    "greater": operator.gt, "gt": operator.gt, ">": operator.gt,
    "less": operator.lt, "lt": operator.lt, "<": operator.lt,
    "greater_equal": operator.ge, "ge": operator.ge, ">=": operator.ge,
    "less_equal": operator.le, "le": operator.le, "<=": operator.le,
}

# Metrics whose names contain one of these are better when lower.
_LOWER_IS_BETTER = ("loss", "error", "perplexity", "cross_entropy", "crossentropy")


def resolve_comparison(comp: str | Callable[[float, float], bool] | None, monitor: str,
                       owner: str = "comparison") -> Callable[[float, float], bool]:
    """The comparison function for a stopper's ``comp``; ``None`` picks 'less' for loss-like metrics, else 'greater'.

    Example:
        >>> resolve_comparison(None, 'CrossEntropy')(0.5, 0.7), resolve_comparison(None, 'MulticlassAccuracy')(0.5, 0.7)
        (True, False)
    """
    if comp is None:
        lower = any(word in monitor.lower() for word in _LOWER_IS_BETTER)
        return operator.lt if lower else operator.gt
    if callable(comp):
        return comp
    if isinstance(comp, str) and comp.lower() in COMPARISONS:
        return COMPARISONS[comp.lower()]
    raise ValueError(f"{owner}(comp={comp!r}): expected None (auto: 'less' for loss-like metrics, "
                     f"'greater' otherwise), a callable, or one of {sorted(COMPARISONS)}")


class LoggedValues(LoggerDestination):
    """A destination that keeps the values logged under the first of ``names`` found in each call.

    Example:
        >>> values = LoggedValues(('train/accuracy', 'accuracy'))
        >>> values.log_metrics({'accuracy': 0.5}, step=1)
        >>> values.take(), values.take()
        ([0.5], [])
    """

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self._values: list[float] = []

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name in self.names:
            if name in metrics:
                self._values.append(float(metrics[name]))
                return

    def take(self) -> list[float]:
        """Return the values logged since the last call."""
        values, self._values = self._values, []
        return values


class MetricReader:
    """Read the metric a stopper monitors.

    For ``dataloader_label='train'`` the values are the ones the trainer logs (fetched every
    ``log_interval`` batches and all before ``EPOCH_END``): ``monitor`` itself, ``train/<monitor>``
    (step metrics), ``loss/train/<monitor>``, and ``loss/train/total`` for ``monitor='loss'``. For
    any other label the value is ``state.metrics[label][monitor]`` (``'eval'``: the trainer's eval).

    Example:
        >>> MetricReader('loss', 'train').train_names
        ('loss', 'train/loss', 'loss/train/loss', 'loss/train/total')
    """

    def __init__(self, monitor: str, dataloader_label: str, owner: str = "MetricReader") -> None:
        if not isinstance(monitor, str) or not monitor:
            raise ValueError(f"{owner}(monitor={monitor!r}): expected the name of a metric, e.g. 'MulticlassAccuracy'")
        if not isinstance(dataloader_label, str) or not dataloader_label:
            raise ValueError(f"{owner}(dataloader_label={dataloader_label!r}): expected 'eval' (the trainer's "
                             "eval metrics), 'train' (logged train values) or another key of state.metrics")
        self.monitor = monitor
        self.dataloader_label = dataloader_label
        self.owner = owner
        self.train_names = (monitor, f"train/{monitor}", f"loss/train/{monitor}") + (
            ("loss/train/total",) if monitor == "loss" else ())
        self.logged = LoggedValues(self.train_names)

    @property
    def is_train(self) -> bool:
        """Whether the metric is a logged train value."""
        return self.dataloader_label == "train"

    def attach(self, logger: Logger) -> None:
        """For train metrics, start receiving what the trainer logs (once)."""
        if self.is_train and self.logged not in logger.destinations:
            logger.destinations.append(self.logged)

    def eval_value(self, state: State) -> float:
        """``state.metrics[dataloader_label][monitor]`` as a float.

        Raises:
            ValueError: naming the labels or metrics there are when it is missing.
        """
        metrics = state.metrics.get(self.dataloader_label)
        if metrics is None:
            raise ValueError(f"{self.owner}(dataloader_label={self.dataloader_label!r}): state.metrics has no such "
                             f"entry; there are {sorted(state.metrics)}")
        if self.monitor not in metrics:
            raise ValueError(f"{self.owner}(monitor={self.monitor!r}): state.metrics[{self.dataloader_label!r}] "
                             f"has no such metric; there are {sorted(metrics)}")
        return float(metrics[self.monitor])

    def train_values(self) -> list[float]:
        """The train values logged since the last call, oldest first."""
        return self.logged.take()


def _patience(patience: int | str | Time) -> Time:
    if isinstance(patience, int) and not isinstance(patience, bool):
        if patience < 0:
            raise ValueError(f"EarlyStopper(patience={patience!r}): expected a non-negative number of epochs")
        return Time(patience, TimeUnit.EPOCH)
    try:
        time = patience if isinstance(patience, Time) else Time.from_timestring(patience)
    except (TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"EarlyStopper(patience={patience!r}): expected an int (epochs) or a time in 'ep' or "
                         "'ba' such as '2ep' or '500ba'") from error
    if time.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or time.value < 0:
        raise ValueError(f"EarlyStopper(patience={patience!r}): expected an int (epochs) or a non-negative time in "
                         "'ep' or 'ba' such as '2ep' or '500ba'")
    return time


class EarlyStopper(Callback):
    """Stop training once ``monitor`` has gone more than ``patience`` without improving.

    At every evaluation of the ``dataloader_label`` evaluator (``EVAL_END``; for ``dataloader_label='train'`` at
    ``EPOCH_END`` on the mean of the values logged during the epoch, or at every ``BATCH_END`` on each newly
    fetched value when ``patience`` is in batches) the value is compared with the best so far; it improves when
    ``comp(value, best)`` holds and it differs from the best by more than ``min_delta``. When the time since the
    best (in the unit of ``patience``) exceeds ``patience``, ``state.stop_training()`` ends training after the
    current batch or epoch.

    Args:
        monitor: the metric's name, e.g. ``'MulticlassAccuracy'``, ``'CrossEntropy'``, or for train values
            ``'loss'`` or a step metric's name.
        dataloader_label: ``'eval'`` for the trainer's eval metrics (``state.metrics['eval']``),
            ``'train'`` for logged train values, or another key of ``state.metrics``.
        comp: ``'greater'``/``'less'`` (``'gt'``, ``'lt'``, and here also ``'>'``, ``'ge'``, ...) or a
            function ``f(value, best) -> bool``; by default 'less' for names with loss, error, perplexity
            (as Composer) or cross_entropy/crossentropy (an addition: Composer's default would maximise
            ``CrossEntropy``) in them, else 'greater'.
        min_delta: the smallest change that counts as an improvement.
        patience: how long the metric may fail to improve: an int (epochs) or a time in 'ep' or
            'ba' (``'500ba'``).

    Example::

        trainer = Trainer(model, train_loader, max_duration='100ep', eval_dataloader=val_loader,
                          callbacks=[EarlyStopper('MulticlassAccuracy', 'eval', patience=3)])
    """

    def __init__(
        self,
        monitor: str = "MulticlassAccuracy",
        dataloader_label: str = "eval",
        comp: str | Callable[[float, float], bool] | None = None,
        min_delta: float = 0.0,
        patience: int | str | Time = 1,
    ) -> None:
        self.reader = MetricReader(monitor, dataloader_label, "EarlyStopper")
        self.comp = resolve_comparison(comp, monitor, "EarlyStopper")
        if isinstance(min_delta, bool) or not isinstance(min_delta, (int, float)) or min_delta < 0:
            raise ValueError(f"EarlyStopper(min_delta={min_delta!r}): expected a non-negative number")
        self.min_delta = float(min_delta)
        self.patience = _patience(patience)
        self.best: float | None = None
        self.best_epoch = 0
        self.best_batch = 0

    def fit_start(self, state: State, logger: Logger) -> None:
        self.reader.attach(logger)

    def eval_end(self, state: State, logger: Logger) -> None:
        if not self.reader.is_train and state.dataloader_label == self.reader.dataloader_label:
            self._update(state, self.reader.eval_value(state))

    def batch_end(self, state: State, logger: Logger) -> None:
        # Composer checks train metrics at every batch end when the patience is in batches.
        if self.reader.is_train and self.patience.unit == TimeUnit.BATCH:
            for value in self.reader.train_values():
                self._update(state, value)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.reader.is_train and self.patience.unit == TimeUnit.EPOCH:
            values = self.reader.train_values()
            if values:
                self._update(state, sum(values) / len(values))

    def _update(self, state: State, value: float) -> None:
        timestamp = state.timestamp
        best = self.best
        if best is None or (self.comp(value, best) and abs(value - best) > self.min_delta):
            self.best, self.best_epoch, self.best_batch = value, timestamp.epoch.value, timestamp.batch.value
            return
        if self.patience.unit == TimeUnit.EPOCH:
            waited = timestamp.epoch.value - self.best_epoch
        else:
            waited = timestamp.batch.value - self.best_batch
        if waited > self.patience.value:
            state.stop_training()

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "best_batch": self.best_batch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = state["best"]
        self.best_epoch = int(state["best_epoch"])
        self.best_batch = int(state["best_batch"])
