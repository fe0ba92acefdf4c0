"""RuntimeEstimator: estimate the wall-clock time left until ``max_duration`` from the progress so far."""

from __future__ import annotations

from time import perf_counter

from composerjax import Callback, Logger, State

__all__ = ["TIME_UNITS", "RuntimeEstimator"]

#: Seconds per accepted ``time_unit``.
TIME_UNITS = {"seconds": 1.0, "minutes": 60.0, "hours": 3600.0, "days": 86400.0}


class RuntimeEstimator(Callback):
    """Log ``time/remaining_estimate``, the time training still needs, at every ``BATCH_END`` (Composer's).

    Composer's estimate: training time per unit of progress (the fraction of ``max_duration`` done,
    per batch), measured from the start of batch ``skip_batches + 1`` of each ``fit`` so that the
    first batches (which compile the step) do not count and with the time spent in evaluations
    taken out, times the progress left; plus, for each evaluator label, the mean time of its
    evaluations (leaving out the first when there are several) times the evaluations still to come,
    from how often it has run so far. Nothing is logged before a measured batch has ended, nor when
    the duration's length is unknown (progress stays 0, e.g. token durations). At ``INIT`` the unit
    is logged as the hyperparameter ``time/remaining_estimate_unit``.

    Like any host-clock measurement of asynchronously dispatched steps, the estimate is exact once
    the measured span is long compared with the dispatch queue (a few ``log_interval``).

    Args:
        skip_batches: batches at the start of each ``fit`` left out of the rate (compilation).
        time_unit: the unit of the logged estimate: 'seconds', 'minutes', 'hours' (Composer's
            default) or 'days'.

    Example:
        >>> RuntimeEstimator().time_unit
        'hours'

        ``Trainer(..., callbacks=[RuntimeEstimator(time_unit='minutes')], loggers=[TensorboardLogger()])``
    """

    def __init__(self, skip_batches: int = 1, time_unit: str = "hours") -> None:
        if isinstance(skip_batches, bool) or not isinstance(skip_batches, int) or skip_batches < 0:
            raise ValueError(f"RuntimeEstimator(skip_batches={skip_batches!r}): expected a non-negative integer")
        if time_unit not in TIME_UNITS:
            raise ValueError(f"RuntimeEstimator(time_unit={time_unit!r}): expected one of {list(TIME_UNITS)}")
        self.skip_batches = skip_batches
        self.time_unit = time_unit
        self._divider = TIME_UNITS[time_unit]
        self._reset()

    def _reset(self) -> None:
        self._to_skip = self.skip_batches
        self._start_time: float | None = None
        self._start_progress = 0.0
        self._eval_started: float | None = None
        self._eval_seconds = 0.0
        self._eval_times: dict[str, list[float]] = {}
        self._progress_per_eval: dict[str, float] = {}

    def init(self, state: State, logger: Logger) -> None:
        logger.log_hyperparameters({"time/remaining_estimate_unit": self.time_unit})

    def fit_start(self, state: State, logger: Logger) -> None:
        self._reset()

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
        training_seconds = perf_counter() - self._start_time - self._eval_seconds
        remaining = training_seconds / done * (1.0 - progress)
        for label, times in self._eval_times.items():
            if self._progress_per_eval[label] <= 0:  # only evaluations before any measured progress
                continue
            mean = sum(times[1:]) / (len(times) - 1) if len(times) > 1 else times[0]
            expected_evals = (1.0 - self._start_progress) / self._progress_per_eval[label]
            remaining += mean * (expected_evals - len(times))
        logger.log_metrics({"time/remaining_estimate": remaining / self._divider})

    def eval_start(self, state: State, logger: Logger) -> None:
        self._eval_started = perf_counter() if self._start_time is not None else None

    def eval_end(self, state: State, logger: Logger) -> None:
        if self._eval_started is None:  # an evaluation before the measured span (or outside fit)
            return
        seconds = perf_counter() - self._eval_started
        self._eval_started = None
        self._eval_seconds += seconds
        times = self._eval_times.setdefault(state.dataloader_label, [])
        times.append(seconds)
        self._progress_per_eval[state.dataloader_label] = (state.progress - self._start_progress) / len(times)
