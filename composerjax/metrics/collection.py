"""Many metrics at once: name them as Composer does, select them by regex, merge batch states, compute once."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import jax
import numpy as np
from clu import metrics as clu_metrics

__all__ = ["StateTotals", "compute_values", "merge_states", "named_metrics", "select_metrics"]

T = TypeVar("T")


def named_metrics(metrics: Any) -> dict[str, Any]:
    """``{name: metric}`` from one metric, a sequence or a mapping (a ``Metric`` / ``MetricCollection``).

    A metric outside a mapping is named after its class, as torchmetrics' ``MetricCollection``
    names its members.

    Raises:
        ValueError: when two metrics of a sequence share a class (name them with a dict).

    Example:
        >>> from composerjax.metrics import CrossEntropy, MulticlassAccuracy
        >>> list(named_metrics([CrossEntropy(), MulticlassAccuracy(num_classes=3)]))
        ['CrossEntropy', 'MulticlassAccuracy']
    """
    if isinstance(metrics, Mapping):
        return dict(metrics)
    if isinstance(metrics, clu_metrics.Metric):
        metrics = [metrics]
    named: dict[str, Any] = {}
    for metric in metrics:
        name = type(metric).__name__
        if name in named:
            raise ValueError(f"two metrics are named {name!r} (their class): pass a dict {{name: metric}} instead")
        named[name] = metric
    return named


def select_metrics(metrics: Mapping[str, T], names: Sequence[str] | None) -> dict[str, T]:
    """The metrics whose names match one of the regexes ``names`` anywhere, ignoring case (Composer's Evaluator rule).

    ``None`` selects all. ``'Accuracy'`` selects ``MulticlassAccuracy``; ``'f1'`` selects
    ``MulticlassF1Score``.

    Example:
        >>> select_metrics({"MulticlassAccuracy": 1, "CrossEntropy": 2, "MulticlassF1Score": 3}, ["accuracy", "f1"])
        {'MulticlassAccuracy': 1, 'MulticlassF1Score': 3}
    """
    if names is None:
        return dict(metrics)
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise ValueError(f"metric_names={names!r}: expected a list of regex strings (or None for all metrics)")
    return {key: metric for key, metric in metrics.items()
            if any(re.match(f".*{name}.*", key, re.IGNORECASE) for name in names)}


@jax.jit
def _merge_fixed(total: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    return {name: total[name].merge(new[name]) for name in total}


def merge_states(total: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``total`` with one more batch's ``{name: state}`` merged in; only dispatches, never waits for the device.

    Fixed-shape states (counts, sums, confusion matrices) are added in one compiled call; states
    that keep samples (``collects``, e.g. AUROC) append the batch's arrays on the host, so no
    shape grows inside a compiled function and nothing recompiles per batch. Works on global
    arrays of several processes (only ``jit`` touches them).

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.metrics import MeanMetric
        >>> total = merge_states(None, {"m": MeanMetric().update(jnp.array([1.0]))})
        >>> float(merge_states(total, {"m": MeanMetric().update(jnp.array([3.0]))})["m"].compute())
        2.0
    """
    if total is None:
        return dict(new)
    fixed = [name for name, state in new.items() if not getattr(state, "collects", False)]
    merged = _merge_fixed({name: total[name] for name in fixed}, {name: new[name] for name in fixed}) if fixed else {}
    return {name: merged[name] if name in merged else total[name].merge(new[name]) for name in new}


@jax.jit
def _merge_many(total: dict[str, Any] | None, batches: list[dict[str, Any]]) -> dict[str, Any]:
    for states in batches:
        total = dict(states) if total is None else {name: total[name].merge(states[name]) for name in total}
    return total  # type: ignore[return-value]


class StateTotals:
    """Batch states merged ``chunk`` batches at a time: one compiled merge per chunk instead of one per batch.

    Fixed-shape states wait on the device until a chunk is full, then merge in one call (which
    compiles once per chunk length: ``chunk`` and the pass's last, shorter one); states that keep
    samples (``collects``) append at once on the host, as in :func:`merge_states`. Never waits for
    the device.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.metrics import MeanMetric
        >>> totals = StateTotals(chunk=2)
        >>> for value in (1.0, 2.0, 6.0):
        ...     totals.add({"m": MeanMetric().update(jnp.array([value]))})
        >>> float(totals.result()["m"].compute())
        3.0
    """

    def __init__(self, chunk: int = 16) -> None:
        self.chunk = chunk
        self._fixed: dict[str, Any] | None = None
        self._pending: list[dict[str, Any]] = []
        self._collected: dict[str, Any] = {}
        self._names: list[str] = []

    def add(self, states: dict[str, Any]) -> None:
        """One more batch's ``{name: state}``."""
        if not self._names:
            self._names = list(states)
        fixed = {}
        for name, state in states.items():
            if getattr(state, "collects", False):
                total = self._collected.get(name)
                self._collected[name] = state if total is None else total.merge(state)
            else:
                fixed[name] = state
        if fixed:
            self._pending.append(fixed)
            if len(self._pending) >= self.chunk:
                self._flush()

    def _flush(self) -> None:
        if self._pending:
            self._fixed, self._pending = _merge_many(self._fixed, self._pending), []

    def result(self) -> dict[str, Any] | None:
        """The merged ``{name: state}`` of every batch added (None if none was)."""
        self._flush()
        if not self._names:
            return None
        merged = {**(self._fixed or {}), **self._collected}
        return {name: merged[name] for name in self._names}


@functools.cache
def _computer(sharding: Any) -> Any:
    def compute(states: dict[str, Any]) -> dict[str, Any]:
        return {name: state.compute() for name, state in states.items()}

    return jax.jit(compute) if sharding is None else jax.jit(compute, out_shardings=sharding)


def compute_values(states: dict[str, Any], sharding: Any = None) -> dict[str, float]:
    """Compute every metric in one compiled call and fetch all values in one transfer: ``{name: float}``.

    Args:
        states: ``{name: merged state}``.
        sharding: where the values go (the mesh's replicated sharding in multi-process runs, so
            every process can read them); None lets ``jit`` choose.

    Raises:
        TypeError: naming a metric whose ``compute`` is not a scalar.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.metrics import MeanMetric
        >>> compute_values({"m": MeanMetric().update(jnp.array([1.0, 2.0]))})
        {'m': 1.5}
    """
    values = jax.device_get(_computer(sharding)(states))
    results = {}
    for name, value in values.items():
        if np.ndim(value) != 0:
            raise TypeError(f"metric {name!r}: compute() returned shape {np.shape(value)}; expected a scalar to log")
        results[name] = float(value)
    return results
