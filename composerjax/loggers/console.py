"""ConsoleLogger: print metrics, hyperparameters and tables as plain text lines."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from composerjax.loggers.logger import LoggerDestination, is_process_zero

__all__ = ["ConsoleLogger"]

_TRAIN_PREFIXES = ("loss/train", "train/")


class ConsoleLogger(LoggerDestination):
    """Print metrics as ``[batch N] name: value, ...`` lines (process 0 only).

    Training values (``loss/train/...`` and ``train/...``) are printed at steps that are multiples of
    ``interval``; everything else (eval metrics, values callbacks log) is printed whenever it is logged.
    On a terminal, lines go through ``tqdm.write`` so they appear above a progress bar instead of
    tearing it; elsewhere they are written directly.

    Args:
        interval: print training values every this many batches. The trainer hands values over every
            ``log_interval`` batches, so ``interval`` is best a multiple of it.
        stream: where to print (``sys.stdout`` by default, looked up at each print).

    Example:
        >>> ConsoleLogger().log_metrics({'loss/train/total': 0.5}, step=10)
        [batch 10] loss/train/total: 0.5
        >>> ConsoleLogger(interval=4).log_metrics({'loss/train/total': 0.5}, step=10)
        >>> ConsoleLogger(interval=4).log_metrics({'metrics/eval/MulticlassAccuracy': 0.875}, step=10)
        [batch 10] metrics/eval/MulticlassAccuracy: 0.875
    """

    def __init__(self, interval: int = 1, stream: TextIO | None = None) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"ConsoleLogger(interval={interval!r}): expected a positive integer (batches)")
        if stream is not None and not hasattr(stream, "write"):
            raise TypeError(f"ConsoleLogger(stream={stream!r}): expected a text stream with write(), or None")
        self.interval = interval
        self.stream = stream

    def _print(self, text: str) -> None:
        if not is_process_zero():
            return
        stream = self.stream or sys.stdout
        if not getattr(stream, "isatty", lambda: False)():
            # No bar is drawn on a non-terminal: tqdm.write would redraw every bar for nothing.
            stream.write(text + "\n")
            return
        from tqdm import tqdm

        tqdm.write(text, file=stream)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        on_interval = step is None or step % self.interval == 0
        shown = {name: value for name, value in metrics.items() if on_interval or not name.startswith(_TRAIN_PREFIXES)}
        if shown:
            text = ", ".join(f"{name}: {_format(value)}" for name, value in shown.items())
            self._print(f"[batch {step}] {text}")

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._print(f"hyperparameters: {hyperparameters}")

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        cells = [columns, *([_format(value) for value in row] for row in rows)]
        widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
        lines = [" | ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
        self._print("\n".join([f"[batch {step}] table {name}:", *lines]))


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
