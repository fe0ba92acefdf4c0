"""FileLogger: append metrics, hyperparameters, tables (and optionally traces) to a JSON-lines file."""

from __future__ import annotations

import json
import os
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from composerjax.loggers.logger import LoggerDestination, is_process_zero

if TYPE_CHECKING:
    from composerjax.core.state import State
    from composerjax.core.trace import Trace
    from composerjax.loggers.logger import Logger

__all__ = ["FileLogger"]


class FileLogger(LoggerDestination):
    """Append one JSON object per line: ``{"step": N, "loss/train/total": 0.41, ...}``.

    Lines by kind: metrics ``{"step", <name>: value, ...}``; hyperparameters ``{"hyperparameters": {...}}``;
    tables ``{"step", "table", "columns", "rows"}``; with ``traces=True``, the algorithms that ran at
    each host event ``{"step", "traces": [Trace.to_dict(), ...]}``. Images are not written. The file is
    opened for appending (a resumed run continues it) and only on process 0.

    Args:
        path: the file; by default ``<state.run_dir>/metrics.jsonl`` (the run folder is learnt at INIT).
        traces: also write the traces of host events.

    Example:
        >>> import tempfile, os
        >>> path = os.path.join(tempfile.mkdtemp(), 'metrics.jsonl')
        >>> destination = FileLogger(path)
        >>> destination.log_metrics({'loss': 0.5}, step=1); destination.close(None, None)
        >>> open(path).read()
        '{"step": 1, "loss": 0.5}\\n'

    In a Trainer, with the default path::

        trainer = Trainer(model, loader, max_duration='1ep', loggers=[FileLogger()], run_dir='runs/a')
        trainer.fit()  # rows in runs/a/metrics.jsonl
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, traces: bool = False) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"FileLogger(path={path!r}): expected a file path (str or os.PathLike) or None")
        if not isinstance(traces, bool):
            raise TypeError(f"FileLogger(traces={traces!r}): expected a bool")
        self._path = os.fspath(path) if path is not None else None
        self._run_dir: str | None = None
        self.traces = traces
        self._file: IO[str] | None = None
        self._writes = True

    @property
    def path(self) -> str | None:
        """Where rows go: the path given, or ``<run_dir>/metrics.jsonl`` once the run folder is known."""
        if self._path is not None:
            return self._path
        return os.path.join(self._run_dir, "metrics.jsonl") if self._run_dir is not None else None

    def init(self, state: State, logger: Logger) -> None:
        self._run_dir = state.run_dir

    def fit_start(self, state: State, logger: Logger) -> None:
        if self._file is None:
            self._run_dir = state.run_dir

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            if not self._writes or not is_process_zero():
                self._writes = False
                return
            path = self.path
            if path is None:
                raise RuntimeError("FileLogger(path=None) writes to <state.run_dir>/metrics.jsonl and learns the run "
                                   "folder at INIT; outside a Trainer, pass FileLogger(path=...)")
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")
        self._file.write(json.dumps(row, default=_jsonable) + "\n")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self._write({"step": step, **metrics})

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._write({"hyperparameters": hyperparameters})

    def log_table(self, columns: list[str], rows: list[list[Any]], name: str, step: int | None = None) -> None:
        self._write({"step": step, "table": name, "columns": columns, "rows": rows})

    def log_traces(self, traces: dict[str, Trace]) -> None:
        if self.traces and traces:
            trace_list = list(traces.values())
            self._write({"step": trace_list[0].batch, "traces": [trace.to_dict() for trace in trace_list]})

    # Rows reach the disk at least once per batch, so a crashed run keeps what it logged.
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.flush()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.batch_checkpoint(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.batch_checkpoint(state, logger)

    def close(self, state: State | None, logger: Logger | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _jsonable(value: Any) -> Any:
    """JSON fallback: numpy values as Python numbers or lists, anything else as its ``str``."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return list(value)
    return str(value)
