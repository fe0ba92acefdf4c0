"""A NaN or infinite training loss does not pass silently: one line when it is first seen, and the run summary.

Nothing here reads from or waits on the device during training. The losses the loggers get are
fetched anyway (``PendingLogs``, every ``log_interval`` batches, in one transfer) and looked at as
they pass; a loss nobody fetched is looked at when something reads it (``composerjax train`` reads
the final loss for its results: :meth:`NonFiniteLoss.last`). The updates the non-finite guard
skipped (``skip_nonfinite_updates``, which the user turned on) are summed on the device and read
once, at fit end.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from composerjax.parallel.dist import is_process_zero
from composerjax.step.summary import skipped_updates_line

__all__ = ["NonFiniteLoss", "NAN_MONITOR_ADVICE"]

#: What the line about a non-finite loss advises.
NAN_MONITOR_ADVICE = ("add composerjax.callbacks.NaNMonitor() to stop at the first non-finite loss and name the "
                      "algorithms compiled into that step")


def _stderr_line(text: str) -> None:
    """Print above any active progress bar instead of through it."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


class NonFiniteLoss:
    """Say once when the training loss is NaN or infinite, where it became so, and record it in the run summary.

    :meth:`see` takes each loss the loggers get (the exact batch is known); :meth:`last` takes the
    final loss when a caller read it anyway and no logger got it, and then knows only the batches
    it became non-finite between. The first non-finite loss prints one line on stderr (on process 0) and sets
    ``state.run_summary['nonfinite_loss']`` to ``{'loss', 'first_batch', 'last_batch',
    'message'}``. Batches count as ``timestamp.batch`` after the step, as logged rows and
    ``NaNMonitor`` do: batch 5's step has ``state.step == 4``. No line is printed when the Trainer
    has ``allow_nonfinite_loss=True`` or a ``NaNMonitor`` callback (it reports the loss itself).
    At fit end, with the non-finite guard on, ``state.run_summary['skipped_nonfinite_updates']``
    is ``{'skipped', 'updates'}`` and a line says how many updates it skipped, if any.

    Args:
        state: the run's state.
        allowed: ``Trainer(allow_nonfinite_loss=...)``: a non-finite loss is expected, print nothing.
        write: prints one line (default: stderr, above any progress bar).

    Example::

        check = NonFiniteLoss(trainer.state, allowed=False)
        check.see(5, float("nan"))   # composerjax: the training loss became nan at batch 5; add ...
    """

    def __init__(self, state: Any, allowed: bool = False, write: Any = None) -> None:
        self.state, self.allowed = state, allowed
        self.write = write if write is not None else _stderr_line
        #: The last batch whose loss was looked at (or that came before this fit).
        self.checked_through = 0
        #: The run summary's ``nonfinite_loss`` entry, once a non-finite loss was seen.
        self.found: dict[str, Any] | None = None

    def start_fit(self) -> None:
        """At fit start: the batches before it (an earlier fit, a loaded checkpoint) are not this fit's to check."""
        self.checked_through = int(self.state.timestamp.counts.batch)

    def see(self, batch: int, loss: float) -> None:
        """One batch's loss, already on the host (``batch`` as logged: ``timestamp.batch`` after its step)."""
        if batch > self.checked_through:
            self.checked_through = batch
        if self.found is None and not math.isfinite(loss):
            self._found(loss, batch, batch)

    def last(self, loss: float) -> None:
        """The final loss, read by the caller (``float(state.loss)``): checked if no logger got it.

        Example::

            trainer.nonfinite_loss.last(float(trainer.state.loss))   # between batch 11 and 20 ...
        """
        batch = int(self.state.timestamp.counts.batch)
        if self.found is None and batch > self.checked_through and not math.isfinite(loss):
            self._found(loss, self.checked_through + 1, batch)
        self.checked_through = max(self.checked_through, batch)

    def end_fit(self, skipped_updates: Any = None) -> None:
        """At fit end: the updates the non-finite guard skipped (one read, only with the guard on)."""
        state = self.state
        if skipped_updates is not None and skipped_updates.guarded:
            count = skipped_updates.read()
            entry = {"skipped": count, "updates": skipped_updates.guarded}
            state.run_summary["skipped_nonfinite_updates"] = entry
            if count and is_process_zero():
                self.write(f"composerjax: {skipped_updates_line(entry)}")

    def _found(self, loss: float, first: int, last: int) -> None:
        state = self.state
        if first == last:
            message = f"the training loss became {loss} at batch {last}"
        else:
            message = f"the training loss became non-finite between batch {first} and {last} ({loss} at batch {last})"
        self.found = {"loss": str(loss), "first_batch": first, "last_batch": last, "message": message}
        state.run_summary["nonfinite_loss"] = self.found
        monitored = any(type(callback).__name__ == "NaNMonitor" for callback in state.callbacks)
        if not self.allowed and not monitored and is_process_zero():
            self.write(f"composerjax: {message}; {NAN_MONITOR_ADVICE}")

