"""Checks of run settings that would otherwise be silently wrong or fail deep inside JAX.

Each check raises ``ValueError`` naming the field, the value given and what is accepted. The
settings sections (:mod:`composerjax.trainer.sections`) run them on the Trainer's arguments, and
they run again where a setting can change later (``fit(duration)``,
``state.max_duration``); recipes (:mod:`composerjax.trainer.config`) run the same checks at
validation, so the CLI reports them as bad input (exit status 2).

Example:
    >>> from composerjax.core.validation import check_seed
    >>> check_seed(17)
    17
    >>> check_seed(2**70)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: seed=1180591620717411303424: expected an integer from 0 to 4294967295 ...
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

from composerjax.core.time import Time, TimeUnit

__all__ = ["MAX_BATCHES", "seed_bounds", "check_seed", "check_ready_to_fit", "check_run_length", "check_interval"]

#: The most batches a run can span: the compiled step counts steps (and the steps in
#: ``max_duration``, for ``state.progress``) in int32.
MAX_BATCHES = 2**31 - 1


def seed_bounds() -> tuple[int, int]:
    """``(lowest, highest)`` seed that gives a distinct ``jax.random.key``.

    Without ``jax_enable_x64`` JAX keeps the low 32 bits of a seed (``2**32`` and ``-1`` would make
    the same key as ``0`` and ``2**32 - 1``), so seeds run from 0 to ``2**32 - 1``; with it, from 0
    to ``2**63 - 1``.
    """
    import jax

    return (0, 2**63 - 1) if jax.config.jax_enable_x64 else (0, 2**32 - 1)


def check_seed(seed: Any, field: str = "seed") -> int:
    """Return ``seed`` as an int, or raise ``ValueError`` if it is not an integer in :func:`seed_bounds`.

    Args:
        seed: the value given (an int or a numpy integer; ``bool`` is refused).
        field: the name to report it under.

    Raises:
        ValueError: naming ``field``, the value and the accepted range.
    """
    low, high = seed_bounds()
    accepted = f"expected an integer from {low} to {high}"
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"{field}={seed!r}: {accepted}, got a {type(seed).__name__}")
    seed = int(seed)
    if not low <= seed <= high:
        why = ("larger seeds would repeat smaller ones: JAX keeps their low 32 bits unless jax_enable_x64 is set"
               if high < 2**63 - 1 else "JAX seeds are 64-bit")
        raise ValueError(f"{field}={seed}: {accepted} ({why})")
    return seed


def check_ready_to_fit(state: Any, *, counts_tokens: bool, duration: Any = None) -> None:
    """``fit`` can start: a train loader, and a run length that ends (``duration``: what ``fit`` was given).

    Checked again at each ``fit``: ``fit(duration)`` and a ``state.max_duration`` set since the
    Trainer was built are new run lengths.

    Raises:
        ValueError: no train loader, no ``max_duration``, or a run length :func:`check_run_length` refuses.
    """
    if state.dataloader is None:
        raise ValueError("fit(): train_dataloader is None; pass one to Trainer(...) or fit(...)")
    if state.max_duration is None:
        raise ValueError("fit(): max_duration is None; pass max_duration to Trainer or a duration to fit()")
    check_run_length(state.max_duration, batches=state.batches_in_duration(), counts_tokens=counts_tokens,
                     field="duration" if duration is not None else "max_duration", given=duration)


def check_run_length(duration: Time | None, *, batches: int | None, counts_tokens: bool,
                     field: str = "max_duration", given: Any = None) -> None:
    """Refuse a run length that would never end or does not fit the step counter.

    Args:
        duration: the run's ``max_duration`` (None: nothing to check).
        batches: the batches it spans where known in advance (``State.batches_in_duration()``).
        counts_tokens: whether the trainer counts tokens (it was given ``tokens_per_batch``).
        field: the name to report (``'max_duration'``, ``'duration'``).
        given: the value as the user wrote it, for the message (default: ``duration``).

    Raises:
        ValueError: a ``'tok'`` duration without a token counter (the token count would stay 0 and
            training would never end), or more than :data:`MAX_BATCHES` batches.
    """
    if duration is None:
        return
    shown = f"{field}={str(given if given is not None else duration)!r}"
    if duration.unit is TimeUnit.TOKEN and not counts_tokens:
        raise ValueError(
            f"{shown}: a run measured in tokens needs tokens_per_batch=fn(batch) -> int to count them (without it "
            "the token count stays 0 and training never ends); pass tokens_per_batch, or give the run in ep, ba, sp "
            "or sec")
    if batches is not None and batches > MAX_BATCHES:
        raise ValueError(
            f"{shown} spans {batches} batches; expected at most {MAX_BATCHES} (the compiled step counts steps in "
            "int32)")


def check_interval(interval: Time | None, field: str,
                   units: Sequence[TimeUnit] = (TimeUnit.EPOCH, TimeUnit.BATCH), given: Any = None) -> None:
    """Refuse an interval the trainer would never act on: a unit it does not check, or zero.

    Args:
        interval: the parsed interval (None: nothing to check).
        field: the name to report (``'eval_interval'``).
        units: the units the trainer acts on for this field.
        given: the value as the user wrote it, for the message (default: ``interval``).

    Raises:
        ValueError: naming ``field``, the value and the accepted units.
    """
    if interval is None:
        return
    if interval.unit not in units or interval.value < 1:
        names = {TimeUnit.EPOCH: "epochs", TimeUnit.BATCH: "batches"}
        accepted = " or ".join(names.get(unit, unit.value) for unit in units)
        raise ValueError(f"{field}={str(given if given is not None else interval)!r}: expected a positive whole "
                         f"number of {accepted}, e.g. '1ep' or '500ba' (an int counts epochs)")


def to_time(value: Time | str | int | None, field: str) -> Time | None:
    """``value`` as a Time (an int counts epochs); None stays None. Errors name ``field``; negatives are refused."""
    if value is None:
        return value
    if isinstance(value, Time):
        time = value
    elif isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{field}={value!r}: expected a Time, a time string such as '10ep' or '500ba', or an "
                         "int (epochs)")
    else:
        try:
            time = Time.from_input(value, TimeUnit.EPOCH)
        except ValueError as error:
            raise ValueError(f"{field}: {error}") from error
    if time.value < 0:
        raise ValueError(f"{field}={str(value)!r}: expected a non-negative time")
    return time


def as_list(items: Any, kind: type, field: str) -> list[Any]:
    """One item or a sequence of ``kind`` as a list; anything else is refused naming ``field[i]``."""
    if items is None:
        return []
    if isinstance(items, kind):
        return [items]
    items = list(items)
    for index, item in enumerate(items):
        if not isinstance(item, kind):
            raise TypeError(f"{field}[{index}] is a {type(item).__name__}; expected a {kind.__name__}")
    return items


def loader_length(loader: Any) -> int | None:
    """``len(loader)``, or None for a loader without one."""
    try:
        return len(loader)
    except TypeError:
        return None
