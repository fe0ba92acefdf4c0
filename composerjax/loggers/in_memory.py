"""InMemoryLogger: keep every logged value in Python lists, for tests, notebooks and callbacks."""

from __future__ import annotations

from typing import Any

import numpy as np

from composerjax.loggers.logger import LoggerDestination

__all__ = ["InMemoryLogger"]


class InMemoryLogger(LoggerDestination):
    """Keep every logged value in memory, on every process.

    Attributes:
        data: ``{name: [(step, value), ...]}`` for every metric, in logging order.
        hyperparameters: every hyperparameter logged so far (later calls update earlier keys).
        images: ``{name: [(step, (N, H, W, C) array), ...]}``.
        tables: ``{name: [(step, columns, rows), ...]}``.

    Example:
        >>> destination = InMemoryLogger()
        >>> destination.log_metrics({'loss': 0.5}, step=1)
        >>> destination.log_metrics({'loss': 0.25}, step=2)
        >>> destination.data['loss'], destination.latest('loss')
        ([(1, 0.5), (2, 0.25)], 0.25)
    """

    def __init__(self) -> None:
        self.data: dict[str, list[tuple[int | None, float]]] = {}
        self.hyperparameters: dict[str, Any] = {}
        self.images: dict[str, list[tuple[int | None, np.ndarray]]] = {}
        self.tables: dict[str, list[tuple[int | None, list[str], list[list[Any]]]]] = {}

    def latest(self, name: str) -> float:
        """Return the most recent value logged as ``name``.

        Raises:
            KeyError: naming the metrics that were logged, when ``name`` was not.
        """
        if name not in self.data:
            raise KeyError(f"{name!r} was never logged; logged metrics: {sorted(self.data)}")
        return self.data[name][-1][1]

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            self.data.setdefault(name, []).append((step, value))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        self.images.setdefault(name, []).append((step, images))

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        self.tables.setdefault(name, []).append((step, columns, rows))
