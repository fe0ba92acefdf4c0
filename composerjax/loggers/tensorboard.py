"""TensorboardLogger: write scalars, hyperparameters, images and tables as TensorBoard event files."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from composerjax.loggers.images import encode_png
from composerjax.loggers.logger import LoggerDestination, is_process_zero

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.loggers.logger import Logger

__all__ = ["TensorboardLogger"]

HYPERPARAMETERS_TAG = "hyperparameters"


class TensorboardLogger(LoggerDestination):
    """Write a TensorBoard event file with tensorboardX (process 0 only).

    What goes where: metrics are scalars (one event per step, tag = metric name); each
    ``log_hyperparameters`` call is a text table under ``hyperparameters``, and at ``close`` all of them
    go to the HParams dashboard (nested dicts flattened to ``a/b`` names); images are PNGs under
    ``<name>`` (``<name>/<i>`` for batches of several); tables are markdown text under their name.

    Args:
        log_dir: the folder for the event file; by default ``<state.run_dir>/tensorboard`` (the run
            folder is learnt at INIT).
        flush_secs: write buffered events to disk when this many seconds have passed since the last
            flush (checked at each write; events are also flushed at the end of every epoch, eval and
            fit, and the file is closed when the Trainer closes or, never closed, at interpreter exit).

    Example:
        >>> import tempfile
        >>> destination = TensorboardLogger(log_dir=tempfile.mkdtemp())
        >>> destination.log_metrics({'loss/train/total': 0.5}, step=1)
        >>> destination.close(None, None)

    In a Trainer (then ``tensorboard --logdir runs``)::

        trainer = Trainer(model, loader, max_duration='1ep', loggers=[TensorboardLogger()], run_dir='runs/a')
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, flush_secs: float = 120.0) -> None:
        if log_dir is not None and not isinstance(log_dir, (str, os.PathLike)):
            raise TypeError(f"TensorboardLogger(log_dir={log_dir!r}): expected a folder path (str or os.PathLike) "
                            "or None")
        if isinstance(flush_secs, bool) or not isinstance(flush_secs, (int, float)) or flush_secs <= 0:
            raise ValueError(f"TensorboardLogger(flush_secs={flush_secs!r}): expected a positive number of seconds")
        self._log_dir = os.fspath(log_dir) if log_dir is not None else None
        self._run_dir: str | None = None
        self.flush_secs = flush_secs
        self._writer: Any = None
        self._writes = True
        self._files_opened = 0
        self._last_flush = 0.0
        self._step = 0
        self._hyperparameters: dict[str, Any] = {}

    @property
    def log_dir(self) -> str | None:
        """The event file's folder: the one given, or ``<run_dir>/tensorboard`` once the run folder is known."""
        if self._log_dir is not None:
            return self._log_dir
        return os.path.join(self._run_dir, "tensorboard") if self._run_dir is not None else None

    def init(self, state: State, logger: Logger) -> None:
        self._run_dir = state.run_dir

    def fit_start(self, state: State, logger: Logger) -> None:
        if self._writer is None:
            self._run_dir = state.run_dir

    def _events_writer(self) -> Any:
        """The event file, opened on first use; None on processes other than 0."""
        if self._writer is None and self._writes:
            if not is_process_zero():
                self._writes = False
                return None
            log_dir = self.log_dir
            if log_dir is None:
                raise RuntimeError("TensorboardLogger(log_dir=None) writes to <state.run_dir>/tensorboard and learns "
                                   "the run folder at INIT; outside a Trainer, pass TensorboardLogger(log_dir=...)")
            # tensorboardX's FileWriter queues events to a thread and its flush() does not wait for them;
            # writing synchronously makes "flushed at the end of each epoch and fit" true. Names hold the
            # time in whole seconds only: the suffix keeps a file reopened within a second from
            # overwriting the previous one.
            from tensorboardX.event_file_writer import EventsWriter

            os.makedirs(log_dir, exist_ok=True)
            self._files_opened += 1
            self._writer = EventsWriter(os.path.join(log_dir, "events"), f".{os.getpid()}.{self._files_opened}")
            self._last_flush = time.monotonic()
        return self._writer

    def flush(self) -> None:
        """Write the buffered events to the event file (TensorBoard shows them on its next reload)."""
        if self._writer is not None:
            self._writer.flush()
            self._last_flush = time.monotonic()

    def _add(self, summary: Any, step: int | None) -> None:
        writer = self._events_writer()
        if writer is None:
            return
        from tensorboardX.proto.event_pb2 import Event

        event = Event(wall_time=time.time(), summary=summary)
        if step is not None:
            event.step = int(step)
        writer.write_event(event)
        if time.monotonic() - self._last_flush >= self.flush_secs:
            self.flush()

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        if step is not None:
            self._step = step
        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
        self._add(Summary(value=values), self._step)

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        from tensorboardX.summary import text

        flat = _flatten(hyperparameters)
        self._hyperparameters.update(flat)
        self._add(text(HYPERPARAMETERS_TAG, _markdown_table(["name", "value"], list(flat.items()))), self._step)

    def log_images(self, images: np.ndarray, name: str, step: int | None = None) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        values = []
        for index, image in enumerate(images):
            height, width, channels = image.shape
            encoded = Summary.Image(height=height, width=width, colorspace=channels,
                                    encoded_image_string=encode_png(image))
            values.append(Summary.Value(tag=name if len(images) == 1 else f"{name}/{index}", image=encoded))
        self._add(Summary(value=values), self._step if step is None else step)

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        from tensorboardX.summary import text

        self._add(text(name, _markdown_table(columns, rows)), self._step if step is None else step)

    def epoch_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def close(self, state: State | None, logger: Logger | None) -> None:
        # The HParams dashboard reads one session per run: written once, with everything logged.
        if self._hyperparameters:
            from tensorboardX.summary import hparams

            for summary in hparams(_hparam_values(self._hyperparameters), {}):
                self._add(summary, None)
            self._hyperparameters = {}
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _flatten(values: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{'a': {'b': 1}}`` -> ``{'a/b': 1}``."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def _hparam_values(values: dict[str, Any]) -> dict[str, bool | int | float | str]:
    """HParams takes bools, numbers and strings: numpy scalars become numbers, anything else its ``str``."""
    plain: dict[str, bool | int | float | str] = {}
    for name, value in values.items():
        if isinstance(value, np.generic):
            value = value.item()
        plain[name] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return plain


def _markdown_table(columns: list[str], rows: list[Any]) -> str:
    def cell(value: Any) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)
