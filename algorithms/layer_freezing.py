"""Layer freezing: progressively stop training the layers nearest the input, late in training.

From ``freeze_start`` (a fraction of training) on, the first layers, counted from the input in the
order the model defines them, stop being updated; the frozen fraction grows linearly to
``freeze_level`` at the end of training (FreezeOut, Brock et al. 2017; Composer's schedule). The
last layer is never frozen.

Frozen here means: no update and no change to the optimizer state of those weights (Adam's moments
stay as they were). It is done inside the optimizer: :func:`progressive_freezing` wraps an optax
optimizer so each weight stops being updated from a given step on, the step count living in the
transform's own state, so one compiled step serves the whole run. :func:`freeze_layers` is the
static form (``optax.multi_transform`` with ``optax.set_to_zero``) for a fixed set of frozen layers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from composerjax import Algorithm, Event, Logger, State, TimeUnit

__all__ = [
    "LayerFreezing",
    "freeze_layers",
    "freeze_schedule",
    "frozen_from_steps",
    "layer_indices",
    "progressive_freezing",
]

#: "Never frozen": larger than any step count the int32 counter reaches.
NEVER = 2**31 - 1


def freeze_schedule(progress: float, freeze_start: float = 0.5, freeze_level: float = 1.0) -> float:
    """Return the fraction of layers frozen at ``progress`` (fraction of training elapsed).

    0 up to and including ``freeze_start``, then linear, reaching ``freeze_level`` at ``progress == 1``.

    Example:
        >>> freeze_schedule(0.75, freeze_start=0.5, freeze_level=1.0)
        0.5
    """
    if progress <= freeze_start:
        return 0.0
    return freeze_level * (progress - freeze_start) / (1.0 - freeze_start)


def layer_indices(model: nnx.Module) -> tuple[Any, int]:
    """Number the model's layers from the input side; return ``(indices, num_layers)``.

    A layer is a module that holds parameters itself (a ``Linear``, a ``Conv``, a ``LayerNorm``...).
    Layers are ordered depth first in the order the modules were assigned in ``__init__`` (the
    order a forward pass usually follows), not alphabetically as ``nnx.state`` lists them.
    ``indices`` has the structure of ``state.params`` (``nnx.to_pure_dict`` of the parameters) and
    holds each weight's layer number.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
        >>> indices, count = layer_indices(model)
        >>> indices['layers'][0]['kernel'], indices['layers'][2]['kernel'], count
        (0, 1, 2)
    """
    params = nnx.to_pure_dict(nnx.split(model, nnx.Param, ...)[1])
    owners: dict[tuple, None] = {}
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        owners.setdefault(_keys(path)[:-1])
    ordered = sorted(owners, key=lambda owner: _definition_rank(model, owner))
    number = {owner: index for index, owner in enumerate(ordered)}
    indices = jax.tree_util.tree_map_with_path(lambda path, _: number[_keys(path)[:-1]], params)
    return indices, len(ordered)


def frozen_from_steps(
    indices: Any, num_layers: int, total_steps: int, freeze_start: float = 0.5, freeze_level: float = 1.0
) -> Any:
    """Return, per weight, the first optimizer step (counted from 0) at which its layer is frozen.

    At step ``k`` the progress is ``k / total_steps`` and the first
    ``int(freeze_schedule(progress) * (num_layers - 1))`` layers are frozen (the last layer never
    is). Weights not frozen within ``total_steps`` get ``NEVER``.

    Example:
        >>> frozen_from_steps({'a': 0, 'b': 1, 'c': 2}, num_layers=3, total_steps=8, freeze_start=0.0)
        {'a': 4, 'b': 8, 'c': 2147483647}
    """

    def depth(step: int) -> int:
        return int(freeze_schedule(step / total_steps, freeze_start, freeze_level) * (num_layers - 1))

    first = []
    for layer in range(num_layers):
        if layer >= num_layers - 1 or depth(total_steps) <= layer:
            first.append(NEVER)
            continue
        low, high = 0, total_steps  # the schedule only grows: find the first step with depth > layer
        while low < high:
            middle = (low + high) // 2
            low, high = (middle + 1, high) if depth(middle) <= layer else (low, middle)
        first.append(low)
    return jax.tree.map(lambda layer: first[layer], indices)


class ProgressiveFreezingState(NamedTuple):
    """The optimizer steps taken so far and the wrapped optimizer's state."""

    count: jax.Array
    inner_state: Any


def progressive_freezing(optimizer: optax.GradientTransformation, frozen_from: Any) -> optax.GradientTransformation:
    """Wrap ``optimizer`` so each weight stops changing from step ``frozen_from[...]`` (0-based) on.

    Once frozen, a weight's update is exactly zero and its slots in the optimizer state (the
    parameter-shaped parts, found with ``optax.tree_map_params``: momentum, Adam's moments...) keep
    their values; shared scalars such as Adam's step count go on. The step count is kept in this
    transform's own state, so the wrapped optimizer is one fixed computation (one compile).

    Args:
        optimizer: the optax optimizer to wrap.
        frozen_from: a pytree with the structure of the parameters holding ints (e.g. from
            :func:`frozen_from_steps`); ``0`` freezes from the start, ``NEVER`` never.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = progressive_freezing(optax.sgd(1.0), {'a': 1, 'b': NEVER})
        >>> params = {'a': jnp.zeros(1), 'b': jnp.zeros(1)}
        >>> state = opt.init(params)
        >>> for _ in range(3):
        ...     updates, state = opt.update({'a': jnp.ones(1), 'b': jnp.ones(1)}, state, params)
        ...     params = optax.apply_updates(params, updates)
        >>> params['a'], params['b']
        (Array([-1.], dtype=float32), Array([-3.], dtype=float32))
    """

    def init(params: Any) -> ProgressiveFreezingState:
        return ProgressiveFreezingState(jnp.zeros((), jnp.int32), optimizer.init(params))

    def update(updates: Any, state: ProgressiveFreezingState, params: Any = None) -> tuple[Any, Any]:
        frozen = jax.tree.map(lambda first: state.count >= first, frozen_from)
        new_updates, new_inner = optimizer.update(updates, state.inner_state, params)
        new_updates = jax.tree.map(lambda f, u: jnp.where(f, jnp.zeros_like(u), u), frozen, new_updates)
        # Per state leaf: the frozen flag of its weight, or False for shared leaves (counts).
        keep = optax.tree_map_params(optimizer, lambda _, f: f, new_inner, frozen, transform_non_params=lambda _: False)
        new_inner = jax.tree.map(lambda k, old, new: new if k is False else jnp.where(k, old, new),
                                 keep, state.inner_state, new_inner)
        return new_updates, ProgressiveFreezingState(state.count + 1, new_inner)

    return optax.GradientTransformation(init, update)


def freeze_layers(optimizer: optax.GradientTransformation, frozen: Any) -> optax.GradientTransformation:
    """Return ``optimizer`` with the weights marked in ``frozen`` never updated (a fixed freeze).

    ``optax.multi_transform`` sends frozen weights to ``optax.set_to_zero()``: they get no update and
    no optimizer state at all, and since their gradients are unused XLA can skip computing them.

    Args:
        optimizer: the optax optimizer for the trained weights.
        frozen: a pytree of bools with the structure of the parameters, or a function of the
            parameters returning one.

    Example:
        >>> import jax.numpy as jnp, optax
        >>> opt = freeze_layers(optax.sgd(1.0), {'a': True, 'b': False})
        >>> params = {'a': jnp.zeros(1), 'b': jnp.zeros(1)}
        >>> opt.update({'a': jnp.ones(1), 'b': jnp.ones(1)}, opt.init(params), params)[0]
        {'a': Array([0.], dtype=float32), 'b': Array([-1.], dtype=float32)}

    To freeze the first two layers of a model: ``indices, _ = layer_indices(model)``, then
    ``freeze_layers(optax.adam(1e-3), jax.tree.map(lambda i: i < 2, indices))``.
    """

    def labels_of(flags: Any) -> Any:
        return jax.tree.map(lambda flag: "frozen" if flag else "trained", flags)

    labels = (lambda params: labels_of(frozen(params))) if callable(frozen) else labels_of(frozen)
    return optax.multi_transform({"trained": optimizer, "frozen": optax.set_to_zero()}, labels)


class LayerFreezing(Algorithm):
    """Progressively freeze the layers nearest the input during the last part of training.

    At ``INIT`` (host) the layers are numbered from the input side (:func:`layer_indices`), the step
    at which each one freezes is worked out from ``max_duration`` (:func:`frozen_from_steps`) and
    the optimizer is wrapped with :func:`progressive_freezing`: from then on frozen weights get no
    update and keep their optimizer state, inside one compiled step. At ``AFTER_TRAIN_BATCH``
    (traced) the number of frozen layers is added to the step metrics as
    ``layer_freezing/layers_frozen``.

    The schedule is Composer's (the fraction frozen grows linearly from 0 at ``freeze_start`` to
    ``freeze_level`` at the end; the last layer is never frozen), evaluated every step rather than
    at epoch ends. It is fixed at ``INIT`` from ``max_duration`` (``'ba'``, ``'ep'`` or ``'sp'``
    with a loader of known length); a later ``fit(duration)`` does not stretch it. Frozen layers
    still have their gradients computed (the step is compiled once for the whole run); for a
    speed-up from a fixed freeze use :func:`freeze_layers`. ``run_last`` makes it wrap the model
    after other algorithms' surgery at ``INIT``.

    Args:
        freeze_start: the fraction of training, in ``[0, 1)``, before freezing begins. Default: ``0.5``.
        freeze_level: the fraction of layers, in ``[0, 1]``, frozen at the end. Default: ``1.0``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.layer_freezing import LayerFreezing

        trainer = Trainer(model, train_loader, '20ep', optax.adam(1e-3),
                          algorithms=[LayerFreezing(freeze_start=0.5, freeze_level=1.0)])
        trainer.fit()
    """

    run_last = True

    def __init__(self, freeze_start: float = 0.5, freeze_level: float = 1.0) -> None:
        if isinstance(freeze_start, bool) or not isinstance(freeze_start, (int, float)) or not 0 <= freeze_start < 1:
            raise ValueError(f"freeze_start={freeze_start!r}: expected a fraction of training in [0, 1)")
        if isinstance(freeze_level, bool) or not isinstance(freeze_level, (int, float)) or not 0 <= freeze_level <= 1:
            raise ValueError(f"freeze_level={freeze_level!r}: expected a fraction of layers in [0, 1]")
        self.freeze_start = float(freeze_start)
        self.freeze_level = float(freeze_level)
        self._layer_frozen_from: list[int] = []

    events = frozenset({Event.INIT, Event.AFTER_TRAIN_BATCH})

    def match(self, event: Event, state: State) -> bool:
        """Wrap the optimizer at ``INIT``; report the frozen layers at ``AFTER_TRAIN_BATCH``."""
        return event == Event.INIT or (event == Event.AFTER_TRAIN_BATCH and bool(self._layer_frozen_from))

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Wrap ``state.optimizer`` with the freezing schedule, or log how many layers are frozen."""
        if event == Event.AFTER_TRAIN_BATCH:  # traced: state.step is the step just taken
            firsts = jnp.asarray(self._layer_frozen_from, jnp.int32)
            state.step_metrics["layer_freezing/layers_frozen"] = jnp.sum(state.step >= firsts)
            return
        indices, num_layers = layer_indices(state.model)
        total_steps = _total_steps(state)
        self._layer_frozen_from = frozen_from_steps(list(range(num_layers)), num_layers, total_steps,
                                                    self.freeze_start, self.freeze_level)
        frozen_from = jax.tree.map(lambda layer: self._layer_frozen_from[layer], indices)
        state.optimizer = progressive_freezing(state.optimizer, frozen_from)

    def __repr__(self) -> str:
        return f"LayerFreezing(freeze_start={self.freeze_start}, freeze_level={self.freeze_level})"


def _total_steps(state: State) -> int:
    duration = state.max_duration
    length = state.dataloader_len
    if duration is not None and duration.unit == TimeUnit.BATCH:
        return int(duration.value)
    if duration is not None and duration.unit == TimeUnit.EPOCH and length:
        return int(duration.value) * int(length)
    batch_size = getattr(state.dataloader, "global_batch_size", None)
    if duration is not None and duration.unit == TimeUnit.SAMPLE and batch_size:
        return math.ceil(duration.value / batch_size)
    raise ValueError(f"LayerFreezing needs to know the number of steps of training to place its schedule: "
                     f"max_duration={duration} is not in 'ba', or in 'ep' / 'sp' with a dataloader of known length")


def _keys(path: tuple) -> tuple:
    return tuple(getattr(entry, "key", getattr(entry, "idx", getattr(entry, "name", entry))) for entry in path)


def _definition_rank(model: Any, owner: tuple) -> tuple[int, ...]:
    """The position of each step of ``owner``'s path among its parent's children, in assignment order."""
    rank = []
    node = model
    for key in owner:
        if isinstance(node, (list, tuple)):
            names: list[Any] = list(range(len(node)))
        elif isinstance(node, dict):
            names = list(node)
        else:
            names = [int(name) if name.isdigit() else name for name in vars(node) if not name.startswith("_")]
        if key not in names:
            rank.append(len(names))
            break
        rank.append(names.index(key))
        node = node[key] if isinstance(node, (list, tuple, dict)) else vars(node)[str(key)]
    return tuple(rank)
