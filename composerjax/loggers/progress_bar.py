"""ProgressBarLogger: tqdm bars for the run and the current epoch, with loss, eval metrics, rate and ETA."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any, TextIO

from composerjax.loggers.logger import LoggerDestination, is_process_zero

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.loggers.logger import Logger

__all__ = ["ProgressBarLogger"]


class ProgressBarLogger(LoggerDestination):
    """Two tqdm bars: the whole run (``fit``) and the current epoch, each with batches/s and ETA.

    The run bar counts batches up to ``max_duration`` (its total is unknown for durations that cannot
    be converted to batches in advance) and shows the latest training loss and eval metrics
    (``loss=0.41, MulticlassAccuracy=0.9``; other evaluators as ``<evaluator>/<metric>``); it stays on
    screen at the end. The epoch bar (``epoch N``, batches of the epoch) is replaced by the next
    epoch's. Bars advance at ``batch_end`` with no device sync: the loss shown is the one the trainer
    last fetched (every ``log_interval`` batches).

    Args:
        stream: where to draw (``sys.stderr`` by default).
        disable: True hides the bars, False shows them. By default (None) they are shown only on
            process 0 and only when ``stream`` is a terminal, or with ``force=True``.
        force: draw even when ``stream`` is not a terminal (a file, a captured stream).

    Example:
        >>> import io
        >>> ProgressBarLogger(stream=io.StringIO()).disable  # not a terminal: quiet
        True
        >>> ProgressBarLogger(stream=io.StringIO(), force=True).disable
        False
    """

    #: The bars advance per batch after a grouped call as well (``steps_per_call``).
    accepts_grouped_batches = True

    def __init__(self, stream: TextIO | None = None, disable: bool | None = None, force: bool = False) -> None:
        if stream is not None and not hasattr(stream, "write"):
            raise TypeError(f"ProgressBarLogger(stream={stream!r}): expected a text stream with write(), or None")
        if disable is not None and not isinstance(disable, bool):
            raise TypeError(f"ProgressBarLogger(disable={disable!r}): expected True, False or None (automatic)")
        if not isinstance(force, bool):
            raise TypeError(f"ProgressBarLogger(force={force!r}): expected a bool")
        self.stream = stream if stream is not None else sys.stderr
        if disable is None:
            disable = not (is_process_zero() and (force or _is_terminal(self.stream)))
        self.disable = disable
        self.run_bar: Any = None
        self.epoch_bar: Any = None
        self._postfix: dict[str, str] = {}

    @property
    def bar(self) -> Any:
        """The bar the latest values are shown on: the run bar, or the epoch bar outside ``fit``."""
        return self.run_bar if self.run_bar is not None else self.epoch_bar

    def _new_bar(self, **kwargs: Any) -> Any:
        from tqdm.auto import tqdm

        # A terminal that reports no width (a fresh pty) would get empty bars: give it 100 columns.
        width = _terminal_width(self.stream)
        return tqdm(file=self.stream, unit="ba", dynamic_ncols=width != 0, ncols=100 if width == 0 else None,
                    **kwargs)

    def fit_start(self, state: State, logger: Logger) -> None:
        if self.disable:
            return
        self._close_bars()
        self.run_bar = self._new_bar(desc="fit", total=state.batches_in_duration(),
                                     initial=state.timestamp.counts.batch, position=0, leave=True)
        self.run_bar.set_postfix(self._postfix, refresh=False)
        if state.timestamp.counts.batch_in_epoch:  # resumed mid-epoch: no EPOCH_START for this one
            self.epoch_start(state, logger)

    def epoch_start(self, state: State, logger: Logger) -> None:
        if self.disable:
            return
        self._close_epoch_bar()
        self.epoch_bar = self._new_bar(desc=f"epoch {state.timestamp.counts.epoch}", total=state.dataloader_len,
                                       initial=state.timestamp.counts.batch_in_epoch,
                                       position=1 if self.run_bar is not None else 0, leave=self.run_bar is None)

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.epoch_bar is not None:
            self.epoch_bar.update(1)
        if self.run_bar is not None:
            self.run_bar.update(1)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self.disable:
            return
        for name, value in metrics.items():
            if name == "loss/train/total":
                self._postfix["loss"] = f"{value:.4g}"
            elif name.startswith("metrics/"):
                self._postfix[_short_name(name)] = f"{value:.4g}"
        bar = self.bar
        if bar is not None:
            bar.set_postfix(self._postfix, refresh=False)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self._close_epoch_bar()
        if self.run_bar is not None:
            self.run_bar.refresh()  # show the loss fetched at the end of the epoch

    def eval_end(self, state: State, logger: Logger) -> None:
        bar = self.bar
        if bar is not None:
            bar.refresh()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._close_bars()

    def close(self, state: State, logger: Logger) -> None:
        self._close_bars()

    def _close_epoch_bar(self) -> None:
        if self.epoch_bar is not None:
            self.epoch_bar.refresh()  # its last count, even when tqdm skipped drawing it
            self.epoch_bar.close()
            self.epoch_bar = None

    def _close_bars(self) -> None:
        self._close_epoch_bar()
        if self.run_bar is not None:
            self.run_bar.refresh()
            self.run_bar.close()
            self.run_bar = None


def _is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except ValueError:  # a closed stream
        return False


def _terminal_width(stream: Any) -> int | None:
    """The terminal's width in columns (0 when it reports none); None when it is not a terminal."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return None


def _short_name(name: str) -> str:
    """``metrics/eval/<metric>`` -> ``<metric>``; ``metrics/<label>/<metric>`` -> ``<label>/<metric>``."""
    name = name.removeprefix("metrics/")
    return name.removeprefix("eval/")
