"""Stochastic Weight Averaging (Izmailov et al. 2018): average the weights late in training and keep the average.

The functional form is :func:`swa_update` (a running mean with ``optax.incremental_update``).
:class:`SWA` keeps the average in its device state, updates it between ``swa_start`` and
``swa_end`` (inside the compiled step at ``AFTER_OPTIMIZER_STEP`` for batch intervals, on the host at
``EPOCH_END`` for epoch intervals) and, when ``swa_end`` is reached, replaces the trained weights
by the average; training then goes on from the averaged weights until ``max_duration``, as in
Composer.

With ``schedule_swa_lr=True`` the learning rate follows PyTorch's ``SWALR`` (which Composer uses):
:func:`swa_learning_rate` wraps the optax optimizer at ``INIT``, and each average update advances
the annealing by one step (:func:`advance_swa_learning_rate`). After ``k`` updates the rate is
``swa_lr * a + lr_0 * (1 - a)`` with ``a = f(min(1, k / anneal_steps))``, ``f(t) = t`` ('linear') or
``(1 - cos(pi t)) / 2`` ('cos'), and ``lr_0`` the rate the optimizer had when averaging started.
"""

from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composerjax import Algorithm, Event, Logger, State, Time, Timestamp, TimeUnit
from composerjax.algorithms.schedule_times import after_this_batch, parse_schedule_time, reached
from composerjax.optim import name_optimizer, optimizer_name

__all__ = [
    "SWA",
    "SWALearningRateState",
    "advance_swa_learning_rate",
    "swa_learning_rate",
    "swalr_rate",
    "swa_update",
]

ANNEAL_STRATEGIES = {"linear": "linear", "lin": "linear", "cos": "cos", "cosine": "cos"}
_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)

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


def swalr_rate(start: Any, swa_lr: Any, updates: Any, anneal_steps: int, anneal_strategy: str = "linear") -> Any:
    """PyTorch ``SWALR``'s rate after ``updates`` steps: from ``start`` to ``swa_lr`` over ``anneal_steps``.

    ``a = f(min(1, updates / anneal_steps))`` with ``f(t) = t`` ('linear') or ``(1 - cos(pi t)) / 2``
    ('cos'); the rate is ``swa_lr * a + start * (1 - a)``, then ``swa_lr`` once ``updates >= anneal_steps``.

    Example:
        >>> [round(float(swalr_rate(1.0, 0.2, k, 4)), 6) for k in range(6)]
        [1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    """
    progress = jnp.clip(jnp.asarray(updates, jnp.float32) / max(1, anneal_steps), 0.0, 1.0)
    alpha = progress if anneal_strategy == "linear" else (1 - jnp.cos(math.pi * progress)) / 2
    return swa_lr * alpha + start * (1 - alpha)


class SWALearningRateState(NamedTuple):
    """The state of :func:`swa_learning_rate`.

    Attributes:
        updates: SWA updates so far (``SWALR.step()`` calls); 0 leaves the wrapped rate alone.
        started: whether ``start_rates`` hold the rates of the first annealed update.
        start_rates: each ``inject_hyperparams`` learning rate, in tree order, when annealing started
            (``lr_0``); one float32 vector (a tuple of scalars could alias the rates' buffers).
        inner_state: the wrapped optimizer's state.
    """

    updates: jax.Array
    started: jax.Array
    start_rates: jax.Array
    inner_state: Any


def _rate_states(tree: Any) -> tuple[list[Any], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda node: isinstance(node, _INJECT_STATES))
    return leaves, treedef


def _has_rate(node: Any) -> bool:
    return isinstance(node, _INJECT_STATES) and "learning_rate" in node.hyperparams


def swa_learning_rate(optimizer: optax.GradientTransformation, swa_lr: float | None, anneal_steps: int = 10,
                      anneal_strategy: str = "linear") -> optax.GradientTransformationExtraArgs:
    """``optimizer`` with its learning rate annealed to ``swa_lr`` once :func:`advance_swa_learning_rate` is called.

    Before the first advance the optimizer is untouched. At the first update after it, each
    ``inject_hyperparams`` learning rate in the state (the scheduled one, when a scheduler wraps
    this) is recorded as ``lr_0``; from then on every update uses :func:`swalr_rate` of ``lr_0`` and
    the advances so far, written into the state (so ``LRMonitor`` shows it). ``swa_lr=None`` holds
    ``lr_0`` (Composer's SWALR target when none is given).

    Raises:
        ValueError: (at ``init``) the optimizer keeps no numeric ``inject_hyperparams`` learning rate.

    Example:
        >>> import jax.numpy as jnp
        >>> optimizer = swa_learning_rate(optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), 0.2, 2)
        >>> params = jnp.zeros(1)
        >>> state = optimizer.init(params)
        >>> steps = []
        >>> for _ in range(4):
        ...     updates, state = optimizer.update(jnp.ones(1), state, params)
        ...     steps.append(round(float(updates[0]), 6))
        ...     state = advance_swa_learning_rate(state)
        >>> steps
        [-1.0, -0.6, -0.2, -0.2]
    """
    inner = optax.with_extra_args_support(optimizer)

    def init(params: Any) -> SWALearningRateState:
        inner_state = inner.init(params)
        rates = [leaf for leaf in _rate_states(inner_state)[0] if _has_rate(leaf)]
        if not rates or any("learning_rate" in getattr(leaf, "hyperparams_states", {}) for leaf in rates):
            raise ValueError("SWA(schedule_swa_lr=True): the optimizer must keep its learning rate as an "
                             "optax.inject_hyperparams number (e.g. optax.inject_hyperparams(optax.sgd)"
                             "(learning_rate=0.1), DecoupledSGDW, or the Trainer's default); give schedules as "
                             "Trainer(schedulers=...), not inside the optax optimizer")
        starts = jnp.zeros((len(rates),), jnp.float32)
        return SWALearningRateState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.bool_), starts, inner_state)

    def update(updates: Any, state: SWALearningRateState, params: Any = None,
               **extra_args: Any) -> tuple[Any, SWALearningRateState]:
        leaves, treedef = _rate_states(state.inner_state)
        positions = [position for position, leaf in enumerate(leaves) if _has_rate(leaf)]
        active = state.updates > 0
        first = active & ~state.started
        current_rates = jnp.stack([jnp.asarray(leaves[position].hyperparams["learning_rate"], jnp.float32)
                                   for position in positions])
        starts = jnp.where(first, current_rates, state.start_rates)
        for position, start in zip(positions, starts):
            leaf = leaves[position]
            current = jnp.asarray(leaf.hyperparams["learning_rate"])
            target = start if swa_lr is None else swa_lr
            rate = jnp.where(active, swalr_rate(start, target, state.updates, anneal_steps, anneal_strategy),
                             current).astype(current.dtype)
            leaves[position] = leaf._replace(hyperparams={**leaf.hyperparams, "learning_rate": rate})
        inner_state = jax.tree_util.tree_unflatten(treedef, leaves)
        updates, inner_state = inner.update(updates, inner_state, params, **extra_args)
        return updates, SWALearningRateState(state.updates, state.started | active, starts, inner_state)

    # Keep the name the rate is logged under (``lr-<name>/group0``).
    return name_optimizer(optax.GradientTransformationExtraArgs(init, update), optimizer_name(optimizer))


def advance_swa_learning_rate(opt_state: Any) -> Any:
    """``opt_state`` with every :func:`swa_learning_rate` annealing advanced by one step (``SWALR.step()``).

    Only the small counters change; every other leaf is the same array as before.
    """
    def advance(node: Any) -> Any:
        if not isinstance(node, SWALearningRateState):
            return node
        updates = node.updates + 1
        sharding = getattr(node.updates, "sharding", None)
        return node._replace(updates=jax.device_put(updates, sharding) if sharding is not None else updates)

    return jax.tree.map(advance, opt_state, is_leaf=lambda node: isinstance(node, SWALearningRateState))


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

    With ``schedule_swa_lr=True`` (host, ``INIT``) the optimizer is wrapped by
    :func:`swa_learning_rate`; every average update then advances PyTorch ``SWALR``'s annealing by
    one step (on the host, right after the update, where Composer calls ``SWALR.step()``), so the
    batches after the ``k``-th update use ``swalr_rate(lr_0, swa_lr, k, anneal_steps, anneal_strategy)``
    until the end of training, replacing the schedulers' rate. The optimizer must keep its learning
    rate as an ``optax.inject_hyperparams`` number (the Trainer's default does).

    Args:
        swa_start: how much training comes before averaging starts (``'dur'`` or ``'ep'``).
            Default: ``'0.7dur'``.
        swa_end: when the weights are replaced by the average (same unit as ``swa_start``, later
            than it). Default: ``'0.97dur'``.
        update_interval: how often the average is updated (``'ba'`` or ``'ep'``). Default: ``'1ep'``.
        schedule_swa_lr: anneal the learning rate from the first update on, as above. Default: ``False``.
        anneal_strategy: ``'linear'`` (or ``'lin'``) or ``'cos'`` (or ``'cosine'``). Default: ``'linear'``.
        anneal_steps: the number of average updates over which the rate is annealed. Default: ``10``.
        swa_lr: the rate annealed to; ``None`` holds the rate averaging started with. Default: ``None``.

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
        anneal_strategy: str = "linear",
        anneal_steps: int = 10,
        swa_lr: float | None = None,
    ) -> None:
        if not isinstance(schedule_swa_lr, bool):
            raise ValueError(f"schedule_swa_lr={schedule_swa_lr!r}: expected True or False")
        if not isinstance(anneal_strategy, str) or anneal_strategy.lower() not in ANNEAL_STRATEGIES:
            raise ValueError(f"anneal_strategy={anneal_strategy!r}: expected 'linear' (or 'lin') or 'cos' "
                             "(or 'cosine')")
        if isinstance(anneal_steps, bool) or not isinstance(anneal_steps, int) or anneal_steps <= 0:
            raise ValueError(f"anneal_steps={anneal_steps!r}: expected a positive integer (average updates)")
        if swa_lr is not None and (isinstance(swa_lr, bool) or not isinstance(swa_lr, (int, float))
                                   or not 0 <= swa_lr < math.inf):
            raise ValueError(f"swa_lr={swa_lr!r}: expected a non-negative learning rate or None")
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
        self.schedule_swa_lr = schedule_swa_lr
        self.anneal_strategy = ANNEAL_STRATEGIES[anneal_strategy.lower()]
        self.anneal_steps = anneal_steps
        self.swa_lr = None if swa_lr is None else float(swa_lr)
        self._window_steps = 0  # batches or epochs seen inside the window (Composer's step counter)
        self._completed = False

    # -- device state ----------------------------------------------------------------------------
    def init_state(self, state: State) -> dict[str, Any]:
        """An empty running mean: zeros of the parameters' structure and a count of 0."""
        params = nnx.to_pure_dict(nnx.split(state.model, nnx.Param, ...)[1])
        return {"params": jax.tree.map(jnp.zeros_like, params), "count": jnp.zeros((), jnp.int32)}

    # -- events ----------------------------------------------------------------------------------
    events = frozenset({Event.INIT, Event.AFTER_OPTIMIZER_STEP, Event.BATCH_END, Event.EPOCH_END})

    def match(self, event: Event, state: State) -> bool:
        """Update inside the window on every ``update_interval``; swap the average in at ``swa_end``.

        For batch intervals the answer is a function of the clock alone (when the window closed,
        how many batches it has seen), so ``composerjax explain`` predicts it without applying.
        """
        if event == Event.INIT:
            return self.schedule_swa_lr
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
        """Wrap the optimizer (``INIT``); update the running mean; at ``swa_end`` replace the weights by it."""
        if event == Event.INIT:
            self._wrap_optimizer(state)
            return
        if event == Event.AFTER_OPTIMIZER_STEP:  # traced
            state.algorithm_state[self.name] = _update(state.algorithm_state[self.name], state.params)
            return
        if event == Event.EPOCH_END:
            updated = self._window_steps % self.update_interval.value == 0
            if updated:
                own = _update_on_device(state.algorithm_state[self.name], state.params)
                state.algorithm_state = {**state.algorithm_state, self.name: own}
        else:  # BATCH_END: the step just run updated the mean when AFTER_OPTIMIZER_STEP matched for it
            updated = self._window_steps_by(state.timestamp.batch.value - 1, state) % self.update_interval.value == 0
        if updated and self.schedule_swa_lr:  # Composer: SWALR.step() right after each update
            opt_state = advance_swa_learning_rate(state.train_state.opt_state)
            state.train_state = state.train_state._replace(opt_state=opt_state)
        self._window_steps += 1
        if reached(self.swa_end, state.timestamp, state):
            self._completed = True
            # A copy: the next step donates the train state, and one buffer cannot be donated twice.
            state.params = _copy_on_device(state.algorithm_state[self.name]["params"])
            if state.max_duration is not None and state.progress >= 1.0:
                log.warning("SWA: the averaged weights replaced the trained ones at the end of training; "
                            "batch-norm statistics were not updated for them (set swa_end before the end)")

    def _wrap_optimizer(self, state: State) -> None:
        """Wrap ``state.optimizer`` with the SWALR annealing; check now that it keeps its rate where it can be set."""
        optimizer = swa_learning_rate(state.optimizer, self.swa_lr, self.anneal_steps, self.anneal_strategy)
        params = nnx.state(state.model, nnx.Param)
        jax.eval_shape(optimizer.init, params)  # raises the ValueError of swa_learning_rate early
        state.optimizer = optimizer

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The host side of the window: steps seen in it and whether the average was swapped in."""
        return {"window_steps": self._window_steps, "completed": self._completed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        self._window_steps = int(state["window_steps"])
        self._completed = bool(state["completed"])

    def __repr__(self) -> str:
        return (f"SWA(swa_start={self.swa_start}, swa_end={self.swa_end}, update_interval={self.update_interval}, "
                f"schedule_swa_lr={self.schedule_swa_lr}, anneal_strategy={self.anneal_strategy!r}, "
                f"anneal_steps={self.anneal_steps}, swa_lr={self.swa_lr})")





