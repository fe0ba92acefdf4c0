"""Stopping well: the multi-process stop decision and the signal exit (batch errors live in ``step``)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from composerjax.step.batch_check import BatchError, describe_batch, diagnose_batch, note_batch

__all__ = ["StopControl", "StopDecision", "TrainingInterrupted",
           "BatchError", "describe_batch", "diagnose_batch", "note_batch"]


@dataclass(frozen=True)
class StopDecision:
    """Why ``fit`` stops early, agreed by every process: the signal received (0: none) and/or the time limit.

    Example:
        >>> StopDecision(signum=15).time_limit
        False
    """

    signum: int = 0
    time_limit: bool = False


class StopControl:
    """The stop requests of a ``fit``: asked for by the stoppers and the trainer, decided by the fit loop.

    ``request`` is replaced (never changed in place) on each ask, so a loop can tell a new request
    by identity; ``decision`` is what every process agreed on; ``reason`` what ``fit`` reports.

    Example:
        >>> control = StopControl()
        >>> control.ask(signum=15); control.ask(time_limit=True); control.request
        StopDecision(signum=15, time_limit=True)
    """

    def __init__(self) -> None:
        self.request = StopDecision()
        self.decision: StopDecision | None = None
        self.reason: str | None = None

    def ask(self, signum: int = 0, time_limit: bool = False) -> None:
        """Ask ``fit`` to stop after this batch or group (a signal's number, or the time limit)."""
        request = self.request
        self.request = StopDecision(signum=signum or request.signum, time_limit=time_limit or request.time_limit)

    def reset(self) -> None:
        """A new ``fit``: no request, no decision, no reason."""
        self.request, self.decision, self.reason = StopDecision(), None, None


class TrainingInterrupted(SystemExit):
    """``fit`` stopped on SIGTERM or SIGINT after saving a checkpoint and closing loggers.

    A ``SystemExit``: uncaught, the process exits with status ``128 + signal`` (143 for SIGTERM,
    130 for SIGINT), the shell convention for "terminated by this signal"; the next start with
    ``autoresume=True`` continues from the checkpoint.

    Attributes:
        signum: the signal number.
        saved_batch: the batch index of the checkpoint written on the way out (None without a
            ``save_folder``, or when a second signal cut the save short).

    Example:
        >>> import signal
        >>> error = TrainingInterrupted(signal.SIGTERM, saved_batch=120)
        >>> error.code
        143
    """

    def __init__(self, signum: int, saved_batch: int | None = None) -> None:
        super().__init__(128 + int(signum))
        self.signum = int(signum)
        self.saved_batch = saved_batch

    def __str__(self) -> str:
        name = signal.Signals(self.signum).name
        saved = f"checkpoint {self.saved_batch} saved" if self.saved_batch is not None else "no checkpoint saved"
        return f"training interrupted by {name} ({saved}); exit status {self.code}"
