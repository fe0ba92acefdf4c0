"""Stopping early as callbacks: the wall-clock time limit and the signal-triggered save and exit."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from composerjax.checkpoint.saver import CheckpointSaver
from composerjax.core.callback import Callback
from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.trainer.interrupt import StopControl, TrainingInterrupted

__all__ = ["SignalHandler", "TimeLimit", "to_time_limit"]


class TimeLimit(Callback):
    """Stop ``fit`` once this process has trained for ``time_limit``; the checkpoint saver then saves.

    The Trainer installs one from its ``time_limit`` argument. The budget counts from the first
    ``FIT_START``; it is checked after every batch (or grouped call), and with several processes
    any process's spent budget stops them all at the same batch. ``trainer.stop_reason`` is then
    ``'time_limit'``; a new run with ``autoresume=True`` continues.

    Args:
        time_limit: ``'2h30m'``, ``'45m'``, ``'90s'``, or seconds.

    Example::

        trainer = Trainer(model, loader, max_duration="100ep", save_folder="ckpt", callbacks=[TimeLimit("2h")])
    """

    accepts_grouped_batches = True
    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self, time_limit: Time | str | int | float) -> None:
        self.seconds = to_time_limit(time_limit)
        self._started: float | None = None
        self._control: StopControl | None = None

    def bind(self, control: StopControl) -> None:
        """Ask the run's ``control`` to stop when the budget is spent."""
        self._control = control

    def fit_start(self, state: State, logger: Any) -> None:
        if self._started is None:
            self._started = time.perf_counter()

    def batch_end(self, state: State, logger: Any) -> bool:
        if self._started is None or time.perf_counter() - self._started < self.seconds:
            return False
        if self._control is None:
            raise RuntimeError("TimeLimit: not bound to a Trainer (pass it in Trainer(callbacks=[...]))")
        self._control.ask(time_limit=True)
        return True


class SignalHandler(Callback):
    """During ``fit``, SIGTERM and SIGINT stop training after the current step, save, and exit.

    The Trainer installs one unless ``handle_signals=False``. The handlers are installed at
    ``FIT_START`` (main thread only) and restored at ``FIT_END`` or when ``fit`` fails. At
    ``FIT_END`` (after the checkpoint saver has saved and verified the last checkpoint) it closes
    the trainer, so every logger writes out what it was given and the trackers end their runs as
    interrupted (MLflow ``KILLED``, W&B exit code ``128 + signal``), and raises
    :class:`~composerjax.trainer.interrupt.TrainingInterrupted`, whose exit status is ``128 + signal``.
    A second signal while stopping interrupts at once.

    Example::

        trainer = Trainer(model, loader, max_duration="10ep", save_folder="ckpt")  # installed by default
    """

    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self) -> None:
        self._control: StopControl | None = None
        self._saver: Any = None
        self._close: Callable[[], None] | None = None
        self._signal: int | None = None
        self._previous: dict[int, Any] = {}

    def bind(self, control: StopControl, saver: CheckpointSaver | None, close: Callable[[], None]) -> None:
        """Report signals to the run's ``control``; at the exit wait for ``saver``'s save, then ``close`` the run."""
        self._control, self._saver, self._close = control, saver, close

    def fit_start(self, state: State, logger: Any) -> None:
        self._signal = None
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[signum] = signal.signal(signum, self._on_signal)
            except (ValueError, OSError):  # not allowed here (embedded interpreters)
                pass

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._signal is not None:  # a second signal: stop now, without saving
            raise TrainingInterrupted(signum, saved_batch=None)
        self._signal = signum
        if self._control is not None:
            self._control.ask(signum=signum)

    def restore(self) -> None:
        """Put back the handlers that were there before ``fit``."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    def fit_end(self, state: State, logger: Any) -> bool:
        self.restore()
        control = self._control
        decision = control.decision if control is not None else None
        if control is None or decision is None or not decision.signum:
            return False
        signum = decision.signum
        name = signal.Signals(signum).name
        control.reason = name
        checkpointer = self._saver.checkpointer if self._saver is not None else None
        saved = None
        if checkpointer is not None:
            checkpointer.wait()  # raises CheckpointSaveError if the save did not reach the disk
            saved = checkpointer.last_saved
            _print(f"{name}: saved checkpoint {saved} in {checkpointer.folder}; exiting with status {128 + signum}")
        else:
            _print(f"{name}: no save_folder, so no checkpoint; exiting with status {128 + signum}")
        try:
            raise TrainingInterrupted(signum, saved_batch=saved)
        except TrainingInterrupted:
            # Closed while the interruption is being raised: the trackers flush what they were given
            # and record the run as interrupted (MLflow KILLED, W&B exit code 128 + signal).
            if self._close is not None:
                self._close()
            raise

    def fit_error(self, state: State, logger: Any, error: BaseException) -> None:
        self.restore()


def to_time_limit(value: Time | str | int | float | None) -> float | None:
    """``time_limit`` in seconds: a wall-clock Time or string ('2h30m', '45m', '90s'), or seconds.

    Example:
        >>> to_time_limit('1h30m')
        5400.0
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"time_limit={value!r}: expected a wall-clock duration such as '2h30m', '45m' or '90s'")
    try:
        limit = value if isinstance(value, Time) else Time.from_input(value, TimeUnit.SECOND)
    except ValueError as error:
        raise ValueError(f"time_limit={value!r}: {error}") from error
    if limit.unit != TimeUnit.SECOND or limit.value <= 0:
        raise ValueError(f"time_limit={value!r}: expected a positive wall-clock duration such as '2h30m', '45m' or "
                         "'90s'")
    return float(limit.value)


def _print(text: str) -> None:
    """Print above any active progress bar instead of through it."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stdout)
