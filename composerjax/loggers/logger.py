"""The Logger facade: one object algorithms and callbacks log through, many destinations behind it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from composerjax.core.callback import Callback

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.core.trace import Trace

__all__ = ["Logger", "LoggerDestination"]


class LoggerDestination(Callback):
    """Where logged values go (console, progress bar, files). A destination is also a Callback.

    Values arrive as host numbers: the trainer fetches device values in one batched transfer every
    ``log_interval`` batches before calling ``log_metrics``.

    Example:
        >>> class PrintDestination(LoggerDestination):
        ...     def log_metrics(self, metrics, step=None):
        ...         print(step, metrics)
        >>> PrintDestination().log_metrics({'loss': 0.5}, step=3)
        3 {'loss': 0.5}
    """

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar metrics at ``step``."""

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Record the run's hyperparameters."""

    def log_traces(self, traces: dict[str, Trace]) -> None:
        """Record engine traces."""


class Logger:
    """Send values to every destination.

    Args:
        state: the training state (gives the default ``step`` for ``log_metrics``).
        destinations: the destinations to forward to.

    Example:
        >>> logger = Logger(state=None, destinations=[])
        >>> logger.log_metrics({'loss/train': 0.25}, step=1)
    """

    def __init__(self, state: State | None, destinations: Sequence[LoggerDestination] = ()) -> None:
        self._state = state
        self._destinations: list[LoggerDestination] = list(destinations)

    @property
    def destinations(self) -> list[LoggerDestination]:
        """The destinations; mutate this list (append/remove) rather than replacing it."""
        return self._destinations

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log scalar metrics at ``step`` (defaults to the current batch)."""
        if step is None and self._state is not None:
            step = self._state.timestamp.batch
        for destination in self.destinations:
            destination.log_metrics(metrics, step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Log the run's hyperparameters."""
        for destination in self.destinations:
            destination.log_hyperparameters(hyperparameters)

    def log_traces(self, traces: dict[str, Trace]) -> None:
        """Log engine traces (only destinations that record traces keep them)."""
        for destination in self.destinations:
            destination.log_traces(traces)
