"""RuntimeEstimator: estimate the wall-clock time left until ``max_duration`` from the progress so far."""

from __future__ import annotations

from time import perf_counter

from composerjax import Callback, Logger, State

__all__ = ["TIME_UNITS", "RuntimeEstimator"]

#: Seconds per accepted ``time_unit``.
TIME_UNITS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


class RuntimeEstimator(Callback):
    """Log ``wall_clock/remaining_estimate``: the time training still needs, at every ``BATCH_END``.

    The estimate is the host time per unit of ``state.progress`` (the fraction of ``max_duration``
    done), measured from the start of batch ``skip_batches + 1`` of each ``fit`` so that the first
    batches (which compile the step) do not count, times the progress left. Evaluations during
    ``fit`` are part of the measured time, so they are expected to go on at the same rate. Nothing
    is logged before a measured batch has ended, nor when the duration's length is unknown
    (progress stays 0, e.g. token durations).

    Like any host-clock measurement of asynchronously dispatched steps, the estimate is exact once
    the measured span is long compared with the dispatch queue (a few ``log_interval``).

    Args:
        skip_batches: batches at the start of each ``fit`` left out of the rate (compilation).
        time_unit: the unit of the logged estimate: 'seconds', 'minutes', 'hours' or 'days'.

    Example::

        trainer = Trainer(model, train_loader, max_duration='20ep',
                          callbacks=[RuntimeEstimator(time_unit='hours')], loggers=[TensorboardLogger()])
    """

    def __init__(self, skip_batches: int = 1, time_unit: str = "seconds") -> None:
        if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"RuntimeEstimator(skip_batches={skip_batches!r}): expected a non-negative integer")
        if time_unit not in TIME_UNITS:
            raise ValueError(f"RuntimeEstimator(time_unit={time_unit!r}): expected one of {list(TIME_UNITS)}")
        self.skip_batches = skip_batches
        self.time_unit = time_unit
        self._divider = TIME_UNITS[time_unit]
        self._to_skip = skip_batches
        self._start_time: float | None = None
        self._start_progress = 0.0

    def fit_start(self, state: State, logger: Logger) -> None:
        self._to_skip = self.skip_batches
        self._start_time = None

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._start_time is None and self._to_skip == 0:
            self._start_time = perf_counter()
            self._start_progress = state.progress

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._to_skip > 0:
            self._to_skip -= 1
            return
        if self._start_time is None:
            return
        progress = state.progress
        done = progress - self._start_progress
        if done <= 0:
            return
        remaining = (perf_counter() - self._start_time) / done * max(1.0 - progress, 0.0)
        logger.log_metrics({"wall_clock/remaining_estimate": remaining / self._divider})
