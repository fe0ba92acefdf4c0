"""ThresholdStopper: stop training as soon as a monitored metric crosses a threshold."""

from __future__ import annotations

from collections.abc import Callable

from composerjax import Callback, Logger, State
from composerjax.callbacks.early_stopper import MetricReader, resolve_comparison

__all__ = ["ThresholdStopper"]


class ThresholdStopper(Callback):
    """Stop training once ``comp(value, threshold)`` holds for the monitored metric.

    Eval metrics are checked at every evaluation of the ``dataloader_label`` evaluator (``EVAL_END``): training
    stops after the batch or epoch whose evaluation crossed. Train values (``dataloader_label='train'``) are
    checked at ``EPOCH_END`` on the mean of the values logged during the epoch; with ``stop_on_batch`` every
    logged value is checked at ``BATCH_END`` instead. Train values reach the host when the trainer fetches them
    (every ``log_interval`` batches, one interval behind the newest step), so a batch-level stop comes at the
    first batch end after the crossing value was fetched.

    Args:
        monitor: the metric's name (``'MulticlassAccuracy'``; ``'loss'`` or a step metric for train values).
        dataloader_label: ``'eval'`` (``state.metrics['eval']``), ``'train'`` (logged train values) or
            another key of ``state.metrics``.
        threshold: the value to cross.
        comp: ``'greater'``/``'less'`` (``'gt'``, ``'lt'``, and here also ``'>'``, ``'ge'``, ...) or a function
            ``f(value, threshold) -> bool``; by default 'less' for loss-like names, else 'greater'
            (stop when accuracy exceeds the threshold, or when the loss falls below it).
        stop_on_batch: for train values, check every logged value at batch end rather than the
            epoch's mean at epoch end.

    Example::

        trainer = Trainer(model, train_loader, max_duration='100ep', eval_dataloader=val_loader,
                          callbacks=[ThresholdStopper('MulticlassAccuracy', 'eval', threshold=0.95)])
    """

    def __init__(
        self,
        monitor: str,
        dataloader_label: str = "eval",
        threshold: float | None = None,
        *,
        comp: str | Callable[[float, float], bool] | None = None,
        stop_on_batch: bool = False,
    ) -> None:
        self.reader = MetricReader(monitor, dataloader_label, "ThresholdStopper")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise ValueError(f"ThresholdStopper(threshold={threshold!r}): expected the number the metric must cross")
        if not isinstance(stop_on_batch, bool):
            raise ValueError(f"ThresholdStopper(stop_on_batch={stop_on_batch!r}): expected True or False")
        self.threshold = float(threshold)
        self.comp = resolve_comparison(comp, monitor, "ThresholdStopper")
        self.stop_on_batch = stop_on_batch

    def fit_start(self, state: State, logger: Logger) -> None:
        self.reader.attach(logger)

    def eval_end(self, state: State, logger: Logger) -> None:
        if not self.reader.is_train and state.dataloader_label == self.reader.dataloader_label:
            self._check(state, [self.reader.eval_value(state)])

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.stop_on_batch and self.reader.is_train:
            self._check(state, self.reader.train_values())

    def epoch_end(self, state: State, logger: Logger) -> None:
        if not self.reader.is_train:
            return
        values = self.reader.train_values()
        if self.stop_on_batch:
            self._check(state, values)
        elif values:
            self._check(state, [sum(values) / len(values)])

    def _check(self, state: State, values: list[float]) -> None:
        if any(self.comp(value, self.threshold) for value in values):
            state.stop_training()
