"""LRMonitor: log the learning rate each update used, as ``lr-<optimizer>/group<i>`` (Composer's names)."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from composerjax import Callback, Logger, State
from composerjax.optim import ScheduleState, optimizer_name

__all__ = ["LRMonitor", "find_learning_rates", "learning_rate_paths"]

_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_state_node(node: Any) -> bool:
    return isinstance(node, (*_INJECT_STATES, ScheduleState))


def _follow(node: Any, path: tuple[Any, ...]) -> Any:
    """The node at ``path`` (a key path of ``tree_flatten_with_path``) below ``node``."""
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            node = getattr(node, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            node = node[key.idx]
        elif isinstance(key, jax.tree_util.DictKey):
            node = node[key.key]
        else:
            raise KeyError(key)
    return node


def learning_rate_paths(opt_state: Any, name: str = "optimizer") -> dict[str, tuple[Any, ...]]:
    """``{'lr-<name>/group<i>': key path to the rate}`` for every learning rate ``opt_state`` holds.

    The rates are those of ``optax.inject_hyperparams`` states (``DecoupledAdamW``, recipe optimizers,
    ``inject_hyperparams(optax.adam)(...)``), numbered ``group0``, ``group1``... in tree order (a
    ``multi_transform`` with a rate per label gives one group each, like Composer's parameter
    groups). A plain optax optimizer keeps its rate in a closure: if it runs under
    :func:`composerjax.optim.with_schedule`, the schedule's multiplier is found instead, as
    ``'lr-<name>/multiplier'``.

    Example:
        >>> import jax.numpy as jnp
        >>> sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> list(learning_rate_paths(optax.chain(optax.clip(1.0), sgd).init(jnp.zeros(2)), 'sgd'))
        ['lr-sgd/group0']
    """
    rates, multipliers = [], []
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_state_node)[0]:
        if isinstance(node, _INJECT_STATES) and "learning_rate" in node.hyperparams:
            rates.append((*path, jax.tree_util.GetAttrKey("hyperparams"), jax.tree_util.DictKey("learning_rate")))
        elif isinstance(node, ScheduleState):
            multipliers.append((*path, jax.tree_util.GetAttrKey("multiplier")))
            rates += [(*path, jax.tree_util.GetAttrKey("inner_state"), *inner)
                      for inner in learning_rate_paths(node.inner_state).values()]
    if rates:
        return {f"lr-{name}/group{index}": path for index, path in enumerate(rates)}
    return {f"lr-{name}/multiplier": path for path in multipliers[:1]}


def find_learning_rates(opt_state: Any, paths: dict[str, tuple[Any, ...]] | None = None,
                        name: str = "optimizer") -> dict[str, Any]:
    """Return ``{'lr-<name>/group<i>': learning rate}`` for every learning rate in ``opt_state``.

    The values are the optimizer state's own arrays: after an update they hold the rate that update
    used. ``paths`` (from :func:`learning_rate_paths`) skips the search through the state.

    Example:
        >>> import jax.numpy as jnp
        >>> adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.5)
        >>> find_learning_rates(adam.init(jnp.zeros(2)), name='adam')
        {'lr-adam/group0': Array(0.5, dtype=float32)}
    """
    if paths is None:
        paths = learning_rate_paths(opt_state, name)
    return {key: _follow(opt_state, path) for key, path in paths.items()}


class LRMonitor(Callback):
    """Log the learning rate each update used, as ``lr-<optimizer>/group<i>`` like Composer's LRMonitor.

    ``<optimizer>`` is :func:`composerjax.optim.optimizer_name` of the trainer's optimizer: the
    class name for composerjax's optimizers (``lr-DecoupledAdamW/group0``), the optax function
    for recipe optimizers and ``optax.inject_hyperparams(optax.adam)(...)`` (``lr-adam/group0``),
    else ``optimizer``. ``group<i>`` numbers the rates in the optimizer state (one for a single
    optimizer). With schedulers (``composerjax.optim.with_schedule``) the value is the scheduled
    rate. A plain optax optimizer (``optax.adam(1e-3)``) keeps its rate where no callback can read
    it: under a schedule its multiplier is logged as ``lr-<optimizer>/multiplier``, otherwise the
    callback warns once and logs nothing.

    The value logged at batch ``n`` is the rate the ``n``-th update used (Composer logs the same
    number at the same batch). The rates stay on the device: each ``BATCH_END`` keeps a device
    copy (the optimizer state itself is donated to the next step), and the copies are fetched in
    one transfer every ``fetch_interval`` batches, one interval behind the newest step so the device
    never waits, and all at ``EPOCH_END`` and ``FIT_END``.

    Args:
        fetch_interval: how many batches' rates are fetched together.

    Example::

        from composerjax.optim import DecoupledAdamW, CosineAnnealingWithWarmupScheduler
        trainer = Trainer(model, train_loader, max_duration='1000ba', optimizers=DecoupledAdamW(lr=1e-3),
                          schedulers=[CosineAnnealingWithWarmupScheduler(t_warmup='100ba')],
                          callbacks=[LRMonitor()], loggers=[TensorboardLogger()])  # lr-DecoupledAdamW/group0
    """

    def __init__(self, fetch_interval: int = 10) -> None:
        if isinstance(fetch_interval, bool) or not isinstance(fetch_interval, int) or fetch_interval < 1:
            raise ValueError(f"LRMonitor(fetch_interval={fetch_interval!r}): expected a positive integer (batches)")
        self.fetch_interval = fetch_interval
        self._pending: list[tuple[int, dict[str, jax.Array]]] = []
        self._paths: dict[str, tuple[Any, ...]] | None = None  # searched once: the state's structure is fixed
        self._name = "optimizer"

    def batch_end(self, state: State, logger: Logger) -> None:
        opt_state = state.train_state.opt_state
        if self._paths is None:
            self._name = optimizer_name(state.optimizer)
            self._paths = learning_rate_paths(opt_state, self._name)
            if not any("/group" in key for key in self._paths):
                shown = ("; logging its schedule's multiplier as " + next(iter(self._paths))) if self._paths else ""
                warnings.warn(
                    "LRMonitor: the optimizer state holds no learning rate; build the optimizer with "
                    "optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)(learning_rate=1e-3), "
                    f"or use composerjax.optim.DecoupledAdamW{shown}",
                    stacklevel=2,
                )
        if not self._paths:
            return
        try:
            rates = find_learning_rates(opt_state, self._paths)
        except (KeyError, IndexError, AttributeError):  # the optimizer state was rebuilt differently
            self._paths = learning_rate_paths(opt_state, self._name)
            rates = find_learning_rates(opt_state, self._paths)
        # A copy: the optimizer state is donated to the next step, which deletes these buffers.
        self._pending.append((int(state.timestamp.batch), {key: jnp.copy(rate) for key, rate in rates.items()}))
        if len(self._pending) >= 2 * self.fetch_interval:
            self._flush(logger, self.fetch_interval)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._flush(logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._flush(logger)

    def _flush(self, logger: Logger, count: int | None = None) -> None:
        if not self._pending:
            return
        count = len(self._pending) if count is None else count
        pending, self._pending = self._pending[:count], self._pending[count:]
        values = jax.device_get([rates for _, rates in pending])
        for (batch, _), rates in zip(pending, values):
            logger.log_metrics({key: float(rate) for key, rate in rates.items()}, step=batch)
