"""Amounts of training time: ``TimeUnit``, the value type ``Time``, and parsing times from strings.

The clock (``Timestamp``) is built on these in :mod:`composerjax.core.timestamp`; import both from
:mod:`composerjax.core.time` (or ``composerjax``).

Example:
    >>> from composerjax.core.time import Time
    >>> Time.from_timestring("10EP") + 5
    Time(15, TimeUnit.EPOCH)
"""

from __future__ import annotations

import datetime
import math
import numbers
import re
from collections.abc import Sequence
from enum import Enum
from typing import Any, Generic, TypeVar

__all__ = ["TimeUnit", "Time", "TimeUnitError", "ensure_time", "parse_time"]



class TimeUnit(str, Enum):
    """A unit in which training time is counted; build one from ``"ep"`` or from ``"epoch"``.

    Example:
        >>> TimeUnit("ba") is TimeUnit("BATCH") is TimeUnit.BATCH
        True
    """

    EPOCH = "ep"
    ITERATION = "iter"
    BATCH = "ba"
    SAMPLE = "sp"
    TOKEN = "tok"
    DURATION = "dur"
    SECOND = "sec"

    @classmethod
    def _missing_(cls, value: object) -> TimeUnit:
        # Configs often spell units out ("epoch", "BATCH"); accept names and values in any case.
        if isinstance(value, str):
            key = value.strip().lower()
            for member in cls:
                if key in (member.value, member.name.lower()):
                    return member
        accepted = ", ".join(f"{m.value!r} ({m.name.lower()})" for m in cls)
        raise ValueError(f"invalid time unit {value!r}: expected one of {accepted}")


class TimeUnitError(ValueError, RuntimeError):
    """Times of different units were combined, or a bare number came with no unit to read it in.

    A ``RuntimeError`` as in Composer, and a ``ValueError`` as every other bad time argument here.

    Example:
        >>> try:
        ...     Time(1, "ep") < Time(1, "ba")
        ... except RuntimeError as error:
        ...     print(error)
        cannot compare 1ep and 1ba: units differ ('ep' vs 'ba'); convert one of them first
    """


# Every unit but DURATION (a fraction of max_duration) and SECOND counts whole amounts. Units are
# compared by identity: reading an Enum member off its class, or hashing one, costs a Python call.
_DURATION, _SECOND = TimeUnit.DURATION, TimeUnit.SECOND

# Digits may be grouped with underscores ('4_000tok'); int()/float() refuse misplaced ones.
_NUMBER = r"-?(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][+-]?\d+)?"
_UNIT_ALTERNATIVES = "|".join(sorted((re.escape(u.value) for u in TimeUnit), key=len, reverse=True))
_UNIT_PATTERN = re.compile(rf"({_NUMBER})\s*({_UNIT_ALTERNATIVES})", re.ASCII | re.IGNORECASE)
_PERCENT_PATTERN = re.compile(rf"({_NUMBER})\s*%", re.ASCII)
_WALL_CLOCK_PATTERN = re.compile(r"(?:(\d+(?:\.\d*)?)h)?(?:(\d+(?:\.\d*)?)m)?(?:(\d+(?:\.\d*)?)s)?",
                                 re.ASCII | re.IGNORECASE)

_ACCEPTED_FORMS = (
    f"expected a number followed by one of {', '.join(u.value for u in TimeUnit)} "
    "(e.g. '10ep', '100ba', '0.5dur'), a percentage like '10%', or a wall-clock span like '2h30m'"
)

#: The largest whole count a Time holds: clocks and checkpoints keep counts as 64-bit integers.
MAX_COUNT = 2**63 - 1

T = TypeVar("T", int, float)


def _parse_number(text: str) -> int | float:
    # Digits-only strings stay exact ints, so '123456789012345678tok' does not lose precision via float.
    return int(text) if text.lstrip("-").replace("_", "").isdigit() else float(text)


def _normalize_value(value: object, unit: TimeUnit) -> int | float:
    """Return ``value`` as the number type ``unit`` stores, or raise if it cannot be an amount of time."""
    kind = type(value)
    if kind is int or kind is float:
        number: Any = value
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"time value must be an int or float, got {value!r} ({type(value).__name__})")
    else:
        number = int(value) if isinstance(value, numbers.Integral) else float(value)
    if type(number) is float and not math.isfinite(number):
        raise ValueError(f"time value must be finite, got {number!r} {unit.value}")
    if unit is _DURATION:
        return float(number)
    if unit is not _SECOND:
        if type(number) is float:
            if not number.is_integer():
                raise ValueError(
                    f"{unit.name.lower()} counts are whole numbers, got {number!r} {unit.value}; "
                    "use an int, or 'dur' for a fraction of the run"
                )
            number = int(number)
        if not -MAX_COUNT <= number <= MAX_COUNT:
            raise ValueError(f"{unit.name.lower()} counts must fit in 64 bits: at most {MAX_COUNT} (2**63 - 1), "
                             f"got {number} {unit.value}")
    return number


def _is_number(value: object) -> bool:
    kind = type(value)
    return kind is int or kind is float or (isinstance(value, numbers.Real) and not isinstance(value, bool))


class Time(Generic[T]):
    """An immutable amount of training time in one unit, e.g. ``Time(10, "ep")`` or ``Time(0.5, "dur")``.

    Epochs, iterations, batches, samples and tokens are whole counts (``Time(3e4, "tok")`` stores
    ``30000``); durations are floats (fractions of ``max_duration``); seconds may be either. Amounts
    may be negative (``-Time(1, "ep")``); the trainer refuses negative arguments where it reads them.

    As in Composer, a plain number is read in this time's unit and a string is parsed with
    ``from_timestring``: ``+``, ``-``, ``%`` and comparisons need one unit (else
    :class:`TimeUnitError`); ``*`` scales by a number or by a ``'dur'`` time; ``/`` by a number
    scales, by a time of the same unit gives a ``'dur'`` ratio. Scaling a whole count rounds toward
    zero. ``int()``, ``float()`` and ``bool()`` read the amount.

    Example:
        >>> Time(10, "ep") + 5, -Time(3, "ba"), Time(10, "ep") * Time(0.5, "dur")
        (Time(15, TimeUnit.EPOCH), Time(-3, TimeUnit.BATCH), Time(5, TimeUnit.EPOCH))
        >>> Time(100, "ba") / Time(400, "ba"), Time(10, "ba") % Time(4, "ba"), int(Time(7, "sp"))
        (Time(0.25, TimeUnit.DURATION), Time(2, TimeUnit.BATCH), 7)
        >>> str(Time.from_timestring("10%"))
        '0.1dur'
    """

    __slots__ = ("_value", "_unit")

    _value: T
    _unit: TimeUnit

    def __init__(self, value: T, unit: TimeUnit | str) -> None:
        unit = unit if type(unit) is TimeUnit else TimeUnit(unit)
        # __setattr__ is closed so times can be shared and hashed safely; only constructors write.
        _set_time_value(self, _normalize_value(value, unit))
        _set_time_unit(self, unit)

    @property
    def value(self) -> T:
        """The amount, an int for whole-count units and a float for ``dur``."""
        return self._value

    @property
    def unit(self) -> TimeUnit:
        """The unit the amount is counted in."""
        return self._unit

    # -- construction -------------------------------------------------------------------------------

    @classmethod
    def from_timestring(cls, timestring: str) -> Time:
        """Parse ``'10ep'``, ``'100BA'``, ``'0.5dur'``, ``'3e4tok'``, ``'4_000sp'``, ``'10%'`` or ``'2h30m'``.

        Units are case-insensitive; ``'10%'`` is ``0.1dur`` and ``'2h30m'`` (also ``'45m'``,
        ``'90s'``) a number of seconds.

        Example:
            >>> Time.from_timestring(" 3e4TOK ")
            Time(30000, TimeUnit.TOKEN)
            >>> Time.from_timestring("1h30m")
            Time(5400, TimeUnit.SECOND)
        """
        if not isinstance(timestring, str):
            raise TypeError(f"time string must be a str, got {timestring!r} ({type(timestring).__name__})")
        text = timestring.strip()
        try:
            match = _UNIT_PATTERN.fullmatch(text)
            if match:
                return cls(_parse_number(match.group(1)), match.group(2).lower())
            match = _PERCENT_PATTERN.fullmatch(text)
            if match:
                return cls(float(match.group(1)) / 100.0, TimeUnit.DURATION)
            seconds = _wall_clock_seconds(text)
            if seconds is not None:
                return cls(seconds, TimeUnit.SECOND)
        except ValueError as error:
            # The string had the right shape but an impossible amount (e.g. '1.5ep'); keep both stories.
            raise ValueError(f"invalid time string {timestring!r}: {error}; {_ACCEPTED_FORMS}") from None
        raise ValueError(f"invalid time string {timestring!r}: {_ACCEPTED_FORMS}")

    @classmethod
    def from_timedelta(cls, timedelta: str | datetime.timedelta) -> Time:
        """Return a wall-clock span (``'1h20m40s'``, ``'45m'`` or a ``datetime.timedelta``) in seconds.

        Example:
            >>> Time.from_timedelta("1h20m40s"), Time.from_timedelta(datetime.timedelta(minutes=1.5))
            (Time(4840, TimeUnit.SECOND), Time(90, TimeUnit.SECOND))
        """
        if isinstance(timedelta, datetime.timedelta):
            seconds: int | float = timedelta.total_seconds()
            return cls(int(seconds) if seconds.is_integer() else seconds, TimeUnit.SECOND)
        if not isinstance(timedelta, str):
            raise TypeError(f"expected a string such as '1h20m40s' or a datetime.timedelta, got {timedelta!r}")
        seconds = _wall_clock_seconds(timedelta.strip())
        if seconds is None:
            raise ValueError(f"invalid wall-clock span {timedelta!r}: expected hours, minutes and seconds "
                             "such as '1h20m40s', '45m' or '90s'")
        return cls(seconds, TimeUnit.SECOND)

    @classmethod
    def from_input(
        cls,
        i: Time | str | int | float,
        default_int_unit: TimeUnit | str | None = None,
        *,
        default_unit: TimeUnit | str | None = None,
    ) -> Time:
        """Coerce a user argument (``Time``, timestring, or a number in ``default_int_unit``) to a ``Time``.

        Args:
            i: the time as given.
            default_int_unit: the unit of a bare number; None refuses bare numbers.
            default_unit: the former name of ``default_int_unit``.

        Raises:
            TimeUnitError: ``i`` is a number and no unit was given for it.
            TypeError: ``i`` is neither a Time, a string nor a number.

        Example:
            >>> Time.from_input(3, default_int_unit="ep"), Time.from_input("5BA")
            (Time(3, TimeUnit.EPOCH), Time(5, TimeUnit.BATCH))
        """
        if isinstance(i, Time):
            return i
        if isinstance(i, str):
            return cls.from_timestring(i)
        if _is_number(i):
            unit = default_int_unit if default_int_unit is not None else default_unit
            if unit is None:
                raise TimeUnitError(
                    f"cannot tell the unit of bare number {i!r}: pass a Time, a string such as "
                    f"'{i}ep' or '{i}ba', or set default_int_unit"
                )
            return cls(i, unit)
        raise TypeError(f"expected a Time, a time string or a number, got {i!r} ({type(i).__name__})")

    @classmethod
    def from_epoch(cls, epoch: int) -> Time[int]:
        """Return ``Time(epoch, "ep")``."""
        return cls(epoch, TimeUnit.EPOCH)

    @classmethod
    def from_iteration(cls, iteration: int) -> Time[int]:
        """Return ``Time(iteration, "iter")``."""
        return cls(iteration, TimeUnit.ITERATION)

    @classmethod
    def from_batch(cls, batch: int) -> Time[int]:
        """Return ``Time(batch, "ba")``."""
        return cls(batch, TimeUnit.BATCH)

    @classmethod
    def from_sample(cls, sample: int) -> Time[int]:
        """Return ``Time(sample, "sp")``."""
        return cls(sample, TimeUnit.SAMPLE)

    @classmethod
    def from_token(cls, token: int) -> Time[int]:
        """Return ``Time(token, "tok")``."""
        return cls(token, TimeUnit.TOKEN)

    @classmethod
    def from_duration(cls, duration: float) -> Time[float]:
        """Return ``Time(duration, "dur")``, a fraction of ``max_duration``."""
        return cls(duration, TimeUnit.DURATION)

    @classmethod
    def from_second(cls, second: float) -> Time:
        """Return ``Time(second, "sec")``, wall-clock seconds."""
        return cls(second, TimeUnit.SECOND)

    # -- formatting ---------------------------------------------------------------------------------

    def to_timestring(self) -> str:
        """Return the string form that ``from_timestring`` parses back, e.g. ``'10ep'``."""
        return f"{self._value!r}{self._unit.value}"

    def __str__(self) -> str:
        return self.to_timestring()

    def __repr__(self) -> str:
        return f"Time({self._value!r}, TimeUnit.{self._unit.name})"

    # -- immutability, hashing, pickling ------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Time is immutable; build a new one instead of setting {name!r}")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Time is immutable; cannot delete {name!r}")

    def __hash__(self) -> int:
        return hash((self._value, self._unit))

    def __reduce__(self) -> tuple[type[Time], tuple[int | float, TimeUnit]]:
        # The default slots protocol restores state through __setattr__, which is closed.
        return (Time, (self._value, self._unit))

    # -- conversion ---------------------------------------------------------------------------------

    def __int__(self) -> int:
        value = self._value
        return value if type(value) is int else int(value)

    def __float__(self) -> float:
        return float(self._value)

    def __bool__(self) -> bool:
        return self._value != 0

    # -- comparison ---------------------------------------------------------------------------------

    def _mismatch(self, other: Time, verb: str) -> TimeUnitError:
        return TimeUnitError(
            f"cannot {verb} {self} and {other}: units differ "
            f"({self._unit.value!r} vs {other._unit.value!r}); convert one of them first"
        )

    def _compared(self, other: object, verb: str) -> Any:
        """``other``'s amount in this unit, or NotImplemented; raises when its unit differs."""
        kind = type(other)
        if kind is int or kind is float:
            return other
        if kind is str:
            other = Time.from_timestring(other)  # type: ignore[arg-type]
        if isinstance(other, Time):
            if other._unit is not self._unit:
                raise self._mismatch(other, verb)
            return other._value
        if _is_number(other):
            return other
        return NotImplemented

    def __eq__(self, other: object) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value == other_value

    def __ne__(self, other: object) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value != other_value

    def __lt__(self, other: Time | str | int | float) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value < other_value

    def __le__(self, other: Time | str | int | float) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value <= other_value

    def __gt__(self, other: Time | str | int | float) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value > other_value

    def __ge__(self, other: Time | str | int | float) -> bool:
        other_value = self._compared(other, "compare")
        return other_value if other_value is NotImplemented else self._value >= other_value

    # -- arithmetic ---------------------------------------------------------------------------------

    def _same_unit(self, value: Any) -> Time:
        """A time of this unit holding ``value``; an int count in range skips the constructor's checks."""
        unit = self._unit
        if type(value) is int and unit is not _DURATION and -MAX_COUNT <= value <= MAX_COUNT:
            return _time(value, unit)
        return Time(value, unit)

    def _scaled(self, value: int | float) -> Time:
        """Return a time of this unit holding ``value``, rounded toward zero for whole-count units."""
        unit = self._unit
        if unit is not _DURATION and unit is not _SECOND and type(value) is float and math.isfinite(value):
            nearest = round(value)
            # Snap float noise (10 * 0.7 == 7.000000000000001) before rounding, so it does not lose a batch.
            value = nearest if math.isclose(value, nearest, rel_tol=1e-9, abs_tol=1e-9) else math.trunc(value)
        return self._same_unit(value)

    def __add__(self, other: Time | str | int | float) -> Time:
        other_value = self._compared(other, "add")
        return other_value if other_value is NotImplemented else self._same_unit(self._value + other_value)

    __radd__ = __add__

    def __sub__(self, other: Time | str | int | float) -> Time:
        other_value = self._compared(other, "subtract")
        return other_value if other_value is NotImplemented else self._same_unit(self._value - other_value)

    def __rsub__(self, other: Time | str | int | float) -> Time:
        other_value = self._compared(other, "subtract")
        return other_value if other_value is NotImplemented else self._same_unit(other_value - self._value)

    def __neg__(self) -> Time:
        return _time(-self._value, self._unit)

    def __pos__(self) -> Time:
        return self

    def __mod__(self, other: Time | str | int | float) -> Time:
        other_value = self._compared(other, "take the remainder of")
        return other_value if other_value is NotImplemented else self._same_unit(self._value % other_value)

    def __floordiv__(self, other: Time | str | int | float) -> Time:
        # Not in Composer; the partner of % (a == (a // b) * b + a % b) for interval arithmetic.
        other_value = self._compared(other, "divide")
        return other_value if other_value is NotImplemented else self._same_unit(self._value // other_value)

    def __mul__(self, other: Time | str | int | float) -> Time:
        if _is_number(other):
            return self._scaled(self._value * other)  # type: ignore[operator]
        if isinstance(other, str):
            other = Time.from_timestring(other)
        if not isinstance(other, Time):
            return NotImplemented
        if other._unit is _DURATION:
            return self._scaled(self._value * other._value)
        if self._unit is _DURATION:
            return other._scaled(other._value * self._value)
        raise TimeUnitError(f"cannot multiply {self} by {other}: units {self._unit.value!r} and "
                            f"{other._unit.value!r}; one of the two must be in 'dur' (a fraction)")

    __rmul__ = __mul__

    def __truediv__(self, other: Time | str | int | float) -> Time:
        if _is_number(other):
            return self._scaled(self._value / other)  # type: ignore[operator]
        other_value = self._compared(other, "divide")
        if other_value is NotImplemented:
            return other_value
        return Time(self._value / other_value, _DURATION)


# Building a Time on the clock's hot path skips the constructor's checks: the numbers are known good.
_new_object = object.__new__
_set_time_value = Time._value.__set__  # type: ignore[attr-defined]
_set_time_unit = Time._unit.__set__  # type: ignore[attr-defined]


def _time(value: int | float, unit: TimeUnit) -> Time:
    time = _new_object(Time)
    _set_time_value(time, value)
    _set_time_unit(time, unit)
    return time


def _wall_clock_seconds(text: str) -> int | float | None:
    """Seconds in ``'2h30m'``, ``'45m'``, ``'90s'``, ``'1.5h'``; None if ``text`` is not of that form."""
    match = _WALL_CLOCK_PATTERN.fullmatch(text)
    if not match or not any(match.groups()):
        return None
    hours, minutes, seconds = (_parse_number(g) if g else 0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    return int(total) if isinstance(total, float) and total.is_integer() else total


def ensure_time(maybe_time: Time | str | int | float, int_unit: TimeUnit | str) -> Time:
    """Return ``maybe_time`` as a ``Time``, reading a bare number in ``int_unit`` (as in Composer).

    Example:
        >>> ensure_time(3, "ba"), ensure_time("2ep", "ba")
        (Time(3, TimeUnit.BATCH), Time(2, TimeUnit.EPOCH))
    """
    return Time.from_input(maybe_time, int_unit)


def parse_time(
    value: Time | str | int | float,
    field: str,
    units: Sequence[TimeUnit] | None = None,
    default_unit: TimeUnit | str | None = None,
    *,
    minimum: float | None = 0,
    expected: str | None = None,
    hint: str | None = None,
) -> Time:
    """Read a time argument named ``field``: a Time, a time string, or a number in ``default_unit``.

    Every time argument of composerjax's plugins and checkpointer goes through here, and every
    time string through :meth:`Time.from_timestring` (``'10ep'``, ``'500ba'``, ``'10%'``,
    ``'2h30m'``, ``'45m'``...), so they all accept the same forms with the same errors.

    Args:
        value: what the user passed.
        field: the argument's name, for error messages (``'interval'``, ``'swa_start'``).
        units: the accepted units; None accepts any.
        default_unit: the unit of a bare number; None refuses bare numbers.
        minimum: the smallest accepted amount (in the time's own unit); 0 refuses negative
            times, None accepts any.
        expected: what an accepted value looks like, for the error when the unit or amount is
            wrong (default: ``"a time in 'ba', 'ep', got 'sp'"``).
        hint: put before the parser's own reason when ``value`` does not parse.

    Raises:
        ValueError: ``{field}={value!r}: [hint: ]<why it does not parse>``, or
            ``{field}={value!r}: expected <expected>`` for a unit or amount outside what is accepted.

    Example:
        >>> parse_time("2h30m", "time_limit", (TimeUnit.SECOND,))
        Time(9000, TimeUnit.SECOND)
        >>> parse_time(10, "interval", (TimeUnit.BATCH, TimeUnit.EPOCH), TimeUnit.BATCH)
        Time(10, TimeUnit.BATCH)
        >>> parse_time("10sp", "interval", (TimeUnit.BATCH, TimeUnit.EPOCH))
        Traceback (most recent call last):
        ...
        ValueError: interval='10sp': expected a time in 'ba', 'ep', got 'sp'
        >>> parse_time(-2, "interval", default_unit="ba")
        Traceback (most recent call last):
        ...
        ValueError: interval=-2: expected a non-negative time
    """
    try:
        time = Time.from_input(value, default_unit)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}={value!r}: " + (f"{hint}: " if hint else "") + str(error)) from None
    if units is not None and time.unit not in units:
        if expected is None:
            accepted = ", ".join(f"'{unit.value}'" for unit in units)
            expected = f"a time in {accepted}, got '{time.unit.value}'"
        raise ValueError(f"{field}={value!r}: expected {expected}")
    if minimum is not None and time.value < minimum:
        if expected is None:
            expected = "a non-negative time" if minimum == 0 else f"at least {minimum}{time.unit.value}"
        raise ValueError(f"{field}={value!r}: expected {expected}")
    return time


# composerjax.core.time is these classes' public home (with the clock): tracebacks, pickles and the docs name it.
for _public in (TimeUnit, TimeUnitError, Time):
    _public.__module__ = "composerjax.core.time"
