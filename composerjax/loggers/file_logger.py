"""FileLogger: append metrics, hyperparameters, tables (and optionally traces) to a JSON-lines file."""

from __future__ import annotations

import json
import os
import string
from typing import IO, TYPE_CHECKING, Any

import numpy as np

from composerjax.loggers.jsonl_resume import continue_jsonl
from composerjax.loggers.logger import LoggerDestination, is_process_zero
from composerjax.parallel import dist

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
    opened for appending and only on process 0. A run resuming from a checkpoint
    (``state.resumed_from``) first cuts the file back to the rows of the checkpoint's batch and
    earlier, and adds a marker line ``{"resumed_from": "<checkpoint>", "batch": N}``, so that every
    step is in the file once (:mod:`composerjax.loggers.jsonl_resume`).

    Args:
        path: the file; by default ``<state.run_dir>/metrics.jsonl`` (the run folder is learnt at INIT).
            Composer's name fields are filled in: ``{run_name}`` (learnt at INIT), ``{rank}``,
            ``{local_rank}``, ``{node_rank}``, ``{world_size}`` (``'{run_name}/logs-rank{rank}.jsonl'``).
        traces: also write the traces of host events.
        filename: Composer's name for ``path`` (``FileLogger(filename=...)``); give one or the other.

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

    def __init__(self, path: str | os.PathLike[str] | None = None, traces: bool = False, *,
                 filename: str | os.PathLike[str] | None = None) -> None:
        field = "path"
        if filename is not None:
            if path is not None:
                raise TypeError(f"FileLogger(path={path!r}, filename={filename!r}): filename is Composer's name for "
                                "path; give one of them")
            path, field = filename, "filename"
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"FileLogger({field}={path!r}): expected a file path (str or os.PathLike) or None")
        if not isinstance(traces, bool):
            raise TypeError(f"FileLogger(traces={traces!r}): expected a bool")
        self._path = os.fspath(path) if path is not None else None
        if self._path is not None:
            _fill(self._path, field, "run")  # an unknown field fails here, not at the first row
        self._field = field
        self._run_name: str | None = None
        self._run_dir: str | None = None
        self.traces = traces
        self._file: IO[str] | None = None
        self._writes = True

    @property
    def path(self) -> str | None:
        """Where rows go: the path given (its fields filled in), or ``<run_dir>/metrics.jsonl``.

        None until INIT where that is still unknown (``{run_name}`` in the path, or no path).
        """
        if self._path is not None:
            if "{run_name" in self._path and self._run_name is None:
                return None
            return _fill(self._path, self._field, self._run_name or "")
        return os.path.join(self._run_dir, "metrics.jsonl") if self._run_dir is not None else None

    def init(self, state: State, logger: Logger) -> None:
        self._run_dir = state.run_dir
        self._run_name = state.run_name

    def fit_start(self, state: State, logger: Logger) -> None:
        if self._file is None:
            self._run_dir = state.run_dir

    def after_load(self, state: State, logger: Logger) -> None:
        # The batches after the checkpoint are trained (and logged) again: their rows go.
        resumed = state.resumed_from
        if resumed is None or not self._writes or not is_process_zero() or self.path is None:
            return
        if self._file is not None:  # rows this process logged before the load stay, before the marker
            self._file.close()
            self._file = None
        continue_jsonl(self.path, resumed.checkpoint, resumed.batch)

    def _write(self, row: dict[str, Any]) -> None:
        if self._file is None:
            if not self._writes or not is_process_zero():
                self._writes = False
                return
            path = self.path
            if path is None and self._path is not None:
                raise RuntimeError(f"FileLogger({self._field}={self._path!r}) learns {{run_name}} at INIT; outside a "
                                   "Trainer, pass a path without it")
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

    def flush(self) -> None:
        """Write the rows logged so far to the file."""
        if self._file is not None:
            self._file.flush()

    #: Its only per-batch work is the flush below, which is the same after a grouped call (once per
    #: batch of the group, after the group's rows were logged): it never blocks ``steps_per_call``.
    accepts_grouped_batches = True

    # Rows reach the disk at least once per batch, so a crashed run keeps what it logged.
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self.flush()

    def eval_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def fit_end(self, state: State, logger: Logger) -> None:
        self.flush()

    def close(self, state: State | None, logger: Logger | None) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


#: The fields a path may name (Composer's ``format_name_with_dist``; ``{local_world_size}`` is not known here).
PATH_FIELDS = ("run_name", "rank", "local_rank", "node_rank", "world_size")


def _fill(template: str, field: str, run_name: str) -> str:
    """``template`` with Composer's name fields filled in; a ValueError naming ``field`` for an unknown one."""
    if "{" not in template:
        return template
    values = {"run_name": run_name, "rank": dist.process_index(), "local_rank": dist.local_process_index(),
              "node_rank": dist.node_rank(), "world_size": dist.process_count()}
    try:
        return string.Formatter().vformat(template, (), values)
    except KeyError as error:
        raise ValueError(f"FileLogger({field}={template!r}): unknown field {{{error.args[0]}}}; the fields are "
                         f"{', '.join('{' + name + '}' for name in PATH_FIELDS)}") from None
    except (IndexError, ValueError) as error:
        raise ValueError(f"FileLogger({field}={template!r}): not a path template ({error}); name fields as in "
                         "'{run_name}/logs-rank{rank}.jsonl'") from None


def _jsonable(value: Any) -> Any:
    """JSON fallback: numpy values as Python numbers or lists, anything else as its ``str``."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, (set, frozenset)):
        return list(value)
    return str(value)
