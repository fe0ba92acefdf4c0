"""Training time: units (epochs, batches, tokens, ...), amounts of time, and the trainer's clock.

``Time`` is an immutable amount of time in one ``TimeUnit`` (``Time(10, "ep")``, or ``"10ep"`` wherever
a time is accepted), with Composer's arithmetic and comparisons. ``Timestamp`` is the trainer's clock:
every counter at one moment of training as a ``Time`` (wall-clock fields as ``datetime.timedelta``),
advanced with ``to_next_batch`` / ``to_next_epoch`` / ``to_next_iteration``.

Example:
    >>> from composerjax.core.time import Time, Timestamp
    >>> Time.from_timestring("10EP") + 5
    Time(15, TimeUnit.EPOCH)
    >>> clock = Timestamp().to_next_batch(samples=32).to_next_batch(samples=32)
    >>> clock.sample, clock.batch.value, clock >= "2ba", clock.get_progress(Time(4, "ba"))
    (Time(64, TimeUnit.SAMPLE), 2, True, 0.5)
"""

from __future__ import annotations

from composerjax.core.time_value import Time, TimeUnit, TimeUnitError, ensure_time, parse_time
from composerjax.core.timestamp import Timestamp, TimestampCounts

__all__ = ["TimeUnit", "Time", "TimeUnitError", "Timestamp", "TimestampCounts", "ensure_time", "parse_time"]
