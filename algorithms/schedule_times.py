"""Time arguments of algorithm schedules: parsing them, and where a run stands against them."""

from __future__ import annotations

from typing import Any

import jax

from composerjax import State, Time, Timestamp, TimeUnit
from composerjax.core.time import parse_time

__all__ = ["parse_schedule_time", "after_this_batch", "reached", "planned_progress"]


def parse_schedule_time(value: Any, field: str, units: tuple[TimeUnit, ...]) -> Time:
    """Parse ``value`` (a Time or a string like ``'100ba'``) and check it is in one of ``units``.

    Raises:
        ValueError: naming ``field``, the value and the accepted units.

    Example:
        >>> parse_schedule_time('0.5dur', 'swa_start', (TimeUnit.DURATION,))
        Time(0.5, TimeUnit.DURATION)
    """
    accepted = ", ".join(f"'{unit.value}'" for unit in units)
    time = parse_time(value, field, units, hint=f"expected a time string in {accepted} (e.g. '100ba')")
    if time.value < 0 or (time.unit == TimeUnit.DURATION and time.value > 1):
        raise ValueError(f"{field}={value!r}: expected a non-negative time (at most 1 in 'dur')")
    return time


def after_this_batch(state: State) -> Timestamp:
    """The clock as it will read once the batch about to run is done (``match`` runs before the step)."""
    leaves = jax.tree.leaves(state.batch)
    samples = int(leaves[0].shape[0]) * jax.process_count() if leaves and hasattr(leaves[0], "shape") else 0
    return state.timestamp.to_next_batch(samples=samples)


def reached(time: Time, timestamp: Timestamp, state: State) -> bool:
    """Whether ``timestamp`` is at or past ``time`` (a fraction of ``max_duration`` for ``'dur'``).

    Fractions are measured in batches where the run's length in batches is known, so ``'0.5dur'`` of
    a one-epoch run is reached in the middle of the epoch, not at its end.
    """
    if time.unit == TimeUnit.DURATION:
        total = state.batches_in_duration() if state.max_duration is not None else None
        if total:
            return timestamp.batch.value / total >= time.value
        return state.max_duration is not None and timestamp.get_progress(state.max_duration) >= time.value
    return timestamp.get(time.unit).value >= time.value


def planned_progress(state: State) -> list[float]:
    """The progress at which each batch of the whole run starts (durations in batches or epochs).

    Raises:
        ValueError: when the number of batches in ``max_duration`` is not known in advance.
    """
    total = state.batches_in_duration()
    if total is None:
        raise ValueError(f"max_duration={state.max_duration}: the batches of the run are known in advance only for "
                         "'ba' durations, or 'ep' durations with a sized dataloader")
    return [step / total for step in range(total)]
