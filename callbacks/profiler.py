"""Profiler: record a JAX profiler trace (host and device activity) of a few training batches."""

from __future__ import annotations

import os

import jax

from composerjax import Callback, Logger, State
from composerjax.parallel.dist import is_process_zero

__all__ = ["Profiler"]


class Profiler(Callback):
    """Trace ``active`` training batches with ``jax.profiler`` after skipping the first ``skip_first``.

    Batches are counted from the first batch this callback sees in each ``fit`` (so after a resume
    the first, compiling batch is skipped again). The trace starts at ``BATCH_START`` of the first
    chosen batch and stops at ``BATCH_END`` of the last, after waiting for the device to finish
    that batch (``jax.block_until_ready`` on the train state), so the device work of every traced
    batch is in the trace. If training ends or the run closes first, the trace is stopped there.

    The trace lands in ``trace_dir`` (default ``<run_dir>/profiler``) as
    ``plugins/profile/<date>/<host>.xplane.pb`` (and ``.trace.json.gz``): open it with TensorBoard's
    profile plugin, XProf or Perfetto. Only process 0 profiles.

    Args:
        skip_first: batches to run before tracing (the first one compiles the step).
        active: batches to trace.
        trace_dir: where to write; ``None`` for ``<state.run_dir>/profiler``.
        create_perfetto_trace: also write a Perfetto-ready ``perfetto_trace.json.gz``.

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.profiler import Profiler

        trainer = Trainer(model, loader, max_duration='20ba', callbacks=[Profiler(skip_first=5, active=3)])
        trainer.fit()   # then: tensorboard --logdir runs/<run_name>/profiler
    """

    def __init__(self, skip_first: int = 1, active: int = 2, trace_dir: str | None = None,
                 create_perfetto_trace: bool = False) -> None:
        if isinstance(skip_first, bool) or not isinstance(skip_first, int) or skip_first < 0:
            raise ValueError(f"skip_first={skip_first!r}: expected a non-negative integer (batches)")
        if isinstance(active, bool) or not isinstance(active, int) or active < 1:
            raise ValueError(f"active={active!r}: expected a positive integer (batches)")
        if trace_dir is not None and not isinstance(trace_dir, (str, os.PathLike)):
            raise ValueError(f"trace_dir={trace_dir!r}: expected a folder path or None")
        self.skip_first = skip_first
        self.active = active
        self.trace_dir = None if trace_dir is None else os.fspath(trace_dir)
        self.create_perfetto_trace = create_perfetto_trace
        #: The training batches (``timestamp.batch`` at their start) traced so far.
        self.traced_batches: list[int] = []
        self._seen = 0
        self._tracing = False

    @property
    def tracing(self) -> bool:
        """Whether a trace is being recorded now."""
        return self._tracing

    def fit_start(self, state: State, logger: Logger) -> None:
        self._seen = 0

    def batch_start(self, state: State, logger: Logger) -> None:
        if self._seen == self.skip_first and not self._tracing and is_process_zero():
            trace_dir = self.trace_dir or os.path.join(state.run_dir, "profiler")
            os.makedirs(trace_dir, exist_ok=True)
            try:
                jax.profiler.start_trace(trace_dir, create_perfetto_trace=self.create_perfetto_trace)
            except RuntimeError as error:
                raise RuntimeError(f"Profiler could not start a trace in {trace_dir!r} (is another jax.profiler "
                                   f"trace running?): {error}") from error
            self.trace_dir = trace_dir
            self._tracing = True
        if self._tracing:
            self.traced_batches.append(state.timestamp.batch.value)
        self._seen += 1

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._tracing and self._seen >= self.skip_first + self.active:
            self._stop(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._stop(state)

    def close(self, state: State, logger: Logger) -> None:
        self._stop(state)

    def _stop(self, state: State) -> None:
        if not self._tracing:
            return
        self._tracing = False
        if state is not None and state.train_state is not None:
            jax.block_until_ready(state.train_state)
        jax.profiler.stop_trace()
