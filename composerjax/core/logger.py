"""The Logger protocol: what algorithms and callbacks log through, as the core sees it.

The core passes a logger to ``Algorithm.apply`` and to every callback method but never builds one:
:class:`composerjax.loggers.Logger` (the facade in front of the destinations) is the implementation
the Trainer passes. Declaring the protocol here keeps ``composerjax.core`` free of imports from
``composerjax.loggers``, type hints included.

Example:
    >>> from composerjax.loggers import InMemoryLogger
    >>> from composerjax.loggers import Logger as Facade
    >>> isinstance(Facade(state=None, destinations=[InMemoryLogger()]), Logger)
    True
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from composerjax.core.trace import Trace

__all__ = ["Logger"]


@runtime_checkable
class Logger(Protocol):
    """What a logger passed to algorithms and callbacks offers: metrics, hyperparameters, traces, images, tables.

    ``step`` defaults to the current batch. See :class:`composerjax.loggers.Logger` for what each
    method accepts (host numbers for metrics; device arrays for images and tables are fetched once
    per call).

    Example:
        Code that only logs needs nothing more than this protocol:

        >>> from composerjax.loggers import InMemoryLogger
        >>> from composerjax.loggers import Logger as Facade
        >>> def log_loss(logger: Logger, loss: float) -> None:
        ...     logger.log_metrics({"loss": loss}, step=1)
        >>> memory = InMemoryLogger()
        >>> log_loss(Facade(state=None, destinations=[memory]), 0.5)
        >>> memory.data["loss"]
        [(1, 0.5)]
    """

    @property
    def destinations(self) -> list[Any]:
        """Where logged values go (each a ``LoggerDestination``, which is a callback); append or remove to change it.

        Typed ``Any`` here because :class:`~composerjax.core.callback.Callback` takes this protocol in every
        method: the core's modules import one way only.
        """
        ...

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log scalar metrics (host numbers) at ``step``."""
        ...

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Log the run's hyperparameters."""
        ...

    def log_traces(self, traces: dict[str, Trace]) -> None:
        """Log the traces of one host event (``{'Name/EVENT': Trace}``)."""
        ...

    def log_images(
        self, images: Any, name: str = "images", step: int | None = None, channels_last: bool = True
    ) -> None:
        """Log one image, a batch of images or a list of images under ``name``."""
        ...

    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str = "table",
                  step: int | None = None) -> None:
        """Log a table: ``rows`` hold one value per column."""
        ...

    def upload_file(self, remote_file_name: str, file_path: str | os.PathLike[str], *, overwrite: bool = False,
                    ) -> None:
        """Hand a finished file or folder (a saved checkpoint) to the destinations that keep files."""
        ...
