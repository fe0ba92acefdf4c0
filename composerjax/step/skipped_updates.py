"""How many updates ``skip_nonfinite_updates`` skipped: summed on the device, read once when asked."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["SKIPPED_METRIC", "SkippedUpdates"]

#: The step metric the compiled step's non-finite guard sets: 1.0 for a skipped update, else 0.0.
SKIPPED_METRIC = "skipped_nonfinite"


@jax.jit
def _count(flags: jax.Array) -> jax.Array:
    return jnp.sum(flags).astype(jnp.int32)


@jax.jit
def _add(total: jax.Array, flags: jax.Array) -> jax.Array:
    # Only arrays the steps returned meet here: no host value to place next to a multi-process array.
    return total + jnp.sum(flags).astype(jnp.int32)


class SkippedUpdates:
    """The updates the compiled step's non-finite guard skipped, out of those it guarded.

    The guard (``Trainer(skip_nonfinite_updates=True)`` or ``NaNMonitor(policy='skip')``) marks a
    skipped update with ``step_metrics['skipped_nonfinite'] == 1``. :meth:`add` sums those flags
    on the device as each call returns (one small dispatch, never a wait); :meth:`read` fetches
    the total, once, when the run reports it.

    Example:
        >>> import jax.numpy as jnp
        >>> skipped = SkippedUpdates()
        >>> skipped.add({"skipped_nonfinite": jnp.float32(1)}, 1)
        >>> skipped.add({"skipped_nonfinite": jnp.asarray([0.0, 1.0, 1.0])}, 3)
        >>> skipped.read(), skipped.guarded
        (3, 4)
    """

    def __init__(self) -> None:
        self._total: jax.Array | None = None
        #: Updates run with the guard compiled in (host count).
        self.guarded = 0

    def add(self, step_metrics: Any, updates: int) -> None:
        """Count the flags of ``updates`` guarded updates (a step's metrics, or a group's stacked ones)."""
        flags = step_metrics.get(SKIPPED_METRIC) if isinstance(step_metrics, dict) else None
        if flags is None:  # the step has no guard
            return
        total = self._total
        self._total = _count(flags) if total is None else _add(total, flags)
        self.guarded += updates

    def read(self) -> int:
        """The number of skipped updates so far (fetches the device total: call it once per report)."""
        return 0 if self._total is None else int(jax.device_get(self._total))
