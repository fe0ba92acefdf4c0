"""The Logger facade: one object algorithms and callbacks log through, many destinations behind it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import numpy as np

from composerjax.core.callback import Callback
from composerjax.loggers.images import image_batch
from composerjax.parallel.dist import is_process_zero  # re-exported: destinations write only on process 0

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.core.trace import Trace

__all__ = ["Logger", "LoggerDestination", "RunOutcome", "closing_outcome", "is_process_zero"]


class LoggerDestination(Callback):
    """Where logged values go (console, progress bar, files). A destination is also a Callback.

    Override the ``log_*`` methods you handle; the others do nothing. Values arrive as host values:
    the trainer fetches device scalars in one batched transfer every ``log_interval`` batches before
    calling ``log_metrics``, and ``Logger.log_images``/``log_table`` fetch once per call. Destinations
    that write files or draw on a terminal do so only on process 0 (``is_process_zero()``).

    Example:
        >>> class PrintDestination(LoggerDestination):
        ...     def log_metrics(self, metrics, step=None):
        ...         print(step, metrics)
        >>> PrintDestination().log_metrics({'loss': 0.5}, step=3)
        3 {'loss': 0.5}
    """

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Record scalar metrics (host floats) at ``step``."""

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Record the run's hyperparameters (values may be nested dicts, lists, strings, numbers)."""

    def log_traces(self, traces: dict[str, Trace]) -> None:
        """Record the traces of one host event (``{'Name/EVENT': Trace}``)."""

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        """Record a batch of images: a host ``(N, H, W, C)`` array, ``C`` in 1-4 (see ``Logger.log_images``)."""

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        """Record a table: ``rows`` are lists of plain Python values, one per column."""

    def flush(self) -> None:
        """Write out everything logged so far (to disk, or to the tracker's store); the run stays open.

        Destinations that buffer call it at ``FIT_END`` (so a script that ends after ``fit`` loses
        nothing) and on ``close``, which also ends the run. The default does nothing.
        """

    def can_upload_files(self) -> bool:
        """Whether this destination keeps files it is handed with ``upload_file`` (Composer's)."""
        return _overrides(self, "upload_file")

    def upload_file(self, state: State | None, remote_file_name: str, file_path: str | os.PathLike[str], *,
                    overwrite: bool = False) -> None:
        """Keep a copy of a finished file or folder (a saved checkpoint) under ``remote_file_name``.

        Called on every destination after a checkpoint is verified on disk; the default keeps nothing.
        """


class Logger:
    """Send logged values to every destination.

    Algorithms and callbacks receive the trainer's Logger at every event. ``log_metrics`` expects host
    numbers; ``log_images`` and ``log_table`` also take device arrays and fetch them in one transfer
    per call, and only when some destination handles them.

    Args:
        state: the training state (gives the default ``step``: the int ``state.timestamp.batch.value``).
        destinations: the destinations to forward to.

    Example:
        >>> from composerjax.loggers import InMemoryLogger
        >>> memory = InMemoryLogger()
        >>> logger = Logger(state=None, destinations=[memory])
        >>> logger.log_metrics({'loss/train': 0.25}, step=1)
        >>> logger.log_table(['name', 'score'], [['a', 1.5]], name='scores', step=1)
        >>> memory.data['loss/train'], memory.tables['scores']
        ([(1, 0.25)], [(1, ['name', 'score'], [['a', 1.5]])])
    """

    def __init__(self, state: State | None, destinations: Sequence[LoggerDestination] = ()) -> None:
        self._state = state
        self._destinations: list[LoggerDestination] = list(destinations)

    @property
    def destinations(self) -> list[LoggerDestination]:
        """The destinations; mutate this list (append/remove) rather than replacing it."""
        return self._destinations

    def _step(self, step: int | None) -> int | None:
        if step is None and self._state is not None:
            return self._state.timestamp.counts.batch
        return step

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log scalar metrics (host numbers) at ``step`` (defaults to the current batch)."""
        step = self._step(step)
        for destination in self._destinations:
            destination.log_metrics(metrics, step)

    def flush(self) -> None:
        """Have every destination write out what it was given so far (see ``LoggerDestination.flush``)."""
        for destination in self._destinations:
            destination.flush()

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        """Log the run's hyperparameters."""
        for destination in self._destinations:
            destination.log_hyperparameters(hyperparameters)

    def log_traces(self, traces: dict[str, Trace]) -> None:
        """Log the traces of one host event (only destinations that record traces keep them)."""
        for destination in self._destinations:
            destination.log_traces(traces)

    def log_images(
        self, images: Any, name: str = "images", step: int | None = None, channels_last: bool = True
    ) -> None:
        """Log images: one ``(H, W)`` or ``(H, W, C)`` image, an ``(N, H, W, C)`` batch, or a list of images.

        Device arrays are fetched in one transfer, and only when a destination handles images. Float
        images are read as values in [0, 1], integer ones in [0, 255].

        Args:
            images: the image(s); ``C`` (channels) must be 1 (grey), 2 (grey + alpha), 3 (RGB) or 4 (RGBA).
            name: the tag the images are stored under.
            step: the step to log at (defaults to the current batch).
            channels_last: False when images are ``(C, H, W)`` / ``(N, C, H, W)``.

        Raises:
            ValueError: for an empty list or an array whose shape is not an image or image batch.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_images(name={name!r}): expected a non-empty string")
        receivers = [d for d in self._destinations if _overrides(d, "log_images")]
        if not receivers:
            return
        batch = image_batch(jax.device_get(images), channels_last)
        step = self._step(step)
        for destination in receivers:
            destination.log_images(batch, name, step)

    def upload_file(self, remote_file_name: str, file_path: str | os.PathLike[str], *, overwrite: bool = False,
                    ) -> None:
        """Hand a finished file or folder (a saved checkpoint) to every destination that keeps files.

        Example:
            >>> Logger(state=None, destinations=[]).upload_file('run/checkpoints/ep1-ba4', '/tmp/ep1-ba4')
        """
        for destination in self._destinations:
            if destination.can_upload_files():
                destination.upload_file(self._state, remote_file_name, file_path, overwrite=overwrite)

    def log_table(self, columns: Sequence[str], rows: Sequence[Sequence[Any]], name: str = "table",
                  step: int | None = None) -> None:
        """Log a table: ``rows`` hold one value per column (numbers, strings, device scalars).

        Device values are fetched in one transfer and arrive at destinations as plain Python values.

        Raises:
            ValueError: when ``columns`` is not a sequence of strings or a row's length differs from it.
        """
        if isinstance(columns, str) or not all(isinstance(column, str) for column in columns):
            raise ValueError(f"log_table(columns={columns!r}): expected a sequence of column names (strings)")
        if not isinstance(name, str) or not name:
            raise ValueError(f"log_table(name={name!r}): expected a non-empty string")
        rows = [list(row) for row in rows]
        for index, row in enumerate(rows):
            if len(row) != len(columns):
                raise ValueError(f"log_table(rows=...): row {index} has {len(row)} values; expected one per "
                                 f"column ({len(columns)}: {list(columns)})")
        receivers = [d for d in self._destinations if _overrides(d, "log_table")]
        if not receivers:
            return
        plain_rows = [[_plain(value) for value in row] for row in jax.device_get(rows)]
        step = self._step(step)
        for destination in receivers:
            destination.log_table(list(columns), plain_rows, name, step)


class RunOutcome(NamedTuple):
    """How a tracker's run ends: ``status`` ('finished', 'failed' or 'interrupted') and a process's ``exit_code``."""

    status: str
    exit_code: int


def closing_outcome(failed: bool = False) -> RunOutcome:
    """How a run closed now ends, read from the exception being handled while it closes (if any).

    An interruption (an exception with a ``signum``, such as ``TrainingInterrupted``, or
    ``KeyboardInterrupt``) gives ``'interrupted'`` with exit code ``128 + signal``; ``sys.exit(0)``
    or no exception gives ``'finished'`` unless ``failed`` (``fit`` failed earlier); any other
    exception gives ``'failed'`` with exit code 1.

    Example:
        >>> closing_outcome()
        RunOutcome(status='finished', exit_code=0)
        >>> try:
        ...     raise KeyboardInterrupt
        ... except KeyboardInterrupt:
        ...     closing_outcome()
        RunOutcome(status='interrupted', exit_code=130)
    """
    error = sys.exc_info()[1]
    signum = getattr(error, "signum", None)
    if isinstance(signum, int) and not isinstance(signum, bool):
        return RunOutcome("interrupted", 128 + signum)
    if isinstance(error, KeyboardInterrupt):
        return RunOutcome("interrupted", 130)  # SIGINT
    if failed or not (error is None or (isinstance(error, SystemExit) and error.code in (0, None))):
        return RunOutcome("failed", 1)
    return RunOutcome("finished", 0)


def _overrides(destination: LoggerDestination, method: str) -> bool:
    return getattr(type(destination), method, None) is not getattr(LoggerDestination, method)


def _plain(value: Any) -> Any:
    """A numpy scalar or 0-d array as the Python number it holds; anything else unchanged."""
    if isinstance(value, np.generic) or (isinstance(value, np.ndarray) and value.ndim == 0):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value
