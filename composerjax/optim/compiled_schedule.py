"""Schedulers inside the train step: one multiplier of the step count, applied to an optax optimizer.

:func:`compile_schedulers` turns Composer schedulers into one function of the optimizer step count
(built once on the host); :func:`with_schedule` wraps an optax optimizer so each update's learning
rate is its base rate times that multiplier, evaluated inside the step from the optimizer's own
count, with no host work per batch.

Example:
    >>> import jax.numpy as jnp
    >>> import optax
    >>> from composerjax.core.time import Time
    >>> from composerjax.optim.scheduler import LinearScheduler
    >>> multiplier = compile_schedulers([LinearScheduler()], ScheduleContext(Time(4, 'ba')))
    >>> optimizer = with_schedule(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1), multiplier)
    >>> params = jnp.zeros(1)
    >>> state = optimizer.init(params)
    >>> for _ in range(3):
    ...     updates, state = optimizer.update(jnp.ones(1), state, params)
    >>> round(float(state.inner_state.hyperparams['learning_rate']), 6), round(float(updates[0]), 6)
    (0.05, -0.05)
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composerjax.optim.optimizer_names import name_optimizer, optimizer_name
from composerjax.optim.schedule_time import ScheduleContext
from composerjax.optim.scheduler import ComposerScheduler

__all__ = ["ScheduleState", "compile_schedulers", "learning_rate_states", "with_schedule"]

Multiplier = Callable[[jax.Array], jax.Array]
_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def compile_schedulers(schedulers: ComposerScheduler | Sequence[ComposerScheduler] | None, context: ScheduleContext,
                       step_every_batch: bool | None = True) -> Multiplier:
    """One learning-rate multiplier of the optimizer step count, from schedulers as Composer's Trainer applies them.

    Composer's Trainer turns each scheduler into a PyTorch ``LambdaLR`` on the same optimizer, and
    each of those sets the rate to ``initial_lr * its own multiplier``: with several schedulers,
    the last one stepped sets the rate and the others have no effect (they do not multiply, despite
    the ``ComposerScheduler`` docstring). This function does the same and warns. Every scheduler
    is still built, so each one's checks run. Without schedulers the multiplier is 1.

    Args:
        schedulers: a scheduler, a list of them, or None.
        context: the run, for converting times to steps.
        step_every_batch: Composer's ``step_schedulers_every_batch``. True (and None, Composer's
            default for its own schedulers) updates the rate every batch: update ``n`` uses the
            multiplier at batch ``n``. False updates it once per epoch: every update of an epoch
            uses the multiplier at the epoch's first batch.

    Raises:
        TypeError: an entry that is not a :class:`ComposerScheduler` (a function of ``State`` runs
            on the host and cannot be compiled into the step).
        ValueError: a scheduler's time cannot be converted, or epoch stepping without an epoch length.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> from composerjax.optim.scheduler import LinearScheduler
        >>> context = ScheduleContext(Time(2, 'ep'), steps_per_epoch=5)
        >>> per_epoch = compile_schedulers(LinearScheduler(), context, step_every_batch=False)
        >>> [float(per_epoch(jnp.int32(step))) for step in (0, 4, 5, 9)]
        [1.0, 1.0, 0.5, 0.5]
    """
    if schedulers is None:
        schedulers = []
    elif not isinstance(schedulers, (list, tuple)):
        schedulers = [schedulers]
    for index, scheduler in enumerate(schedulers):
        if not isinstance(scheduler, ComposerScheduler):
            raise TypeError(f"schedulers[{index}]={scheduler!r}: expected a ComposerScheduler (e.g. "
                            "CosineAnnealingWithWarmupScheduler); a function of State runs on the host and cannot "
                            "run inside the compiled step: subclass ComposerScheduler instead")
    multipliers = [scheduler.multiplier(context) for scheduler in schedulers]
    if len(schedulers) > 1:
        warnings.warn(f"schedulers={list(schedulers)!r}: as in Composer's Trainer, each scheduler sets the learning "
                      f"rate to the optimizer's rate times its own multiplier, so only the last one, "
                      f"{schedulers[-1]!r}, takes effect; write one scheduler to combine schedules", stacklevel=2)
    multiplier: Multiplier = multipliers[-1] if multipliers else (lambda step: jnp.ones([], jnp.float32))
    if step_every_batch is None or step_every_batch:
        return multiplier
    steps_per_epoch = context.steps_per_epoch
    if steps_per_epoch is None:
        raise ValueError("step_schedulers_every_batch=False updates the learning rate at each epoch's first batch, "
                         "which needs the number of batches per epoch, but the train data loader has no length")

    def per_epoch(step: jax.Array) -> jax.Array:
        step = jnp.asarray(step, jnp.int32)
        return multiplier(step // steps_per_epoch * steps_per_epoch)

    return per_epoch


class ScheduleState(NamedTuple):
    """The state of :func:`with_schedule`.

    Attributes:
        count: the updates taken so far (the step count the multiplier reads).
        multiplier: the multiplier the latest update used (``multiplier(0)`` before the first).
        base_learning_rates: the rate each ``inject_hyperparams`` state was built with, when this
            wrapper writes the scheduled rate into them; ``()`` when it scales the updates instead.
        inner_state: the wrapped optimizer's state.
    """

    count: jax.Array
    multiplier: jax.Array
    base_learning_rates: tuple[jax.Array, ...]
    inner_state: Any


def learning_rate_states(opt_state: Any) -> list[Any]:
    """Every ``inject_hyperparams`` state in ``opt_state`` that holds a ``learning_rate``, in tree order.

    Example:
        >>> import jax.numpy as jnp
        >>> sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> len(learning_rate_states(optax.chain(optax.clip(1.0), sgd).init(jnp.zeros(2))))
        1
    """
    leaves = jax.tree_util.tree_leaves(opt_state, is_leaf=_is_inject)
    return [leaf for leaf in leaves if _is_inject(leaf) and "learning_rate" in leaf.hyperparams]


def _is_inject(node: Any) -> bool:
    return isinstance(node, _INJECT_STATES)


def _scheduled(node: Any) -> bool:
    """Whether inject_hyperparams computes this state's learning rate from a schedule (overwriting what we write)."""
    return "learning_rate" in getattr(node, "hyperparams_states", {})


def _replace_rates(opt_state: Any, rate: Callable[[int, jax.Array], jax.Array]) -> Any:
    """``opt_state`` with the i-th learning-rate state's rate replaced by ``rate(i, current)``."""
    leaves, treedef = jax.tree_util.tree_flatten(opt_state, is_leaf=_is_inject)
    index = 0
    for position, leaf in enumerate(leaves):
        if _is_inject(leaf) and "learning_rate" in leaf.hyperparams:
            current = jnp.asarray(leaf.hyperparams["learning_rate"])
            new = jnp.asarray(rate(index, current)).astype(current.dtype)
            leaves[position] = leaf._replace(hyperparams={**leaf.hyperparams, "learning_rate": new})
            index += 1
    return jax.tree_util.tree_unflatten(treedef, leaves)


def with_schedule(optimizer: optax.GradientTransformation,
                  multiplier: Multiplier) -> optax.GradientTransformationExtraArgs:
    """``optimizer`` with its learning rate multiplied by ``multiplier(step count)`` at every update, in-step.

    The rule, chosen from the optimizer's state when it is built:

    * every learning rate in the state is a number of ``optax.inject_hyperparams`` (how
      ``DecoupledAdamW``, recipe optimizers and ``inject_hyperparams(optax.adam)(learning_rate=0.1)``
      keep it): before each update the rate is set to ``base * multiplier(count)``, so the
      optimizer computes with the scheduled rate and the state shows it;
    * otherwise (a plain ``optax.adam(0.1)``, or a rate already given as an optax schedule) the
      optimizer's updates are multiplied by ``multiplier(count)``. This equals scaling the rate for
      every optimizer whose rate multiplies its final update (sgd, momentum, adam, adamw, lamb,
      lion, rmsprop, ...; decoupled weight decay is scaled with it, as Composer's is); an
      ``inject_hyperparams`` schedule's rate is shown multiplied too.

    ``ScheduleState.multiplier`` holds the factor the latest update used. The count is this
    wrapper's own (updates applied), so it is the batch count as long as every batch updates.

    Raises:
        ValueError: (at ``init``) the state mixes numeric and scheduled ``inject_hyperparams`` rates.

    Example:
        >>> import jax.numpy as jnp
        >>> optimizer = with_schedule(optax.sgd(0.1), lambda count: 0.5 ** count)
        >>> params = jnp.zeros(1)
        >>> state = optimizer.init(params)
        >>> steps = []
        >>> for _ in range(3):
        ...     updates, state = optimizer.update(jnp.ones(1), state, params)
        ...     steps.append(round(float(updates[0]), 6))
        >>> steps, float(state.multiplier)
        ([-0.1, -0.05, -0.025], 0.25)
    """
    inner = optax.with_extra_args_support(optimizer)

    def factor_at(count: jax.Array) -> jax.Array:
        return jnp.asarray(multiplier(count), jnp.float32)

    def init(params: Any) -> ScheduleState:
        inner_state = inner.init(params)
        states = learning_rate_states(inner_state)
        scheduled = [_scheduled(state) for state in states]
        if any(scheduled) and not all(scheduled):
            raise ValueError("with_schedule: the optimizer has learning rates given as numbers and as optax schedules; "
                             "give them all as numbers (the schedulers scale them) or all as schedules")
        count = jnp.zeros([], jnp.int32)
        factor = factor_at(count)
        bases: tuple[jax.Array, ...] = ()
        if states and not any(scheduled):
            bases = tuple(jnp.asarray(state.hyperparams["learning_rate"]) for state in states)
            inner_state = _replace_rates(inner_state, lambda index, _: bases[index] * factor)
        return ScheduleState(count, factor, bases, inner_state)

    def update(updates: Any, state: ScheduleState, params: Any = None,
               **extra_args: Any) -> tuple[Any, ScheduleState]:
        factor = factor_at(state.count)
        bases = state.base_learning_rates
        if bases:
            inner_state = _replace_rates(state.inner_state, lambda index, _: bases[index] * factor)
            updates, inner_state = inner.update(updates, inner_state, params, **extra_args)
        else:
            updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
            updates = jax.tree.map(lambda update: update * factor.astype(update.dtype), updates)
            inner_state = _replace_rates(inner_state, lambda _, current: current * factor)
        return updates, ScheduleState(optax.safe_increment(state.count), factor, bases, inner_state)

    return name_optimizer(optax.GradientTransformationExtraArgs(init, update), optimizer_name(optimizer))
