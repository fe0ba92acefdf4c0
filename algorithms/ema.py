"""Exponential moving average (EMA) of the weights and buffers, kept on the device and swapped in for evaluation.

The functional form is :func:`compute_ema` (``optax.incremental_update``). :class:`EMA` keeps the
averaged weights, and as Composer the averaged buffers (the model's other floating-point state,
e.g. batch-norm running statistics), in its device state, updates them inside the compiled step at
``AFTER_OPTIMIZER_STEP`` (batch intervals) or on the host at ``EPOCH_END`` (epoch intervals), and
swaps them in for evaluation. As in Composer, the trained values stay in the model after ``fit``;
read the averaged ones with :meth:`EMA.ema_params` and :meth:`EMA.ema_buffers`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composerjax import Algorithm, Event, Logger, State, Time, Timestamp, TimeUnit
from composerjax.algorithms.schedule_times import after_this_batch, parse_schedule_time, reached

__all__ = ["EMA", "compute_ema", "ema_decay", "model_buffers"]


def compute_ema(params: Any, ema_params: Any, decay: float | jax.Array) -> Any:
    """Return ``decay * ema_params + (1 - decay) * params``, leaf by leaf (pure, jit-able).

    Args:
        params: the latest weights.
        ema_params: the running average (same structure).
        decay: how much of the old average is kept, in ``[0, 1]`` (Composer's ``smoothing``).

    Example:
        >>> import jax.numpy as jnp
        >>> compute_ema({'w': jnp.array([1.0])}, {'w': jnp.array([0.0])}, decay=0.75)['w']
        Array([0.25], dtype=float32)
    """
    return optax.incremental_update(params, ema_params, 1.0 - decay)


def ema_decay(half_life: Time | str, update_interval: Time | str) -> float:
    """Return the decay per update for a half life: ``0.5 ** (update_interval / half_life)``.

    A half life of 0 gives 0 (no averaging: the average is the latest weights).

    Example:
        >>> ema_decay('10ba', '10ba')
        0.5
    """
    half_life, update_interval = Time.from_input(half_life), Time.from_input(update_interval)
    if half_life.unit != update_interval.unit:
        raise ValueError(f"half_life={half_life} and update_interval={update_interval} must use the same unit")
    if half_life.value == 0:
        return 0.0
    return 0.5 ** (update_interval.value / half_life.value)


def _is_buffer(path: tuple[Any, ...], value: Any) -> bool:
    """A floating-point model variable that is neither a parameter nor RNG state (Composer's buffers)."""
    del path
    if not isinstance(value, nnx.Variable) or isinstance(value, (nnx.Param, nnx.RngState)):
        return False
    return jnp.issubdtype(jnp.result_type(value.get_value()), jnp.floating)


def model_buffers(model: nnx.Module) -> dict[str, Any]:
    """The variables EMA averages besides the weights, as a nested dict like ``nnx.to_pure_dict``.

    Composer averages every buffer of the module (``named_buffers``) with the weights: here, every
    floating-point variable that is not an ``nnx.Param`` nor RNG state, e.g. ``nnx.BatchStat``.

    Example:
        >>> bn = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.BatchNorm(2, rngs=nnx.Rngs(0)))
        >>> jax.tree.map(lambda a: a.tolist(), model_buffers(bn))
        {'layers': {1: {'mean': [0.0, 0.0], 'var': [1.0, 1.0]}}}
    """
    return nnx.to_pure_dict(nnx.state(model, _is_buffer))


def _update(own: dict[str, Any], params: Any, buffers: Any, decay: float | jax.Array) -> dict[str, Any]:
    """One EMA update of the device state; the first update after the start copies the weights and buffers."""
    decay = jnp.where(own["started"], decay, 0.0)
    return {"params": compute_ema(params, own["params"], decay), "buffers": compute_ema(buffers, own["buffers"], decay),
            "started": jnp.asarray(True)}


_update_on_device = jax.jit(_update)


class EMA(Algorithm):
    """Keep an exponential moving average of the weights and buffers and evaluate with it.

    ``ema = smoothing * ema + (1 - smoothing) * weights`` every ``update_interval`` once training
    has reached ``ema_start``; the first update copies the weights (the average starts there).
    ``smoothing`` comes from ``half_life``: ``0.5 ** (update_interval / half_life)``. As in
    Composer, the model's buffers (:func:`model_buffers`: floating-point state that is not a
    parameter nor RNG state, e.g. batch-norm running statistics) are averaged the same way, so
    evaluation pairs averaged weights with averaged statistics.

    Events: the average lives in the device state ``state.algorithm_state['EMA']``
    (``{'params': ..., 'buffers': ..., 'started': ...}``, initialised with a copy of the initial
    weights and buffers; checkpointed with the train state).
    Batch intervals update it inside the compiled step at ``AFTER_OPTIMIZER_STEP`` (traced; the update
    batches are chosen on the host in ``match``, so at most two compiled steps); epoch intervals
    update it on the host at ``EPOCH_END``. At ``EVAL_START`` (host) the averaged weights replace
    ``state.params`` (and the averaged buffers the model's, through ``state.update_model()``) and at
    ``EVAL_END`` the trained ones come back, bit for bit (evaluation before the average has started
    uses the trained values). After ``fit`` the model keeps the trained values, as in Composer: get
    the average with :meth:`ema_params` and :meth:`ema_buffers`.

    Args:
        half_life: the time (``'ba'`` or ``'ep'``, a whole number) after which an old weight's
            share of the average has halved. ``'0ba'`` means no averaging. Default: ``'1000ba'``.
        smoothing: the decay per update, in ``(0, 1)``, instead of ``half_life`` (pass
            ``half_life=None`` with it). Default: ``None``.
        ema_start: how much training comes before the average starts (``'dur'``, ``'ba'`` or
            ``'ep'``). Default: ``'0.0dur'``.
        update_interval: how often the average is updated (``'ba'`` or ``'ep'``, in the unit of
            ``half_life``). Default: one unit of ``half_life`` (``'1ba'`` with ``smoothing``).

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.ema import EMA

        ema = EMA(half_life='100ba')
        trainer = Trainer(model, train_loader, '10ep', optax.adam(1e-3), eval_dataloader=val_loader,
                          algorithms=[ema])
        trainer.fit()                                   # evaluations use the averaged weights
        averaged = ema.ema_params(trainer.state)        # nested dict, like state.params
    """

    def __init__(
        self,
        half_life: str | Time | None = "1000ba",
        smoothing: float | None = None,
        ema_start: str | Time = "0.0dur",
        update_interval: str | Time | None = None,
    ) -> None:
        if half_life is None and smoothing is None:
            raise ValueError("EMA: half_life=None and smoothing=None: set one of them (e.g. half_life='1000ba')")
        if half_life is not None and smoothing is not None:
            raise ValueError(f"EMA: half_life={half_life!r} and smoothing={smoothing!r} are both set: use one "
                             "(pass half_life=None to use smoothing)")
        intervals = (TimeUnit.BATCH, TimeUnit.EPOCH)
        self.half_life = None if half_life is None else parse_schedule_time(half_life, "half_life", intervals)
        if smoothing is not None and (isinstance(smoothing, bool) or not isinstance(smoothing, (int, float))
                                      or not 0.0 < smoothing < 1.0):
            raise ValueError(f"smoothing={smoothing!r}: expected a number in the open interval (0, 1)")
        self.ema_start = parse_schedule_time(ema_start, "ema_start", (TimeUnit.DURATION, *intervals))
        if update_interval is None:
            unit = self.half_life.unit if self.half_life is not None else TimeUnit.BATCH
            self.update_interval = Time(1, unit)
        else:
            self.update_interval = parse_schedule_time(update_interval, "update_interval", intervals)
            if self.update_interval.value < 1:
                raise ValueError(f"update_interval={update_interval!r}: expected at least 1 batch or epoch")
        if self.half_life is not None and self.half_life.unit != self.update_interval.unit:
            raise ValueError(f"update_interval={self.update_interval} must use the unit of half_life="
                             f"{self.half_life} ('{self.half_life.unit.value}')")
        self.smoothing = float(smoothing) if smoothing is not None else ema_decay(self.half_life, self.update_interval)
        self._started = False
        self._training_params: Any = None
        self._training_buffers: Any = None
        self._every_batch = (self.update_interval.unit is TimeUnit.BATCH and self.update_interval.value == 1
                             and self.ema_start.value == 0)

    # -- device state ----------------------------------------------------------------------------
    def init_state(self, state: State) -> dict[str, Any]:
        """A copy of the initial weights (like ``state.params``) and buffers, and a not-started flag."""
        model = state.model
        params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
        return {"params": jax.tree.map(jnp.array, params), "buffers": jax.tree.map(jnp.array, model_buffers(model)),
                "started": jnp.asarray(False)}

    def ema_params(self, state: State) -> Any:
        """The averaged weights: a nested dict like ``state.params`` (device arrays).

        Example: ``nnx.update(model, nnx.State(ema.ema_params(trainer.state)))`` loads them into
        a module.
        """
        return state.algorithm_state[self.name]["params"]

    def ema_buffers(self, state: State) -> Any:
        """The averaged buffers (e.g. batch-norm statistics): a nested dict like :func:`model_buffers`.

        Empty for a model without buffers. ``nnx.update(model, nnx.State(ema.ema_buffers(state)))``
        loads them into a module.
        """
        return state.algorithm_state[self.name]["buffers"]

    # -- events ----------------------------------------------------------------------------------
    events = frozenset({Event.AFTER_OPTIMIZER_STEP, Event.BATCH_END, Event.EPOCH_END, Event.EVAL_START, Event.EVAL_END,
                        Event.BATCH_START})

    def match(self, event: Event, state: State) -> bool:
        """Update at ``AFTER_OPTIMIZER_STEP`` / ``EPOCH_END`` on update times; swap around evaluation."""
        if event == Event.AFTER_OPTIMIZER_STEP:
            if self.update_interval.unit != TimeUnit.BATCH:
                return False
            # Every batch from the start (the default): no clock arithmetic on the per-batch path.
            return self._every_batch or self._updates_at(after_this_batch(state), state)
        if event == Event.BATCH_END:
            return (not self._started and self.update_interval.unit == TimeUnit.BATCH
                    and self._updates_at(state.timestamp, state))
        if event == Event.EPOCH_END:
            return self.update_interval.unit == TimeUnit.EPOCH and self._updates_at(state.timestamp, state)
        if event == Event.EVAL_START:
            return self._training_params is None and self._updated_by(state.timestamp, state)
        if event == Event.EVAL_END:  # the clock has not moved since EVAL_START: the same answer
            return self._updated_by(state.timestamp, state)
        if event == Event.BATCH_START:
            return self._training_params is not None
        return False

    def _updated_by(self, timestamp: Timestamp, state: State) -> bool:
        """Whether the average has been updated at least once by ``timestamp``.

        A function of the clock alone (not of what ``apply`` did), so ``composerjax explain``
        predicts the evaluation swap exactly: the newest update time at or before ``timestamp`` is
        the last multiple of ``update_interval``, and it was an update if ``ema_start`` had been
        reached then.
        """
        interval = self.update_interval
        every = int(interval.value)
        count = timestamp.get(interval.unit).value
        last = count - count % every
        if last < 1:
            return False
        per_epoch = state.dataloader_len
        if interval.unit == TimeUnit.BATCH:  # right after batch `last`, before its epoch closed
            at = Timestamp(epoch=(last - 1) // per_epoch if per_epoch else timestamp.epoch.value, batch=last)
        else:
            at = Timestamp(epoch=last, batch=last * per_epoch if per_epoch else timestamp.batch.value)
        return reached(self.ema_start, at, state)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Update the average, or swap the averaged weights in and out around evaluation."""
        if event == Event.AFTER_OPTIMIZER_STEP:  # traced: state.model holds the new weights and statistics
            state.algorithm_state[self.name] = _update(state.algorithm_state[self.name], state.params,
                                                       model_buffers(state.model), self.smoothing)
        elif event == Event.BATCH_END:
            self._started = True  # the step that just ran made the first update
        elif event == Event.EPOCH_END:
            own = _update_on_device(state.algorithm_state[self.name], state.params, model_buffers(state.model),
                                    self.smoothing)
            state.algorithm_state = {**state.algorithm_state, self.name: own}
            self._started = True
        elif event == Event.EVAL_START:
            self._training_params = state.params
            state.params = self.ema_params(state)
            averaged = self.ema_buffers(state)
            if jax.tree.leaves(averaged):
                # Own copies: the model's buffers go into the train state, which a train step donates.
                self._training_buffers = self._swap_buffers(state, jax.tree.map(jnp.copy, averaged))
        elif self._training_params is not None:  # EVAL_END, or BATCH_START after an evaluation that did not finish
            state.params = self._training_params
            self._training_params = None
            if self._training_buffers is not None:
                self._swap_buffers(state, self._training_buffers)
                self._training_buffers = None

    @staticmethod
    def _swap_buffers(state: State, buffers: Any) -> Any:
        """Put ``buffers`` into the model (taken by the next step) and return the ones it held."""
        model = state.model  # reading it merges the latest device values (the parameters just set included)
        held = model_buffers(model)
        nnx.update(model, nnx.State(buffers))
        state.update_model()
        return held

    def _updates_at(self, timestamp: Timestamp, state: State) -> bool:
        """Whether the average is updated at ``timestamp`` (the clock right after a batch or an epoch)."""
        interval = self.update_interval
        return timestamp.get(interval.unit).value % interval.value == 0 and reached(self.ema_start, timestamp, state)

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Whether the average has started (the average itself is device state, checkpointed with it)."""
        return {"started": self._started}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self._started = bool(state["started"])

    def __repr__(self) -> str:
        return (f"EMA(half_life={self.half_life}, smoothing={self.smoothing}, ema_start={self.ema_start}, "
                f"update_interval={self.update_interval})")





