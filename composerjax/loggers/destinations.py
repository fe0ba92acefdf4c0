"""Logger destinations for the backbone: progress bar, console, JSONL file and in-memory."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Any

from composerjax.loggers.logger import Logger, LoggerDestination

if TYPE_CHECKING:
    from composerjax.core.state import State

__all__ = ["ProgressBarLogger", "ConsoleLogger", "FileLogger", "InMemoryLogger"]


class ProgressBarLogger(LoggerDestination):
    """A tqdm bar per epoch with the latest loss, eval metrics, throughput and ETA.

    The bar advances on ``batch_end`` (host only, no device sync); the loss shown is the one most
    recently fetched by the trainer (every ``log_interval`` batches).

    Args:
        stream: where to draw (stderr by default).
        disable: hide the bar; by default it is shown only when ``stream`` is a terminal or when
            ``force=True``.

    Example:
        >>> ProgressBarLogger(disable=True).bar is None
        True
    """

    def __init__(self, stream: Any = None, disable: bool | None = None, force: bool = False) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if disable is None:
            disable = not (force or getattr(self.stream, "isatty", lambda: False)())
        self.disable = disable
        self.bar: Any = None
        self._postfix: dict[str, str] = {}

    def epoch_start(self, state: State, logger: Logger) -> None:
        if self.disable:
            return
        from tqdm.auto import tqdm

        self._close_bar()
        self.bar = tqdm(
            total=state.dataloader_len,
            desc=f"epoch {state.timestamp.epoch}",
            file=self.stream,
            unit="ba",
            dynamic_ncols=True,
            leave=True,
        )
        self.bar.update(state.timestamp.batch_in_epoch)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.bar is None:
            return
        for name, value in metrics.items():
            if name.startswith("loss/train"):
                self._postfix["loss"] = f"{value:.4g}"
            elif name.startswith("metrics/"):
                self._postfix[name.split("/", 1)[1]] = f"{value:.4g}"
        self.bar.set_postfix(self._postfix, refresh=False)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._close_bar()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._close_bar()

    def close(self, state: State, logger: Logger) -> None:
        self._close_bar()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class ConsoleLogger(LoggerDestination):
    """Print metrics as ``[batch N] name: value`` lines.

    Example:
        >>> ConsoleLogger().log_metrics({'loss/train/total': 0.5}, step=10)
        [batch 10] loss/train/total: 0.5
    """

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        text = ", ".join(f"{name}: {value:.6g}" for name, value in metrics.items())
        print(f"[batch {step}] {text}", file=self.stream or sys.stdout)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        print(f"hyperparameters: {hyperparameters}", file=self.stream or sys.stdout)


class FileLogger(LoggerDestination):
    """Append metrics as JSON lines (``{"step": N, "name": value, ...}``) to ``path``.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), 'metrics.jsonl')
        >>> destination = FileLogger(path)
        >>> destination.log_metrics({'loss': 0.5}, step=1); destination.close(None, None)
        >>> open(path).read()
        '{"step": 1, "loss": 0.5}\\n'
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def _open(self) -> Any:
        if self._file is None:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            self._file = open(self.path, "a", encoding="utf-8")
        return self._file

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._open().write(json.dumps({"step": step, **metrics}) + "\n")

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._open().write(json.dumps({"hyperparameters": hyperparameters}, default=str) + "\n")

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, state: State | None, logger: Logger | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class InMemoryLogger(LoggerDestination):
    """Keep every logged value in memory: ``data[name]`` is a list of ``(step, value)``.

    Example:
        >>> destination = InMemoryLogger()
        >>> destination.log_metrics({'loss': 0.5}, step=1)
        >>> destination.data['loss']
        [(1, 0.5)]
    """

    def __init__(self) -> None:
        self.data: dict[str, list[tuple[int | None, float]]] = {}
        self.hyperparameters: dict[str, Any] = {}

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for name, value in metrics.items():
            self.data.setdefault(name, []).append((step, value))

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self.hyperparameters.update(hyperparameters)
