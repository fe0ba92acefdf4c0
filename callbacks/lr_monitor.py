"""LRMonitor: log the learning rate of every optax transform built with ``optax.inject_hyperparams``."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import optax

from composerjax import Callback, Logger, State

__all__ = ["LRMonitor", "find_learning_rates", "learning_rate_paths"]

_INJECT_STATES = (optax.InjectHyperparamsState, optax.InjectStatefulHyperparamsState)


def _is_inject_state(node: Any) -> bool:
    return isinstance(node, _INJECT_STATES)


def _key_name(key: Any) -> str:
    return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))


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


def learning_rate_paths(opt_state: Any) -> dict[str, tuple[Any, ...]]:
    """``{'lr-<name>': key path}`` of every ``inject_hyperparams`` state in ``opt_state`` with a learning rate.

    The name is ``'optimizer'`` for a top-level transform and ``'optimizer/<path>'`` for one nested
    in a chain or ``multi_transform`` (e.g. ``'optimizer/1'`` for the second link of a chain).

    Example:
        >>> import jax.numpy as jnp
        >>> sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> list(learning_rate_paths(optax.chain(optax.clip(1.0), sgd).init(jnp.zeros(2))))
        ['lr-optimizer/1']
    """
    found = {}
    for path, node in jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=_is_inject_state)[0]:
        if _is_inject_state(node) and "learning_rate" in node.hyperparams:
            found["/".join(["lr-optimizer", *map(_key_name, path)])] = tuple(path)
    return found


def find_learning_rates(opt_state: Any, paths: dict[str, tuple[Any, ...]] | None = None) -> dict[str, Any]:
    """Return ``{'lr-<name>': learning rate}`` for every ``inject_hyperparams`` state in ``opt_state``.

    The values are the optimizer state's own arrays: after an update they hold the rate that update
    used. ``paths`` (from :func:`learning_rate_paths`) skips the search through the state.

    Example:
        >>> import jax.numpy as jnp
        >>> sgd = optax.inject_hyperparams(optax.sgd)(learning_rate=0.5)
        >>> find_learning_rates(optax.chain(optax.clip(1.0), sgd).init(jnp.zeros(2)))
        {'lr-optimizer/1': Array(0.5, dtype=float32)}
    """
    if paths is None:
        paths = learning_rate_paths(opt_state)
    return {name: _follow(opt_state, path).hyperparams["learning_rate"] for name, path in paths.items()}


class LRMonitor(Callback):
    """Log each step's learning rate as ``lr-optimizer`` (one entry per ``inject_hyperparams`` transform).

    optax transforms keep their learning rate inside a closure; only a transform wrapped in
    ``optax.inject_hyperparams`` stores it in its state, where this callback reads it. Without one,
    the callback warns once and logs nothing.

    The value logged at step ``n`` is the rate the ``n``-th optimizer step used (``schedule(n - 1)``
    for a schedule of the step count). The rates stay on the device: each ``BATCH_END`` keeps a
    device copy (the optimizer state itself is donated to the next step), and the copies are fetched
    in one transfer every ``fetch_interval`` batches, one interval behind the newest step so the
    device never waits, and all at ``EPOCH_END`` and ``FIT_END``.

    Args:
        fetch_interval: how many batches' rates are fetched together.

    Example::

        schedule = optax.cosine_decay_schedule(0.1, decay_steps=1000)
        optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=schedule, weight_decay=1e-4)
        trainer = Trainer(model, train_loader, max_duration='1000ba', optimizers=optimizer,
                          callbacks=[LRMonitor()], loggers=[TensorboardLogger()])
    """

    def __init__(self, fetch_interval: int = 10) -> None:
        if isinstance(fetch_interval, bool) or not isinstance(fetch_interval, int) or fetch_interval < 1:
            raise ValueError(f"LRMonitor(fetch_interval={fetch_interval!r}): expected a positive integer (batches)")
        self.fetch_interval = fetch_interval
        self._pending: list[tuple[int, dict[str, jax.Array]]] = []
        self._paths: dict[str, tuple[Any, ...]] | None = None  # searched once: the state's structure is fixed

    def batch_end(self, state: State, logger: Logger) -> None:
        opt_state = state.train_state.opt_state
        if self._paths is None:
            self._paths = learning_rate_paths(opt_state)
            if not self._paths:
                warnings.warn(
                    "LRMonitor: the optimizer state holds no learning rate; build the optimizer with "
                    "optax.inject_hyperparams, e.g. optax.inject_hyperparams(optax.adam)(learning_rate=schedule)",
                    stacklevel=2,
                )
        if not self._paths:
            return
        try:
            rates = find_learning_rates(opt_state, self._paths)
        except (KeyError, IndexError, AttributeError):  # the optimizer state was rebuilt differently
            self._paths = learning_rate_paths(opt_state)
            rates = find_learning_rates(opt_state, self._paths)
        # A copy: the optimizer state is donated to the next step, which deletes these buffers.
        self._pending.append((state.timestamp.batch, {name: jnp.copy(rate) for name, rate in rates.items()}))
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
            logger.log_metrics({name: float(rate) for name, rate in rates.items()}, step=batch)
