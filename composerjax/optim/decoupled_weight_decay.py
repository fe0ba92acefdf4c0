"""Composer's optimizers with weight decay decoupled from the learning rate: ``DecoupledAdamW``, ``DecoupledSGDW``.

Each update first shrinks every weight by ``(lr / initial_lr) * weight_decay``, then takes the
Adam or SGD step with rate ``lr``: the decay follows the learning-rate *schedule* but is not scaled
by the learning rate itself, so ``weight_decay=1e-5`` means "multiply every weight by ``1 - 1e-5``
per step" at the peak of the schedule. ``initial_lr`` is the ``lr`` given here; a schedule (see
:func:`composerjax.optim.with_schedule`) changes ``lr``. Both return optax transformations built
with ``optax.inject_hyperparams``, so the learning rate and the other numeric hyperparameters are
in the optimizer state, where ``LRMonitor`` reads them.

Example:
    >>> import jax.numpy as jnp
    >>> optimizer = DecoupledSGDW(lr=0.1, weight_decay=0.0005)
    >>> params = {'w': jnp.array([1.0, 2.0])}
    >>> updates, _ = optimizer.update({'w': jnp.array([1.0, 1.0])}, optimizer.init(params), params)
    >>> [round(float(value), 6) for value in updates['w']]  # -0.0005 * w - 0.1 * grad
    [-0.1005, -0.101]
"""

from __future__ import annotations

import math
import numbers
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from composerjax.optim.optimizer_names import name_optimizer

__all__ = ["DecoupledAdamW", "DecoupledSGDW", "DecoupledAdamWState", "DecoupledSGDWState"]


class DecoupledAdamWState(NamedTuple):
    """Adam's running averages (PyTorch's names); ``max_exp_avg_sq`` is ``()`` without amsgrad."""

    count: jax.Array
    exp_avg: Any
    exp_avg_sq: Any
    max_exp_avg_sq: Any


class DecoupledSGDWState(NamedTuple):
    """The step count and the momentum buffers (``()`` without momentum)."""

    count: jax.Array
    momentum_buffer: Any


def _decay_factor(learning_rate: jax.Array, initial_lr: jax.Array) -> jax.Array:
    """``lr / initial_lr``, or 1 when ``initial_lr`` is 0 (Composer's rule)."""
    nonzero = initial_lr != 0
    return jnp.where(nonzero, learning_rate / jnp.where(nonzero, initial_lr, 1.0), 1.0)


def _needs_params(params: Any, name: str) -> Any:
    if params is None:
        raise ValueError(f"{name}.update needs the parameters (weight decay shrinks them): call update(grads, "
                         "state, params)")
    return params


def decoupled_adamw(learning_rate: float, b1: float, b2: float, eps: float, weight_decay: float, initial_lr: float,
                    amsgrad: bool = False) -> optax.GradientTransformation:
    """The update rule of Composer's ``DecoupledAdamW.adamw`` as an optax transformation (inject_hyperparams' inner)."""

    def init(params: Any) -> DecoupledAdamWState:
        zeros = lambda: jax.tree.map(jnp.zeros_like, params)  # noqa: E731
        return DecoupledAdamWState(jnp.zeros([], jnp.int32), zeros(), zeros(), zeros() if amsgrad else ())

    def update(grads: Any, state: DecoupledAdamWState, params: Any = None) -> tuple[Any, DecoupledAdamWState]:
        params = _needs_params(params, "DecoupledAdamW")
        count = optax.safe_increment(state.count)
        step = count.astype(jnp.float32)
        exp_avg = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.exp_avg, grads)
        exp_avg_sq = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.exp_avg_sq, grads)
        max_exp_avg_sq = jax.tree.map(jnp.maximum, state.max_exp_avg_sq, exp_avg_sq) if amsgrad else ()
        second = max_exp_avg_sq if amsgrad else exp_avg_sq
        bias_correction1 = 1 - b1**step
        bias_correction2 = 1 - b2**step
        step_size = learning_rate / bias_correction1
        decay = _decay_factor(learning_rate, initial_lr) * weight_decay

        def param_update(p: jax.Array, m: jax.Array, v: jax.Array) -> jax.Array:
            denom = jnp.sqrt(v) / jnp.sqrt(bias_correction2) + eps
            return (-decay * p - step_size * m / denom).astype(p.dtype)

        updates = jax.tree.map(param_update, params, exp_avg, second)
        return updates, DecoupledAdamWState(count, exp_avg, exp_avg_sq, max_exp_avg_sq)

    return optax.GradientTransformation(init, update)


def decoupled_sgdw(learning_rate: float, momentum: float, dampening: float, weight_decay: float, initial_lr: float,
                   nesterov: bool = False) -> optax.GradientTransformation:
    """The update rule of Composer's ``DecoupledSGDW.sgdw`` as an optax transformation (inject_hyperparams' inner)."""

    def init(params: Any) -> DecoupledSGDWState:
        buffers = jax.tree.map(jnp.zeros_like, params) if momentum != 0 else ()
        return DecoupledSGDWState(jnp.zeros([], jnp.int32), buffers)

    def update(grads: Any, state: DecoupledSGDWState, params: Any = None) -> tuple[Any, DecoupledSGDWState]:
        params = _needs_params(params, "DecoupledSGDW")
        buffers, directions = (), grads
        if momentum != 0:
            first = state.count == 0  # PyTorch starts the buffer at the first gradient, undampened
            buffers = jax.tree.map(lambda b, g: jnp.where(first, g, momentum * b + (1 - dampening) * g),
                                   state.momentum_buffer, grads)
            directions = (jax.tree.map(lambda g, b: g + momentum * b, grads, buffers) if nesterov else buffers)
        decay = _decay_factor(learning_rate, initial_lr) * weight_decay
        updates = jax.tree.map(lambda p, d: (-decay * p - learning_rate * d).astype(p.dtype), params, directions)
        return updates, DecoupledSGDWState(optax.safe_increment(state.count), buffers)

    return optax.GradientTransformation(init, update)


def _number(value: Any, field: str, owner: str, low: float = 0.0, below: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        hint = (" (schedule the rate with composerjax.optim schedulers: Trainer(schedulers=...) or with_schedule)"
                if field == "lr" and callable(value) else "")
        raise ValueError(f"{owner}({field}={value!r}): expected a finite number{hint}")
    if value < low or (below is not None and value >= below):
        bound = f"in [{low}, {below})" if below is not None else f"at least {low}"
        raise ValueError(f"{owner}({field}={value!r}): expected a number {bound}")
    return float(value)


def _warn_high_decay(weight_decay: float, owner: str) -> None:
    if weight_decay >= 1e-3:
        warnings.warn(f"You are using a high value of `weight_decay={weight_decay}` for the `{owner}` optimizer. Are "
                      f"you sure you want to do this? Your model's weights will be multiplied by {1.0 - weight_decay} "
                      "on every step!", stacklevel=3)


def DecoupledAdamW(lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,  # noqa: N802
                   weight_decay: float = 1e-5, amsgrad: bool = False) -> optax.GradientTransformationExtraArgs:
    """Adam with decoupled weight decay, as Composer's ``DecoupledAdamW`` (its defaults, ``betas=(0.9, 0.95)``).

    Per parameter, with ``step`` counted from 1: ``p *= 1 - (lr / initial_lr) * weight_decay``, then
    ``p -= lr / (1 - b1**step) * m / (sqrt(v) / sqrt(1 - b2**step) + eps)``, ``m`` and ``v`` the
    running averages of the gradient and its square (``v`` their running maximum with ``amsgrad``,
    as in PyTorch). Logged as ``lr-DecoupledAdamW/group0``.

    Args:
        lr: the learning rate (``initial_lr``; schedules scale it).
        betas: the running averages' coefficients ``(b1, b2)``.
        eps: added to the denominator.
        weight_decay: the decoupled weight decay per step at ``lr == initial_lr``.
        amsgrad: normalise by the running maximum of the second moment.

    Raises:
        ValueError: a hyperparameter out of PyTorch's ranges, or a non-number ``lr``.

    Example:
        >>> import jax.numpy as jnp
        >>> optimizer = DecoupledAdamW(lr=0.1, weight_decay=0.0)
        >>> params = {'w': jnp.array([1.0])}
        >>> updates, state = optimizer.update({'w': jnp.array([0.5])}, optimizer.init(params), params)
        >>> round(float(updates['w'][0]), 5), round(float(state.hyperparams['learning_rate']), 6)
        (-0.1, 0.1)
    """
    owner = "DecoupledAdamW"
    lr = _number(lr, "lr", owner)
    eps = _number(eps, "eps", owner)
    weight_decay = _number(weight_decay, "weight_decay", owner)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"{owner}(betas={betas!r}): expected two coefficients (b1, b2)")
    b1, b2 = (_number(beta, f"betas[{index}]", owner, below=1.0) for index, beta in enumerate(betas))
    if not isinstance(amsgrad, bool):
        raise ValueError(f"{owner}(amsgrad={amsgrad!r}): expected True or False")
    _warn_high_decay(weight_decay, owner)
    optimizer = optax.inject_hyperparams(decoupled_adamw)(learning_rate=lr, b1=b1, b2=b2, eps=eps,
                                                         weight_decay=weight_decay, initial_lr=lr, amsgrad=amsgrad)
    return name_optimizer(optimizer, owner)


def DecoupledSGDW(lr: float, momentum: float = 0, dampening: float = 0, weight_decay: float = 0,  # noqa: N802
                  nesterov: bool = False) -> optax.GradientTransformationExtraArgs:
    """SGD with decoupled weight decay, as Composer's ``DecoupledSGDW`` (PyTorch SGD's defaults).

    Per parameter: ``buf = g`` at the first step, then ``buf = momentum * buf + (1 - dampening) * g``;
    the direction is ``buf`` (``g + momentum * buf`` with ``nesterov``, ``g`` without momentum);
    ``p *= 1 - (lr / initial_lr) * weight_decay``; ``p -= lr * direction``. Logged as
    ``lr-DecoupledSGDW/group0``.

    Args:
        lr: the learning rate (``initial_lr``; schedules scale it).
        momentum: the momentum factor (0 keeps no buffer).
        dampening: the dampening of each new gradient in the buffer.
        weight_decay: the decoupled weight decay per step at ``lr == initial_lr``.
        nesterov: Nesterov momentum (needs ``momentum > 0`` and ``dampening == 0``).

    Raises:
        ValueError: a hyperparameter out of PyTorch's ranges, or a non-number ``lr``.

    Example:
        >>> import jax.numpy as jnp
        >>> optimizer = DecoupledSGDW(lr=0.5, momentum=0.9)
        >>> params = {'w': jnp.array([0.0])}
        >>> state = optimizer.init(params)
        >>> first, state = optimizer.update({'w': jnp.array([1.0])}, state, params)
        >>> second, state = optimizer.update({'w': jnp.array([1.0])}, state, params)
        >>> float(first['w'][0]), round(float(second['w'][0]), 6)
        (-0.5, -0.95)
    """
    owner = "DecoupledSGDW"
    lr = _number(lr, "lr", owner)
    momentum = _number(momentum, "momentum", owner)
    dampening = _number(dampening, "dampening", owner, low=-math.inf)
    weight_decay = _number(weight_decay, "weight_decay", owner)
    if not isinstance(nesterov, bool):
        raise ValueError(f"{owner}(nesterov={nesterov!r}): expected True or False")
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{owner}(nesterov=True, momentum={momentum}, dampening={dampening}): Nesterov momentum "
                         "requires a momentum and zero dampening")
    _warn_high_decay(weight_decay, owner)
    optimizer = optax.inject_hyperparams(decoupled_sgdw, static_args=("momentum",))(
        learning_rate=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, initial_lr=lr,
        nesterov=nesterov)
    return name_optimizer(optimizer, owner)
