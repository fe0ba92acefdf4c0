"""NaNMonitor: stop training with a clear error when the loss becomes NaN or infinite, without a per-step sync."""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from composerjax import Callback, Logger, LoggerDestination, State

__all__ = ["NaNMonitor", "NonFiniteLossError"]

FLAG = "nan_monitor/nonfinite"
# Which compiled step variant ran (an index into state.compiled_steps); taken out of the logged row.
_VARIANT = "nan_monitor/step_variant"


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite.

    Attributes:
        batch: the batch whose step produced it (``state.timestamp.batch`` after that step, the
            ``step`` its row is logged at).
        loss: the loss value (``nan``, ``inf`` or ``-inf``).
        algorithms: the trace keys of the algorithms compiled into that step (``'MixUp/BEFORE_FORWARD'``).
    """

    def __init__(self, batch: int, loss: float, algorithms: tuple[str, ...] | None) -> None:
        self.batch, self.loss, self.algorithms = batch, loss, algorithms
        if algorithms is None:
            ran = "unknown (the step's compile record is missing)"
        else:
            ran = ", ".join(algorithms) or "none"
        super().__init__(
            f"NaNMonitor: the training loss is {loss} at batch {batch} (the step that took timestamp.batch from "
            f"{batch - 1} to {batch}; state.step == {batch - 1} inside it). Algorithms in that compiled step: "
            f"{ran}. Check that batch's data, the learning rate, and those algorithms."
        )


class _LoggedFlags(LoggerDestination):
    """Receives the trainer's logged rows and keeps those whose flag is set."""

    def __init__(self) -> None:
        self.flagged: list[tuple[int, float]] = []
        self.last_step = 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        flag = metrics.get(f"train/{FLAG}")
        if flag is None or step is None:
            return
        self.last_step = max(self.last_step, step)
        if flag > 0:
            self.flagged.append((step, metrics.get("loss/train/total", math.nan)))


class NaNMonitor(Callback):
    """Raise :class:`NonFiniteLossError` (a ``FloatingPointError``) when the training loss is NaN or infinite.

    Inside the compiled step (``AFTER_LOSS``) the callback adds ``nan_monitor/nonfinite`` (1.0 when
    the loss is not finite) to ``state.step_metrics``; the host looks at the flags in batches, never
    waiting on the newest step:

    * ``check_interval=None`` (default): read the flags the trainer logs (``train/nan_monitor/nonfinite``
      with ``loss/train/total``), which it fetches every ``log_interval`` batches anyway: no extra
      transfer. The error comes at the first ``BATCH_END`` (or ``EPOCH_END``/``FIT_END``) after the
      trainer fetched the bad step's row.
    * ``check_interval=N``: fetch the flags of the last ``N`` batches in one transfer every ``N``
      batches (all but the newest step), and everything pending at ``EPOCH_END``/``FIT_END``.

    The error names the first bad batch, the loss value, and the algorithms compiled into the step
    that ran it (from ``state.compiled_steps``).

    With ``policy='skip'`` the monitor does not raise: it turns on the compiled step's
    non-finite guard (``Trainer(skip_nonfinite_updates=True)``), so a step whose loss or gradients
    are NaN or infinite leaves parameters, optimizer and algorithm state unchanged, and it records
    the skipped batches in ``skipped`` (with one warning the first time).

    Args:
        check_interval: None to follow the trainer's logging cadence, or how many batches' flags to
            fetch together.
        policy: ``'raise'`` (default) or ``'skip'``.

    Example::

        trainer = Trainer(model, train_loader, max_duration='1ep', callbacks=[NaNMonitor()])
        try:
            trainer.fit()
        except NonFiniteLossError as error:
            print(error.batch, error.loss, error.algorithms)
    """

    def __init__(self, check_interval: int | None = None, policy: str = "raise") -> None:
        if policy not in ("raise", "skip"):
            raise ValueError(f"NaNMonitor(policy={policy!r}): expected 'raise' or 'skip'")
        self.policy = policy
        self.skipped: list[int] = []
        if check_interval is not None and (
            isinstance(check_interval, bool) or not isinstance(check_interval, int) or check_interval < 1
        ):
            raise ValueError(f"NaNMonitor(check_interval={check_interval!r}): expected None (check what the trainer "
                             "logs) or a positive integer (batches)")
        self.check_interval = check_interval
        self._logged = _LoggedFlags()
        # check_interval=N: (batch, flag, variant, loss) device arrays; None: batch -> variant.
        self._pending: list[tuple[int, Any, Any, Any]] = []
        self._variants: dict[int, Any] = {}

    def init(self, state: State, logger: Logger) -> None:
        if self.policy == "skip":  # before the step is built: the guard is compiled in
            state.skip_nonfinite_updates = True

    # -- inside the compiled step ----------------------------------------------------------------
    def after_loss(self, state: State, logger: Logger) -> None:
        state.step_metrics[FLAG] = jnp.logical_not(jnp.isfinite(state.loss)).astype(jnp.float32)
        # Traced once per compile: this variant's record will be the next one in state.compiled_steps.
        state.step_metrics[_VARIANT] = jnp.asarray(len(state.compiled_steps), jnp.float32)

    # -- on the host -----------------------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        if self.check_interval is None and self._logged not in logger.destinations:
            logger.destinations.append(self._logged)

    def batch_end(self, state: State, logger: Logger) -> None:
        metrics = state.step_metrics
        variant = metrics.pop(_VARIANT, None)  # not a metric worth logging
        if variant is None:
            return
        batch = state.timestamp.batch.value
        if self.check_interval is None:
            self._variants[batch] = variant
            self._check_logged(state)
        else:
            self._pending.append((batch, metrics[FLAG], variant, state.loss))
            if len(self._pending) > self.check_interval:
                self._check_pending(state, len(self._pending) - 1)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._check_all(state)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._check_all(state)

    def _check_all(self, state: State) -> None:
        if self.check_interval is None:
            self._check_logged(state)
        else:
            self._check_pending(state, len(self._pending))

    def _check_logged(self, state: State) -> None:
        flagged, self._logged.flagged = self._logged.flagged, []
        for batch, loss in flagged:
            self._raise(state, batch, loss, self._variants.get(batch))
        for batch in [b for b in self._variants if b <= self._logged.last_step]:
            del self._variants[batch]

    def _check_pending(self, state: State, count: int) -> None:
        pending, self._pending = self._pending[:count], self._pending[count:]
        if not pending:
            return
        flags = jax.device_get([flag for _, flag, _, _ in pending])
        for (batch, _, variant, loss), flag in zip(pending, flags):
            if flag > 0:
                self._raise(state, batch, float(jax.device_get(loss)), variant)

    def _raise(self, state: State, batch: int, loss: float, variant: Any) -> None:
        if self.policy == "skip":
            if not self.skipped:
                warnings.warn(f"NaNMonitor: the loss is {loss} at batch {batch}; that step's update was skipped "
                              "(policy='skip'). Later skips are recorded in NaNMonitor.skipped.", stacklevel=2)
            self.skipped.append(batch)
            return
        algorithms = None
        if variant is not None:
            index = int(jax.device_get(variant))
            records = state.compiled_steps
            if 0 <= index < len(records):
                algorithms = tuple(records[index].algorithms)
        self._pending.clear()
        self._variants.clear()
        self._logged.flagged = []
        raise NonFiniteLossError(batch, loss, algorithms)
