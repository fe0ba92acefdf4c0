"""The trainer's clock: ``Timestamp``, every training counter at one moment, and its plain numbers.

Import it from :mod:`composerjax.core.time` (or ``composerjax``) with ``Time`` and ``TimeUnit``.

Example:
    >>> from composerjax.core.time import Timestamp
    >>> clock = Timestamp().to_next_batch(samples=32).to_next_batch(samples=32)
    >>> clock.sample, clock.batch.value, clock >= "2ba", clock.counts.sample
    (Time(64, TimeUnit.SAMPLE), 2, True, 64)
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any, NamedTuple

from composerjax.core.time_value import Time, TimeUnit, _is_number, _new_object, _normalize_value, _time

__all__ = ["UNIT_FIELDS", "Timestamp", "TimestampCounts"]


class TimestampCounts(NamedTuple):
    """The plain numbers behind a :class:`Timestamp`: counters as ints, wall-clock fields as float seconds.

    ``timestamp.counts`` is the one a clock holds, so hot code reads ``timestamp.counts.batch``
    without building a ``Time``; it is also the checkpoint form (``state_dict()``).

    Example:
        >>> Timestamp().to_next_batch(samples=8, duration=0.5).counts.sample, Timestamp().counts.total_wct
        (8, 0.0)
    """

    iteration: int = 0
    epoch: int = 0
    batch: int = 0
    sample: int = 0
    token: int = 0
    epoch_in_iteration: int = 0
    token_in_iteration: int = 0
    batch_in_epoch: int = 0
    sample_in_epoch: int = 0
    token_in_epoch: int = 0
    total_wct: float = 0.0
    iteration_wct: float = 0.0
    epoch_wct: float = 0.0
    batch_wct: float = 0.0


# Enum members read off their class cost a Python call: the fields read these module constants.
_ITERATION, _EPOCH, _BATCH, _SAMPLE, _TOKEN = (TimeUnit.ITERATION, TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.SAMPLE,
                                               TimeUnit.TOKEN)

# The unit of each counter field (the wall-clock fields are float seconds).
_COUNTER_UNITS = {
    "iteration": TimeUnit.ITERATION,
    "epoch": TimeUnit.EPOCH,
    "batch": TimeUnit.BATCH,
    "sample": TimeUnit.SAMPLE,
    "token": TimeUnit.TOKEN,
    "epoch_in_iteration": TimeUnit.EPOCH,
    "token_in_iteration": TimeUnit.TOKEN,
    "batch_in_epoch": TimeUnit.BATCH,
    "sample_in_epoch": TimeUnit.SAMPLE,
    "token_in_epoch": TimeUnit.TOKEN,
}
_WALL_CLOCK_FIELDS = ("total_wct", "iteration_wct", "epoch_wct", "batch_wct")

#: The ``TimestampCounts`` field that counts each unit (``dur`` is a fraction, not a count).
UNIT_FIELDS = {
    TimeUnit.EPOCH: "epoch",
    TimeUnit.ITERATION: "iteration",
    TimeUnit.BATCH: "batch",
    TimeUnit.SAMPLE: "sample",
    TimeUnit.TOKEN: "token",
    TimeUnit.SECOND: "total_wct",
}


def _count(value: Any, field: str) -> int:
    """A counter argument (an int or a Time in the field's unit) as an int."""
    unit = _COUNTER_UNITS[field]
    if isinstance(value, Time):
        if value.unit is not unit:
            raise ValueError(f"Timestamp({field}={value!r}): expected a count in '{unit.value}'")
        return value.value
    return _normalize_value(value, unit)  # type: ignore[return-value]


def _seconds(value: Any, field: str = "duration") -> float:
    """A wall-clock argument (a ``datetime.timedelta``, seconds, or None for 0) as float seconds."""
    kind = type(value)
    if kind is float:
        return value
    if value is None:
        return 0.0
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if _is_number(value):
        return float(value)
    raise TypeError(f"{field}={value!r}: expected a datetime.timedelta or a number of seconds")


_new_counts = tuple.__new__
_timedelta = datetime.timedelta


class Timestamp:
    """The trainer's clock: every time counter at one moment of training; advance it, never mutate it.

    Counters are ``Time`` objects (``timestamp.batch.value``, ``timestamp.epoch >= '3ep'``);
    ``*_in_epoch`` restart each epoch and ``*_in_iteration`` each iteration. Wall-clock fields are
    ``datetime.timedelta``: ``total_wct`` for the whole run, ``iteration_wct``/``epoch_wct`` for
    the current iteration/epoch, ``batch_wct`` for the last batch. A timestamp compares with a
    time through its counter in that time's unit (``timestamp < '10ep'``). The plain numbers are
    in :attr:`counts`, for code that runs every batch.

    Counters are given as ints or as Times in their unit, wall-clock spans as ``datetime.timedelta``
    or seconds (None is 0).

    Args:
        iteration: iterations completed.
        epoch: epochs completed.
        batch: batches completed.
        sample: samples trained on.
        token: tokens trained on.
        epoch_in_iteration: epochs completed in the current iteration.
        token_in_iteration: tokens trained on in the current iteration.
        batch_in_epoch: batches completed in the current epoch.
        sample_in_epoch: samples trained on in the current epoch.
        token_in_epoch: tokens trained on in the current epoch.
        total_wct: wall-clock time since training began.
        iteration_wct: wall-clock time of the current iteration.
        epoch_wct: wall-clock time of the current epoch.
        batch_wct: wall-clock time of the last batch.

    Example:
        >>> clock = Timestamp().to_next_batch(samples=8, tokens=1024, duration=0.25).to_next_epoch()
        >>> clock.epoch, clock.batch.value, clock.batch_in_epoch.value, clock >= "1ep"
        (Time(1, TimeUnit.EPOCH), 1, 0, True)
        >>> clock.total_wct
        datetime.timedelta(microseconds=250000)
    """

    __slots__ = ("counts",)

    #: The plain numbers behind the fields (``counts.batch`` is ``batch.value``; wall-clock in seconds).
    counts: TimestampCounts

    def __init__(
        self,
        iteration: int | Time[int] = 0,
        epoch: int | Time[int] = 0,
        batch: int | Time[int] = 0,
        sample: int | Time[int] = 0,
        token: int | Time[int] = 0,
        epoch_in_iteration: int | Time[int] = 0,
        token_in_iteration: int | Time[int] = 0,
        batch_in_epoch: int | Time[int] = 0,
        sample_in_epoch: int | Time[int] = 0,
        token_in_epoch: int | Time[int] = 0,
        total_wct: datetime.timedelta | float | None = None,
        iteration_wct: datetime.timedelta | float | None = None,
        epoch_wct: datetime.timedelta | float | None = None,
        batch_wct: datetime.timedelta | float | None = None,
    ) -> None:
        _set_counts(self, TimestampCounts(
            _count(iteration, "iteration"), _count(epoch, "epoch"), _count(batch, "batch"),
            _count(sample, "sample"), _count(token, "token"),
            _count(epoch_in_iteration, "epoch_in_iteration"), _count(token_in_iteration, "token_in_iteration"),
            _count(batch_in_epoch, "batch_in_epoch"), _count(sample_in_epoch, "sample_in_epoch"),
            _count(token_in_epoch, "token_in_epoch"),
            _seconds(total_wct, "total_wct"), _seconds(iteration_wct, "iteration_wct"),
            _seconds(epoch_wct, "epoch_wct"), _seconds(batch_wct, "batch_wct"),
        ))

    # -- fields ---------------------------------------------------------------------------------------

    @property
    def iteration(self) -> Time[int]:
        """The iterations completed."""
        return _time(self.counts.iteration, _ITERATION)

    @property
    def epoch(self) -> Time[int]:
        """The epochs completed."""
        return _time(self.counts.epoch, _EPOCH)

    @property
    def batch(self) -> Time[int]:
        """The batches (optimizer steps) completed."""
        return _time(self.counts.batch, _BATCH)

    @property
    def sample(self) -> Time[int]:
        """The samples trained on."""
        return _time(self.counts.sample, _SAMPLE)

    @property
    def token(self) -> Time[int]:
        """The tokens trained on (counted when the trainer has ``tokens_per_batch``)."""
        return _time(self.counts.token, _TOKEN)

    @property
    def epoch_in_iteration(self) -> Time[int]:
        """The epochs completed in the current iteration."""
        return _time(self.counts.epoch_in_iteration, _EPOCH)

    @property
    def token_in_iteration(self) -> Time[int]:
        """The tokens trained on in the current iteration."""
        return _time(self.counts.token_in_iteration, _TOKEN)

    @property
    def batch_in_epoch(self) -> Time[int]:
        """The batches completed in the current epoch."""
        return _time(self.counts.batch_in_epoch, _BATCH)

    @property
    def sample_in_epoch(self) -> Time[int]:
        """The samples trained on in the current epoch."""
        return _time(self.counts.sample_in_epoch, _SAMPLE)

    @property
    def token_in_epoch(self) -> Time[int]:
        """The tokens trained on in the current epoch."""
        return _time(self.counts.token_in_epoch, _TOKEN)

    @property
    def total_wct(self) -> datetime.timedelta:
        """The wall-clock time since training began."""
        return _timedelta(0, self.counts.total_wct)

    @property
    def iteration_wct(self) -> datetime.timedelta:
        """The wall-clock time of the current iteration."""
        return _timedelta(0, self.counts.iteration_wct)

    @property
    def epoch_wct(self) -> datetime.timedelta:
        """The wall-clock time of the current epoch."""
        return _timedelta(0, self.counts.epoch_wct)

    @property
    def batch_wct(self) -> datetime.timedelta:
        """The wall-clock time of the last batch."""
        return _timedelta(0, self.counts.batch_wct)

    def get(self, unit: TimeUnit | str) -> Time:
        """Return the elapsed time in ``unit`` (``'sec'`` reads ``total_wct`` in seconds).

        Example:
            >>> Timestamp(batch=5).get("ba")
            Time(5, TimeUnit.BATCH)
        """
        unit = unit if type(unit) is TimeUnit else TimeUnit(unit)
        if unit is TimeUnit.DURATION:
            raise ValueError(
                "a Timestamp cannot report 'dur' on its own: duration is a fraction of max_duration; "
                "use get_progress(max_duration) instead"
            )
        return _time(getattr(self.counts, UNIT_FIELDS[unit]), unit)

    # -- advancing ------------------------------------------------------------------------------------

    def to_next_batch(
        self,
        samples: int | Time[int] = 0,
        tokens: int | Time[int] = 0,
        duration: datetime.timedelta | float | None = None,
    ) -> Timestamp:
        """Return the clock after one more batch of ``samples``/``tokens`` that took ``duration``.

        Args:
            samples: the samples in the batch (the total across processes).
            tokens: the tokens in the batch (the total across processes).
            duration: the batch's wall-clock time, a ``datetime.timedelta`` or seconds.

        Example:
            >>> Timestamp().to_next_batch(samples=4).sample_in_epoch
            Time(4, TimeUnit.SAMPLE)
        """
        # Called every training step: one tuple, no Time and no timedelta built here.
        if type(samples) is not int:
            samples = _count(samples, "sample")
        if type(tokens) is not int:
            tokens = _count(tokens, "token")
        seconds = duration if type(duration) is float else _seconds(duration)
        (iteration, epoch, batch, sample, token, epoch_in_iteration, token_in_iteration, batch_in_epoch,
         sample_in_epoch, token_in_epoch, total_wct, iteration_wct, epoch_wct, _) = self.counts
        timestamp = _new_object(Timestamp)
        _set_counts(timestamp, _new_counts(TimestampCounts, (
            iteration, epoch, batch + 1, sample + samples, token + tokens, epoch_in_iteration,
            token_in_iteration + tokens, batch_in_epoch + 1, sample_in_epoch + samples, token_in_epoch + tokens,
            total_wct + seconds, iteration_wct + seconds, epoch_wct + seconds, seconds,
        )))
        return timestamp

    def to_next_batches(
        self,
        batches: int,
        samples: int | Time[int] = 0,
        tokens: int | Time[int] = 0,
        duration: datetime.timedelta | float | None = None,
    ) -> Timestamp:
        """Return the clock after ``batches`` more batches of ``samples``/``tokens`` in all, taking ``duration``.

        The same as calling :meth:`to_next_batch` once per batch (``batch_wct`` becomes the mean).

        Example:
            >>> Timestamp().to_next_batches(4, samples=32).sample
            Time(32, TimeUnit.SAMPLE)
        """
        samples, tokens, seconds = _count(samples, "sample"), _count(tokens, "token"), _seconds(duration)
        counts = self.counts
        return _timestamp_from_counts(counts._replace(
            batch=counts.batch + batches,
            batch_in_epoch=counts.batch_in_epoch + batches,
            sample=counts.sample + samples,
            sample_in_epoch=counts.sample_in_epoch + samples,
            token=counts.token + tokens,
            token_in_epoch=counts.token_in_epoch + tokens,
            token_in_iteration=counts.token_in_iteration + tokens,
            total_wct=counts.total_wct + seconds,
            iteration_wct=counts.iteration_wct + seconds,
            epoch_wct=counts.epoch_wct + seconds,
            batch_wct=seconds / max(batches, 1),
        ))

    def to_next_epoch(self, duration: datetime.timedelta | float | None = None) -> Timestamp:
        """Return the clock at the start of the next epoch; ``duration`` is end-of-epoch time outside batches.

        Example:
            >>> Timestamp(batch=3, batch_in_epoch=3).to_next_epoch().batch_in_epoch
            Time(0, TimeUnit.BATCH)
        """
        seconds, counts = _seconds(duration), self.counts
        return _timestamp_from_counts(counts._replace(
            epoch=counts.epoch + 1,
            epoch_in_iteration=counts.epoch_in_iteration + 1,
            batch_in_epoch=0,
            sample_in_epoch=0,
            token_in_epoch=0,
            total_wct=counts.total_wct + seconds,
            iteration_wct=counts.iteration_wct + seconds,
            epoch_wct=0.0,
            batch_wct=0.0,
        ))

    def to_next_iteration(self, duration: datetime.timedelta | float | None = None) -> Timestamp:
        """Return the clock at the start of the next iteration: the per-iteration and per-epoch counters restart.

        Example:
            >>> Timestamp(epoch_in_iteration=2).to_next_iteration().iteration
            Time(1, TimeUnit.ITERATION)
        """
        seconds, counts = _seconds(duration), self.counts
        return _timestamp_from_counts(counts._replace(
            iteration=counts.iteration + 1,
            epoch_in_iteration=0,
            token_in_iteration=0,
            batch_in_epoch=0,
            sample_in_epoch=0,
            token_in_epoch=0,
            total_wct=counts.total_wct + seconds,
            iteration_wct=0.0,
            epoch_wct=0.0,
            batch_wct=0.0,
        ))

    def copy(self, **changes: int | float | Time | datetime.timedelta | None) -> Timestamp:
        """Return a copy with the given fields replaced, e.g. ``clock.copy(batch=7, batch_wct=0.0)``.

        Counters take ints or Times, wall-clock fields ``datetime.timedelta`` or seconds; None keeps
        the field.

        Example:
            >>> Timestamp(epoch=1).copy(batch=2).batch
            Time(2, TimeUnit.BATCH)
        """
        unknown = sorted(set(changes) - set(TimestampCounts._fields))
        if unknown:
            raise TypeError(f"Timestamp.copy(): unknown fields {unknown}; expected some of "
                            f"{list(TimestampCounts._fields)}")
        values = {name: _count(value, name) if name in _COUNTER_UNITS else _seconds(value, name)
                  for name, value in changes.items() if value is not None}
        return _timestamp_from_counts(self.counts._replace(**values))

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, int | float]:
        """Return every field as a flat dict of plain numbers (wall-clock in seconds), for checkpoints.

        Example:
            >>> Timestamp(batch=3, total_wct=1.5).state_dict()["total_wct"]
            1.5
        """
        return self.counts._asdict()

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> Timestamp:
        """Rebuild a clock from ``state_dict()`` output; missing fields default, unknown ones raise.

        Numbers are cast back to int/float, so numpy scalars restored from a checkpoint are fine
        (``datetime.timedelta`` wall-clock values, as Composer saves them, too).

        Example:
            >>> clock = Timestamp(epoch=2, total_wct=1.5)
            >>> Timestamp.from_state_dict(clock.state_dict()) == clock
            True
        """
        unknown = sorted(set(state) - set(TimestampCounts._fields))
        if unknown:
            raise ValueError(f"unknown Timestamp fields {unknown}; expected a subset of "
                             f"{list(TimestampCounts._fields)}")
        values = {name: int(value) if name in _COUNTER_UNITS else _seconds(value, name)
                  for name, value in state.items()}
        return _timestamp_from_counts(TimestampCounts(**values))

    # -- progress and comparison ----------------------------------------------------------------------

    def get_progress(self, max_duration: Time | str) -> float:
        """Return the fraction of ``max_duration`` elapsed (may exceed 1.0 once it has passed).

        Example:
            >>> Timestamp(epoch=1).get_progress(Time(4, "ep"))
            0.25
        """
        max_duration = Time.from_input(max_duration)
        if max_duration.unit is TimeUnit.DURATION:
            raise ValueError(
                f"max_duration must be in ep, iter, ba, sp, tok or sec, not {max_duration}: "
                "a 'dur' max_duration measures the run against itself"
            )
        if max_duration.value == 0:
            raise ValueError(f"max_duration must be positive to measure progress, got {max_duration}")
        return getattr(self.counts, UNIT_FIELDS[max_duration.unit]) / max_duration.value

    def _counter(self, other: object) -> tuple[Time, Time] | None:
        """``(this clock's counter in other's unit, other as a Time)``, or None if other is no time."""
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if not isinstance(other, Time):
            return None
        return self.get(other.unit), other

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Timestamp):
            return self.counts == other.counts
        pair = self._counter(other)
        return NotImplemented if pair is None else pair[0] == pair[1]

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __lt__(self, other: Time | str) -> bool:
        pair = self._counter(other)
        return NotImplemented if pair is None else pair[0] < pair[1]

    def __le__(self, other: Time | str) -> bool:
        pair = self._counter(other)
        return NotImplemented if pair is None else pair[0] <= pair[1]

    def __gt__(self, other: Time | str) -> bool:
        pair = self._counter(other)
        return NotImplemented if pair is None else pair[0] > pair[1]

    def __ge__(self, other: Time | str) -> bool:
        pair = self._counter(other)
        return NotImplemented if pair is None else pair[0] >= pair[1]

    def __hash__(self) -> int:
        return hash(self.counts)

    # -- immutability, pickling, repr -----------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Timestamp is immutable; use copy({name}=...) or to_next_batch() for a new one")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Timestamp is immutable; cannot delete {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[tuple[int | float, ...]]]:
        return (_timestamp_from_counts, (tuple(self.counts),))

    def __repr__(self) -> str:
        counts = self.counts
        fields = [f"{name}={value}" for name, value in zip(_COUNTER_UNITS, counts)]
        fields += [f"{name}={_timedelta(0, getattr(counts, name))!r}" for name in _WALL_CLOCK_FIELDS]
        return f"Timestamp({', '.join(fields)})"


_set_counts = Timestamp.counts.__set__  # type: ignore[attr-defined]


def _timestamp_from_counts(counts: Sequence[int | float]) -> Timestamp:
    """A Timestamp holding ``counts`` as they are (no checks): the clock's own fast path and unpickling."""
    timestamp = _new_object(Timestamp)
    _set_counts(timestamp, counts if type(counts) is TimestampCounts else TimestampCounts(*counts))
    return timestamp
