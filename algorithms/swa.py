"""Stochastic Weight Averaging (Izmailov et al. 2018): average the weights late in training and keep the average.

The functional form is :func:`swa_update` (a running mean with ``optax.incremental_update``).
:class:`SWA` keeps the average in its device state, updates it between ``swa_start`` and
``swa_end`` (inside the compiled step at ``AFTER_OPTIMIZER_STEP`` for batch intervals, on the host at
``EPOCH_END`` for epoch intervals) and, when ``swa_end`` is reached, replaces the trained weights
by the average; training then goes on from the averaged weights until ``max_duration``, as in
Composer.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composerjax import Algorithm, Event, Logger, State, Time, Timestamp, TimeUnit
from composerjax.algorithms.schedule_times import after_this_batch, parse_schedule_time, reached

__all__ = ["SWA", "swa_update"]

log = logging.getLogger(__name__)


def swa_update(average: Any, params: Any, count: int | jax.Array) -> tuple[Any, jax.Array]:
    """Add ``params`` to a running mean of ``count`` weight snapshots; return ``(average, count + 1)``.

    With ``count == 0`` the average becomes ``params`` exactly. Pure and jit-able.

    Example:
        >>> import jax.numpy as jnp
        >>> average, count = swa_update({'w': jnp.zeros(1)}, {'w': jnp.array([3.0])}, 0)
        >>> average, count = swa_update(average, {'w': jnp.array([5.0])}, count)
        >>> average['w'], int(count)
        (Array([4.], dtype=float32), 2)
    """
    count = jnp.asarray(count, jnp.int32)
    step_size = 1.0 / (count + 1).astype(jnp.float32)
    return optax.incremental_update(params, average, step_size), count + 1


def _update(own: dict[str, Any], params: Any) -> dict[str, Any]:
    average, count = swa_update(own["params"], params, own["count"])
    return {"params": average, "count": count}


_update_on_device = jax.jit(_update)
_copy_on_device = jax.jit(lambda tree: jax.tree.map(jnp.copy, tree))


class SWA(Algorithm):
    """Average the weights from ``swa_start`` to ``swa_end``, then continue training from the average.

    Between ``swa_start`` and ``swa_end`` the running mean of the weights is updated on the first
    batch (or epoch) of the window and every ``update_interval`` after it. When ``swa_end`` is
    reached the trained weights are replaced by the average (the optimizer state is kept) and
    training continues until ``max_duration``; leave some training after ``swa_end`` so
    normalisation statistics (batch norm) adapt to the averaged weights: they are not recomputed.

    Events: the average lives in the device state ``state.algorithm_state['SWA']``
    (``{'params': ..., 'count': ...}``). Batch intervals update it inside the compiled step at
    ``AFTER_OPTIMIZER_STEP`` (traced; the update batches are chosen on the host in ``match``, so at
    most two compiled steps) and swap it in at ``BATCH_END``; epoch intervals update and swap on the
    host at ``EPOCH_END``.

    Composer's SWA learning-rate schedule is not built in: an optax optimizer's schedule is part
    of the optimizer, so give it the SWA schedule directly, e.g. ``optax.join_schedules`` of the
    main schedule and ``optax.constant_schedule(swa_lr)`` at the ``swa_start`` step.

    Args:
        swa_start: how much training comes before averaging starts (``'dur'`` or ``'ep'``).
            Default: ``'0.7dur'``.
        swa_end: when the weights are replaced by the average (same unit as ``swa_start``, later
            than it). Default: ``'0.97dur'``.
        update_interval: how often the average is updated (``'ba'`` or ``'ep'``). Default: ``'1ep'``.
        schedule_swa_lr: must be ``False``; see above for the optax schedule instead.
        swa_lr: must be ``None``; see above.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.swa import SWA

        trainer = Trainer(model, train_loader, '10ep', optax.sgd(0.05, momentum=0.9),
                          algorithms=[SWA(swa_start='6ep', swa_end='8ep', update_interval='1ep')])
        trainer.fit()
    """

    def __init__(
        self,
        swa_start: str | Time = "0.7dur",
        swa_end: str | Time = "0.97dur",
        update_interval: str | Time = "1ep",
        schedule_swa_lr: bool = False,
        swa_lr: float | None = None,
    ) -> None:
        if schedule_swa_lr is not False:
            raise ValueError(f"schedule_swa_lr={schedule_swa_lr!r}: only False is supported; put the SWA learning "
                             "rate into the optax optimizer's schedule (e.g. optax.join_schedules)")
        if swa_lr is not None:
            raise ValueError(f"swa_lr={swa_lr!r}: only None is supported (there is no SWA learning-rate schedule "
                             "here); put the SWA learning rate into the optax optimizer's schedule, e.g. "
                             "optax.join_schedules([main_schedule, optax.constant_schedule(swa_lr)], [swa_start_step])")
        window_units = (TimeUnit.DURATION, TimeUnit.EPOCH)
        self.swa_start = parse_schedule_time(swa_start, "swa_start", window_units)
        self.swa_end = parse_schedule_time(swa_end, "swa_end", window_units)
        if self.swa_start.unit != self.swa_end.unit:
            raise ValueError(f"swa_start={swa_start!r} and swa_end={swa_end!r}: expected the same unit")
        if not self.swa_start.value < self.swa_end.value:
            raise ValueError(f"swa_end={swa_end!r}: expected a time after swa_start={swa_start!r}")
        self.update_interval = parse_schedule_time(update_interval, "update_interval", (TimeUnit.BATCH, TimeUnit.EPOCH))
        if self.update_interval.value < 1:
            raise ValueError(f"update_interval={update_interval!r}: expected at least 1 batch or epoch")
        self.schedule_swa_lr = False
        self.swa_lr = None
        self._window_steps = 0  # batches or epochs seen inside the window (Composer's step counter)
        self._completed = False

    # -- device state ----------------------------------------------------------------------------
    def init_state(self, state: State) -> dict[str, Any]:
        """An empty running mean: zeros of the parameters' structure and a count of 0."""
        params = nnx.to_pure_dict(nnx.split(state.model, nnx.Param, ...)[1])
        return {"params": jax.tree.map(jnp.zeros_like, params), "count": jnp.zeros((), jnp.int32)}

    # -- events ----------------------------------------------------------------------------------
    events = frozenset({Event.AFTER_OPTIMIZER_STEP, Event.BATCH_END, Event.EPOCH_END})

    def match(self, event: Event, state: State) -> bool:
        """Update inside the window on every ``update_interval``; swap the average in at ``swa_end``.

        For batch intervals the answer is a function of the clock alone (when the window closed,
        how many batches it has seen), so ``composerjax explain`` predicts it without applying.
        """
        by_batch = self.update_interval.unit == TimeUnit.BATCH
        if self._completed and not by_batch:
            return False
        done = state.timestamp.batch.value
        if event == Event.AFTER_OPTIMIZER_STEP:
            return (by_batch and not self._completed_by(done, state)
                    and self._window_steps_by(done, state) % self.update_interval.value == 0
                    and reached(self.swa_start, after_this_batch(state), state))
        if event == Event.BATCH_END and by_batch:
            return not self._completed_by(done - 1, state) and reached(self.swa_start, state.timestamp, state)
        if event == Event.EPOCH_END and not by_batch:
            return reached(self.swa_start, state.timestamp, state)
        return False

    def _at_batch_end(self, batch: int, state: State) -> Timestamp:
        """The clock as ``BATCH_END`` of batch ``batch`` saw it (its epoch not closed yet)."""
        per_epoch = state.dataloader_len
        epoch = (batch - 1) // per_epoch if per_epoch else state.timestamp.epoch.value
        return Timestamp(epoch=epoch, batch=batch)

    def _completed_by(self, batch: int, state: State) -> bool:
        """Whether the window closed (``swa_end`` reached) at a ``BATCH_END`` up to batch ``batch``."""
        return self._completed or (batch >= 1 and reached(self.swa_end, self._at_batch_end(batch, state), state))

    def _window_steps_by(self, batch: int, state: State) -> int:
        r"""How many ``BATCH_END``\ s up to batch ``batch`` fell inside the window (Composer's step counter)."""
        if self.update_interval.value == 1:
            return 0  # every batch: the count does not matter
        low, high = 1, batch + 1  # the first batch whose BATCH_END is in the window (reached is monotonic)
        while low < high:
            middle = (low + high) // 2
            if reached(self.swa_start, self._at_batch_end(middle, state), state):
                high = middle
            else:
                low = middle + 1
        return max(0, batch - low + 1)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Update the running mean; at ``swa_end`` replace the weights by it."""
        if event == Event.AFTER_OPTIMIZER_STEP:  # traced
            state.algorithm_state[self.name] = _update(state.algorithm_state[self.name], state.params)
            return
        if event == Event.EPOCH_END and self._window_steps % self.update_interval.value == 0:
            own = _update_on_device(state.algorithm_state[self.name], state.params)
            state.algorithm_state = {**state.algorithm_state, self.name: own}
        self._window_steps += 1
        if reached(self.swa_end, state.timestamp, state):
            self._completed = True
            # A copy: the next step donates the train state, and one buffer cannot be donated twice.
            state.params = _copy_on_device(state.algorithm_state[self.name]["params"])
            if state.max_duration is not None and state.progress >= 1.0:
                log.warning("SWA: the averaged weights replaced the trained ones at the end of training; "
                            "batch-norm statistics were not updated for them (set swa_end before the end)")

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The host side of the window: steps seen in it and whether the average was swapped in."""
        return {"window_steps": self._window_steps, "completed": self._completed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self._window_steps = int(state["window_steps"])
        self._completed = bool(state["completed"])

    def __repr__(self) -> str:
        return f"SWA(swa_start={self.swa_start}, swa_end={self.swa_end}, update_interval={self.update_interval})"





