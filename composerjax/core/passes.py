"""Algorithm passes: functions that order, drop or add the algorithms that matched an event."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

from composerjax.core.algorithm import Algorithm
from composerjax.core.event import Event

__all__ = [
    "AlgorithmPass",
    "sort_run_first_and_last",
    "set_filo_order",
    "warn_if_multiple_loss_interpolation",
    "DEFAULT_PASSES",
]

#: ``pass(algorithms, event) -> algorithms``. Passes must depend only on their arguments: the
#: engine memoises their result per (event, matched algorithms).
AlgorithmPass = Callable[[Sequence[Algorithm], Event], list[Algorithm]]


def sort_run_first_and_last(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
    """Move algorithms with ``run_first = True`` to the front and ``run_last = True`` to the back.

    The sort is stable: algorithms keep their given order within each group.

    Example:
        >>> class A(Algorithm): run_last = True
        >>> class B(Algorithm): pass
        >>> [type(a).__name__ for a in sort_run_first_and_last([A(), B()], Event.BEFORE_LOSS)]
        ['B', 'A']
    """
    return sorted(algorithms, key=lambda a: (0 if a.run_first else 2 if a.run_last else 1))


def set_filo_order(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
    """Reverse the order on ``AFTER_*`` events, so the last to wrap a step is the first to unwrap it.

    Example:
        >>> class A(Algorithm): pass
        >>> class B(Algorithm): pass
        >>> [type(a).__name__ for a in set_filo_order([A(), B()], Event.AFTER_LOSS)]
        ['B', 'A']
    """
    if event.name.startswith("AFTER_"):
        return list(reversed(algorithms))
    return list(algorithms)


def warn_if_multiple_loss_interpolation(algorithms: Sequence[Algorithm], event: Event) -> list[Algorithm]:
    """Warn when more than one matching algorithm interpolates the loss (``interpolates_loss``)."""
    interpolating = [type(a).__name__ for a in algorithms if a.interpolates_loss]
    if len(interpolating) > 1:
        warnings.warn(
            f"{len(interpolating)} algorithms interpolate the loss at {event.name}: "
            f"{', '.join(interpolating)}; their effects compound. Use at most one.",
            UserWarning,
            stacklevel=2,
        )
    return list(algorithms)


DEFAULT_PASSES: tuple[AlgorithmPass, ...] = (
    sort_run_first_and_last,
    set_filo_order,
    warn_if_multiple_loss_interpolation,
)
