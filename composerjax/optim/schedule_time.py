"""How schedulers read time: Composer's conversion rules, the run's context, and the two clocks.

A scheduler's times (``'10ba'``, ``'2ep'``, ``'0.1dur'``, ``'5000sp'``) are converted the way
Composer's ``_convert_time`` converts them: epochs become batches through the data loader's length,
``dur`` becomes a fraction of ``max_duration`` (in batches when ``max_duration`` is in epochs), and
everything but ``dur`` is stretched by the scale schedule ratio. The converted times are then read
by one of two clocks: :class:`HostClock` reads the trainer's ``Timestamp`` (Composer's host API),
:class:`StepClock` reads the optimizer step count inside the compiled step, counting ``sp`` and
``tok`` times through the samples and tokens of one step.

Example:
    >>> from composerjax.core.time import Time
    >>> convert_time('0.5dur', max_duration=Time(4, 'ep'), dataloader_len=10)
    Time(20, TimeUnit.BATCH)
    >>> convert_time('2ep', max_duration=Time(4, 'ep'), dataloader_len=10, ssr=0.5)
    Time(10, TimeUnit.BATCH)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composerjax.core.time import Time, TimeUnit

__all__ = ["HostClock", "ScheduleContext", "StepClock", "check_same_unit", "check_t_max_covers_run", "convert_time",
           "restart_cycles", "scale_max_duration"]

_INT32_MAX = 2**31 - 1
_COUNTERS = {TimeUnit.EPOCH: "epoch", TimeUnit.ITERATION: "iteration", TimeUnit.BATCH: "batch",
             TimeUnit.SAMPLE: "sample", TimeUnit.TOKEN: "token"}


def _as_time(value: Time | str, field: str) -> Time:
    try:
        return value if isinstance(value, Time) else Time.from_timestring(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{field}: {error}") from None


def convert_time(time: Time | str, max_duration: Time | None, dataloader_len: int | None, ssr: float = 1.0,
                 field: str = "time") -> Time:
    """A scheduler time in the unit the clock counts, by Composer's rules (``_convert_time``).

    ``dur`` is a fraction of ``max_duration`` (which the Trainer has already scaled by the ratio),
    counted in batches when ``max_duration`` is in epochs and in its own unit otherwise; epochs become
    batches (``dataloader_len`` per epoch); every time but ``dur`` is then multiplied by ``ssr``
    and truncated to a whole count.

    Args:
        time: the scheduler's argument, a Time or a string such as ``'10ba'``.
        max_duration: the run's length as the State holds it (after :func:`scale_max_duration`).
        dataloader_len: batches per epoch, or None when the data loader has no length.
        ssr: the scale schedule ratio.
        field: the argument, for error messages (``"StepScheduler(step_size='1ep')"``).

    Raises:
        ValueError: a negative or wall-clock time, no ``max_duration``, or epochs without a data loader length.

    Example:
        >>> convert_time('100sp', max_duration=Time(10, 'ep'), dataloader_len=5, ssr=0.5)
        Time(50, TimeUnit.SAMPLE)
    """
    time = _as_time(time, field)
    if time.value < 0:
        raise ValueError(f"{field}: expected a non-negative time, got {time}")
    if time.unit is TimeUnit.SECOND:
        raise ValueError(f"{field}: wall clock time is not an allowed time unit for a scheduler; use ba, ep, sp, "
                         "tok or dur")
    if max_duration is None:
        raise ValueError(f"{field}: max_duration should be set whenever schedulers are invoked")
    if time.unit is TimeUnit.DURATION:
        if max_duration.unit is TimeUnit.EPOCH:
            batches = time.value * _loader_length(dataloader_len, field) * max_duration.value
            return Time(int(batches), TimeUnit.BATCH)
        if max_duration.unit is TimeUnit.SECOND:
            raise ValueError(f"{field}: a 'dur' time is a fraction of max_duration, which is wall-clock time "
                             f"({max_duration}); give the scheduler's times in ba, ep, sp or tok")
        return Time(int(time.value * max_duration.value), max_duration.unit)
    value, unit = time.value, time.unit
    if unit is TimeUnit.EPOCH:
        # Epochs are too coarse to stretch (1ep * 0.5 would be 0): Composer counts them in batches first.
        value, unit = value * _loader_length(dataloader_len, field), TimeUnit.BATCH
    return Time(int(value * ssr), unit)


def _loader_length(dataloader_len: int | None, field: str) -> int:
    if dataloader_len is None:
        raise ValueError(f"{field}: cannot convert epochs to batches: the train data loader has no length "
                         "(give the time in ba, sp or tok)")
    return int(dataloader_len)


def scale_max_duration(max_duration: Time | str | int, ssr: float) -> Time:
    """``max_duration`` stretched by the scale schedule ratio, as Composer's Trainer does it.

    The amount is multiplied by ``ssr`` and truncated to a whole count in the same unit (so
    ``'10ep'`` at 0.25 is ``2ep``, not 20 batches). Pass the result to the State and to
    :class:`ScheduleContext`; schedulers read ``dur`` against it.

    Raises:
        ValueError: ``ssr`` is not positive, ``max_duration`` is wall-clock time, or the scaled
            length is 0 (Composer's message).

    Example:
        >>> scale_max_duration('10ep', 0.25)
        Time(2, TimeUnit.EPOCH)
        >>> scale_max_duration(Time(1000, 'ba'), 0.5)
        Time(500, TimeUnit.BATCH)
    """
    if isinstance(ssr, bool) or not isinstance(ssr, numbers.Real) or not math.isfinite(ssr) or ssr <= 0:
        raise ValueError(f"scale_schedule_ratio={ssr!r}: expected a positive number")
    duration = Time.from_input(max_duration, TimeUnit.EPOCH)
    if ssr == 1.0:
        return duration
    if duration.unit in (TimeUnit.SECOND, TimeUnit.DURATION, TimeUnit.ITERATION):
        raise ValueError(f"scale_schedule_ratio={ssr!r}: cannot scale max_duration='{duration}'; use ep, ba, sp "
                         "or tok")
    scaled = int(duration.value * ssr)
    if scaled == 0:
        raise ValueError("Scale schedule has reduced the max_duration to 0. Set a higher ratio or use more epochs.")
    return Time(scaled, duration.unit)


def check_same_unit(t_warmup: Time, t_max: Time, owner: str) -> None:
    """Refuse a warmup and a ``t_max`` that convert to different units (Composer's check)."""
    if t_warmup.unit is not t_max.unit:
        raise ValueError(f"{owner}: cannot use a warmup scheduler with t_max {t_max} with units {t_max.unit.value} "
                         f"and t_warmup {t_warmup} with units {t_warmup.unit.value}. t_warmup and t_max must use "
                         "the same units.")


def check_t_max_covers_run(t_max: Time, max_duration: Time | None, dataloader_len: int | None, owner: str) -> None:
    """Refuse a converted ``t_max`` shorter than ``max_duration`` where the two can be compared (Composer's check).

    Example:
        >>> check_t_max_covers_run(Time(50, 'ba'), Time(1, 'ep'), 100, 'LinearWithWarmupScheduler')
        Traceback (most recent call last):
        ...
        ValueError: LinearWithWarmupScheduler: t_max 50ba must be greater than or equal to max_duration 1ep. ...
    """
    if max_duration is None:
        return
    if t_max.unit is max_duration.unit:
        short = t_max.value < max_duration.value
    elif t_max.unit is TimeUnit.BATCH and max_duration.unit is TimeUnit.EPOCH and dataloader_len is not None:
        short = t_max.value < max_duration.value * int(dataloader_len)
    else:
        return  # not comparable: Composer lets it pass
    if short:
        raise ValueError(f"{owner}: t_max {t_max} must be greater than or equal to max_duration {max_duration}. "
                         "Otherwise, the LR schedule will not be defined for the entire training duration.")


def _positive_or_none(value: int | None, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"ScheduleContext({field}={value!r}): expected a positive integer or None")
    return int(value)


@dataclasses.dataclass(frozen=True)
class ScheduleContext:
    """What a scheduler needs to become a function of the optimizer step count: the run and one step's size.

    Args:
        max_duration: the run's length as the State holds it, already scaled by
            :func:`scale_max_duration` (``dur`` times are fractions of it).
        steps_per_epoch: optimizer steps (batches) per epoch, or None when the data loader has no length.
        samples_per_step: samples in one step's batch (all data-parallel ranks), or None when unknown;
            needed only for times in ``sp`` (or ``dur`` of a ``sp`` max_duration).
        tokens_per_step: tokens in one step's batch, or None; needed only for times in ``tok``.
        scale_schedule_ratio: Composer's ``scale_schedule_ratio`` (the ``ssr`` of the host API).

    Example:
        >>> context = ScheduleContext(Time(2, 'ep'), steps_per_epoch=50, samples_per_step=32)
        >>> context.total_steps, context.steps_per_unit(TimeUnit.SAMPLE, 'x')
        (100, 32)
    """

    max_duration: Time
    steps_per_epoch: int | None = None
    samples_per_step: int | None = None
    tokens_per_step: int | None = None
    scale_schedule_ratio: float = 1.0

    def __post_init__(self) -> None:
        duration = Time.from_input(self.max_duration, TimeUnit.EPOCH)
        if duration.unit in (TimeUnit.DURATION, TimeUnit.ITERATION):
            raise ValueError(f"ScheduleContext(max_duration='{duration}'): a run is measured in ep, ba, sp, tok or sec")
        object.__setattr__(self, "max_duration", duration)
        for field in ("steps_per_epoch", "samples_per_step", "tokens_per_step"):
            object.__setattr__(self, field, _positive_or_none(getattr(self, field), field))
        ssr = self.scale_schedule_ratio
        if isinstance(ssr, bool) or not isinstance(ssr, numbers.Real) or not math.isfinite(ssr) or ssr <= 0:
            raise ValueError(f"ScheduleContext(scale_schedule_ratio={ssr!r}): expected a positive number")

    @classmethod
    def from_state(cls, state: Any, samples_per_step: int | None = None, tokens_per_step: int | None = None,
                   scale_schedule_ratio: float = 1.0) -> ScheduleContext:
        """The context of a State: its (scaled) ``max_duration`` and ``dataloader_len`` as steps per epoch."""
        return cls(state.max_duration, state.dataloader_len, samples_per_step, tokens_per_step, scale_schedule_ratio)

    @property
    def total_steps(self) -> int | None:
        """The optimizer steps in ``max_duration``, where they are known in advance (else None)."""
        duration = self.max_duration
        per_unit = {TimeUnit.BATCH: 1, TimeUnit.SAMPLE: self.samples_per_step, TimeUnit.TOKEN: self.tokens_per_step}
        if duration.unit is TimeUnit.EPOCH:
            return None if self.steps_per_epoch is None else int(duration.value) * self.steps_per_epoch
        size = per_unit.get(duration.unit)
        return None if size is None else -(-int(duration.value) // size)

    def steps_per_unit(self, unit: TimeUnit, field: str) -> int:
        """How many of ``unit`` one optimizer step counts: 1 for ``ba``, the step's samples or tokens.

        Raises:
            ValueError: naming ``field`` when a step's size in ``unit`` is unknown or the unit is
                not counted in steps (iterations, wall-clock time).
        """
        if unit is TimeUnit.BATCH:
            return 1
        if unit is TimeUnit.SAMPLE and self.samples_per_step is not None:
            return self.samples_per_step
        if unit is TimeUnit.TOKEN and self.tokens_per_step is not None:
            return self.tokens_per_step
        if unit in (TimeUnit.SAMPLE, TimeUnit.TOKEN):
            size = "samples_per_step" if unit is TimeUnit.SAMPLE else "tokens_per_step"
            raise ValueError(f"{field} is counted in '{unit.value}', but the number of {unit.name.lower()}s in one "
                             f"optimizer step is unknown ({size}=None); give the time in ba, ep or dur (of a ba or "
                             f"ep max_duration), or a batch of fixed size")
        raise ValueError(f"{field} is counted in '{unit.value}', which the step count cannot measure; give the "
                         "time in ba, ep, sp, tok or dur")


def _floor_div(step: jax.Array, a: int, c: int, b: int) -> jax.Array:
    """``floor((step * a + c) / b)`` for int32 ``step`` and Python ints, exact where int32 allows."""
    carry, c = divmod(c, b)
    if b * (a + 1) < _INT32_MAX:
        whole, rest = step // b, step % b
        return carry + whole * a + (rest * a + c) // b
    return carry + jnp.floor((step.astype(jnp.float32) * a + c) / b).astype(jnp.int32)


class HostClock:
    """Composer's reading of time: the timestamp's counter in each time's own unit (numpy float64 math).

    Example:
        >>> from composerjax.core.time import Timestamp
        >>> clock = HostClock(Timestamp(batch=25))
        >>> clock.before(Time(30, 'ba')), clock.multiples(Time(10, 'ba')), clock.progress(Time(100, 'ba'))
        (True, 2, 0.25)
    """

    xp = np

    def __init__(self, timestamp: Any) -> None:
        self.timestamp = timestamp

    def now(self, unit: TimeUnit) -> int:
        """The timestamp's count in ``unit``."""
        if unit not in _COUNTERS:
            raise ValueError(f"a scheduler cannot read the clock in '{unit.value}'")
        return int(getattr(self.timestamp, _COUNTERS[unit]))

    def before(self, time: Time) -> bool:
        """``timestamp < time``."""
        return self.now(time.unit) < time.value

    def multiples(self, time: Time) -> int:
        """Whole ``time`` periods elapsed (Composer's ``int(current_time / step_size)``)."""
        return int(self.now(time.unit) / time.value)

    def progress(self, end: Time, start: Time | None = None) -> float:
        """``(now - start) / (end - start)``, unclipped; 0 when ``end`` is not after ``start``."""
        begin = 0 if start is None else start.value
        if end.value <= begin:
            return 0.0
        return (self.now(end.unit) - begin) / (end.value - begin)

    def restart_progress(self, t_0: Time, t_mult: float, owner: str) -> float:
        """The fraction of the current warm-restart cycle elapsed (Composer's loop, cycle by cycle)."""
        now = self.now(t_0.unit)
        length, end = t_0.value, t_0.value
        while end <= now:
            if length == 0:
                raise ValueError(f"{owner}: Interval between restarts for cosine annealing/warm restarts scheduler "
                                 "has decayed to 0.")
            length = int(t_mult * length)
            end += length
        return (now - (end - length)) / length


class StepClock:
    """The optimizer step count, reading times through the steps they span (jnp, traceable).

    A time of ``n`` units, where one step counts ``k`` of them, is passed once the step count times
    ``k`` reaches ``n``; comparisons and whole periods use integer arithmetic, fractions float32.

    Example:
        >>> import jax.numpy as jnp
        >>> context = ScheduleContext(Time(10, 'ep'), steps_per_epoch=10, samples_per_step=4)
        >>> clock = StepClock(jnp.int32(5), context)
        >>> bool(clock.before(Time(21, 'sp'))), int(clock.multiples(Time(6, 'sp')))
        (True, 3)
        >>> float(clock.progress(Time(40, 'sp')))
        0.5
    """

    xp = jnp

    def __init__(self, step: jax.Array, context: ScheduleContext) -> None:
        self.step = jnp.asarray(step, jnp.int32)
        self.context = context

    def _size(self, time: Time) -> int:
        return self.context.steps_per_unit(time.unit, str(time))

    def before(self, time: Time) -> jax.Array:
        """``step * size < time``: the step count is below the first step that reaches ``time``."""
        return self.step < min(-(-time.value // self._size(time)), _INT32_MAX)

    def multiples(self, time: Time) -> jax.Array:
        """Whole ``time`` periods elapsed: ``floor(step * size / time)``."""
        return _floor_div(self.step, self._size(time), 0, time.value)

    def progress(self, end: Time, start: Time | None = None) -> jax.Array:
        """``(step * size - start) / (end - start)`` in float32, unclipped; 0 when ``end`` is not after ``start``."""
        begin = 0 if start is None else start.value
        if end.value <= begin:
            return jnp.float32(0.0)
        size = self._size(end)
        return (self.step.astype(jnp.float32) - begin / size) / ((end.value - begin) / size)

    def restart_progress(self, t_0: Time, t_mult: float, owner: str) -> jax.Array:
        """The fraction of the current warm-restart cycle elapsed, from cycles laid out on the host."""
        size = self._size(t_0)
        starts, lengths, periodic = restart_cycles(t_0.value, t_mult, self.context.total_steps, size, owner)
        first_steps = np.minimum([-(-start // size) for start in starts], _INT32_MAX).astype(np.int32)
        index = jnp.searchsorted(jnp.asarray(first_steps), self.step, side="right") - 1
        start = jnp.asarray(np.asarray(starts, np.float64) / size, jnp.float32)[index]
        length = jnp.asarray(np.asarray(lengths, np.float64) / size, jnp.float32)[index]
        if periodic:  # the last cycle repeats: move to the repeat the step is in
            last_start, last_length = starts[-1], lengths[-1]
            repeats = jnp.maximum(_floor_div(self.step, size, -last_start, last_length), 0)
            on_last = index == len(starts) - 1
            start = jnp.where(on_last, (last_start + repeats.astype(jnp.float32) * last_length) / size, start)
        return (self.step.astype(jnp.float32) - start) / length


def restart_cycles(t_0: int, t_mult: float, total_steps: int | None, size: int,
                   owner: str) -> tuple[list[int], list[int], bool]:
    """``(starts, lengths, periodic)`` of warm-restart cycles in the time's unit, as Composer grows them.

    Each cycle is ``int(t_mult * previous)`` long. The list stops where the lengths stop changing
    (``periodic``: the last cycle repeats), past the end of the run, or where a cycle would be 0
    long: Composer raises there, so a run that reaches it is refused here.

    Example:
        >>> restart_cycles(30, 2.0, total_steps=100, size=1, owner='s')
        ([0, 30, 90], [30, 60, 120], False)
    """
    horizon = (_INT32_MAX if total_steps is None else total_steps) * size
    starts, lengths, start, length = [], [], 0, t_0
    while True:
        starts.append(start)
        lengths.append(length)
        following = int(t_mult * length)
        if following == length:
            return starts, lengths, True
        if following == 0:
            last = total_steps - 1 if total_steps is not None else None
            if last is not None and last * size >= start + length:
                raise ValueError(f"{owner}: Interval between restarts for cosine annealing/warm restarts scheduler "
                                 f"has decayed to 0 at {start + length} (the run goes on to step {last}).")
            return starts, lengths, False
        start, length = start + length, following
        if start > horizon:
            return starts, lengths, False
        if len(starts) > 1_000_000:
            raise ValueError(f"{owner}: more than a million warm-restart cycles in the run; use a larger t_0 or t_mult")
