"""Trace recorder: write the engine's traces as JSON lines and a timeline for chrome://tracing / Perfetto."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from composerjax import Engine, Event, Logger, LoggerDestination, State, Trace
from composerjax.loggers.jsonl_resume import continue_jsonl, replace_file
from composerjax.parallel.dist import is_process_zero

__all__ = ["TraceRecorder", "TRACES_FILE", "TIMELINE_FILE"]

#: One JSON object per trace (``Trace.to_dict()`` plus ``time_s``): what ``composerjax traces`` reads.
TRACES_FILE = "traces.jsonl"
#: The Chrome Trace Event Format timeline (chrome://tracing, https://ui.perfetto.dev).
TIMELINE_FILE = "trace.json"

# Host events that open and close a span on the training-loop track.
_OPENS = {
    Event.FIT_START: "fit",
    Event.EPOCH_START: "epoch",
    Event.BEFORE_DATALOADER: "dataloader",
    Event.BATCH_START: "train_step",
    Event.EVAL_START: "eval",
    Event.EVAL_BATCH_START: "eval_step",
    Event.PREDICT_START: "predict",
    Event.PREDICT_BATCH_START: "predict_step",
}
_CLOSES = {
    Event.FIT_END: "fit",
    Event.EPOCH_END: "epoch",
    Event.AFTER_DATALOADER: "dataloader",
    Event.BATCH_END: "train_step",
    Event.EVAL_END: "eval",
    Event.EVAL_BATCH_END: "eval_step",
    Event.PREDICT_END: "predict",
    Event.PREDICT_BATCH_END: "predict_step",
}
_STEPS = ("train_step", "eval_step", "predict_step")
# After these (the checkpoint saver has run) the new traces are appended to traces.jsonl.
_FLUSHES = frozenset({Event.BATCH_CHECKPOINT, Event.EPOCH_CHECKPOINT, Event.ITERATION_CHECKPOINT})

# Timeline tracks (Chrome "threads").
_LOOP, _ALGORITHMS, _COMPILES = 1, 2, 3
_TRACK_NAMES = {_LOOP: "training loop", _ALGORITHMS: "host algorithms", _COMPILES: "compiles"}


class TraceRecorder(LoggerDestination):
    """A callback that records which algorithms ran at which event, and a timeline of the run, into the run folder.

    Pass it in the Trainer's ``callbacks`` (a recipe: ``callbacks: [trace_recorder]``).

    Writes two files into ``path`` (default: ``state.run_dir``):

    - ``traces.jsonl``: one line per :class:`~composerjax.Trace` (``name``, ``event``, ``order``,
      ``traced``, ``batch``, ``duration_s``, ... and ``time_s``, when it was recorded), for
      ``composerjax traces RUN_DIR``. The first write replaces an earlier run's file; new traces
      are then appended at each checkpoint event (every batch), at ``FIT_END`` and at close, so a
      killed run keeps what it recorded. A run resuming from a checkpoint (``state.resumed_from``)
      instead continues the file: at ``AFTER_LOAD`` it keeps the traces up to the checkpoint's
      batch, drops the later ones (those batches run again) and adds a marker line
      ``{"resumed_from": "<checkpoint>", "batch": N}``
      (:func:`composerjax.loggers.jsonl_resume.continue_jsonl`).
    - ``trace.json``: a Chrome Trace Event Format timeline (``{"traceEvents": [...]}``, times in
      microseconds) for chrome://tracing or Perfetto. Track "training loop": ``fit``, ``epoch``,
      ``dataloader`` (waiting for a batch), ``train_step`` (dispatching one compiled step: the host
      time between ``BATCH_START`` and ``BATCH_END``; its args list the algorithms traced into that
      step), ``eval``/``eval_step`` and ``predict``/``predict_step``. Track "host algorithms": one
      span per host-event algorithm run, as long as its ``apply`` took. Track "compiles": one
      ``compile <kind> step`` span per compiled step variant (``state.compiled_steps``), inside the
      step that compiled it. Written at ``FIT_END`` and again at close; it covers this process only.

    The Trainer attaches the recorder to its engine, so it reads every trace from the engine's
    ``trace_log``: host algorithms, the algorithms traced into each compiled step, and the actions
    of callbacks that record them (``Callback.trace_actions``: the trainer's evaluations and
    checkpoint saves). It reads the log at each host event, so the log's size bound loses none.
    With an ``Engine`` of your own, call ``attach(engine)``. (Its base class is
    ``LoggerDestination`` so that an engine it is not attached to can hand it host traces through
    ``log_traces``; no trace is recorded twice.) Only process 0 writes files.

    Args:
        path: the folder for both files; ``None`` for the run folder (``state.run_dir``).

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.trace_recorder import TraceRecorder

        trainer = Trainer(model, loader, max_duration='1ep', algorithms=[...], callbacks=[TraceRecorder()])
        trainer.fit()   # writes runs/<run_name>/traces.jsonl and trace.json
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        if path is not None and not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path={path!r}: expected a folder path or None (the run folder)")
        self.path = None if path is None else os.fspath(path)
        self._engine: Engine | None = None
        self._last_polled: Trace | None = None
        self._origin: float | None = None
        self._traces: list[tuple[float, Trace]] = []
        self._trace_ids: set[int] = set()  # ids of the Trace objects held in _traces: dedupes both sources
        self._events: list[dict[str, Any]] = []
        self._open: dict[str, tuple[float, dict[str, Any]]] = {}
        self._step_first_trace = 0
        self._compiles_seen = 0
        self._run_name = "run"
        self._written = 0  # how many of _traces are in traces.jsonl
        self._continuing = False  # traces.jsonl holds this run's earlier lines: append, never replace

    # -- sources ---------------------------------------------------------------------------------
    def attach(self, engine: Engine) -> TraceRecorder:
        """Read traces from ``engine.trace_log`` too (traced events included); returns self."""
        if not hasattr(engine, "trace_log"):
            raise ValueError(f"attach(engine={engine!r}): expected an Engine (e.g. trainer.engine) with a trace_log")
        self._engine = engine
        self._last_polled = None
        return self

    def log_traces(self, traces: dict[str, Trace]) -> None:
        now = self._now()
        for trace in traces.values():
            self._record(now, trace)

    def _record(self, now: float, trace: Trace) -> None:
        if id(trace) not in self._trace_ids:
            self._trace_ids.add(id(trace))
            self._traces.append((now, trace))

    def _poll_engine(self, now: float) -> None:
        """Record the traces appended to the attached engine's trace_log since the last poll."""
        if self._engine is None:
            return
        trace_log = self._engine.trace_log
        new: list[Trace] = []
        for trace in reversed(trace_log):
            if trace is self._last_polled:
                break
            new.append(trace)
        for trace in reversed(new):
            self._record(now, trace)
        if trace_log:
            self._last_polled = trace_log[-1]

    def _now(self) -> float:
        now = time.perf_counter()
        if self._origin is None:
            self._origin = now
        return now

    # -- events ----------------------------------------------------------------------------------
    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event.is_traced:  # inside a step being traced: nothing to time
            return
        now = self._now()
        self._poll_engine(now)
        self._run_name = state.run_name
        name = _CLOSES.get(event)
        if name is not None:
            self._close_span(name, now, state)
        name = _OPENS.get(event)
        if name is not None:
            self._open[name] = (now, self._span_args(name, state))
            if name == "train_step":
                self._step_first_trace = len(self._traces)
        if event is Event.AFTER_LOAD and state.resumed_from is not None:
            self._continue(state)
        if event is Event.FIT_END:
            self._write(state)
        elif event in _FLUSHES:
            self._write_traces(state)

    def close(self, state: State, logger: Logger) -> None:
        self._poll_engine(self._now())
        if state is not None:
            self._write(state)

    def _span_args(self, name: str, state: State) -> dict[str, Any]:
        if name == "fit":
            return {}
        if name == "epoch":
            return {"epoch": state.timestamp.epoch.value}
        return {"batch": state.timestamp.batch.value}

    def _close_span(self, name: str, now: float, state: State) -> None:
        opened = self._open.pop(name, None)
        if opened is None:
            return
        start, args = opened
        duration = now - start
        if name == "train_step":
            # The trainer timed the dispatch itself (batch_wct): exact, without the callbacks' time.
            duration = state.timestamp.counts.batch_wct or duration
            traced = [trace.key for _, trace in self._traces[self._step_first_trace:] if trace.traced]
            if traced:
                args["algorithms"] = traced
        self._events.append(_span(name, "loop", _LOOP, start, duration, args))
        if name in _STEPS:
            self._add_compiles(start, state)

    def _add_compiles(self, start: float, state: State) -> None:
        compiled = state.compiled_steps
        for record in compiled[self._compiles_seen:]:
            # The step that compiled it started tracing and compiling as soon as it was dispatched.
            self._events.append(_span(f"compile {record.kind} step", "compile", _COMPILES, start,
                                      record.compile_seconds, record.to_dict()))
        self._compiles_seen = len(compiled)

    # -- output ----------------------------------------------------------------------------------
    def timeline(self) -> dict[str, Any]:
        """The Chrome Trace Event Format document written to ``trace.json``."""
        pid = jax.process_index()
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": self._run_name}}]
        events += [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": track}}
                   for tid, track in _TRACK_NAMES.items()]
        events += [{"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
                   for tid in _TRACK_NAMES]
        for event in self._events:
            events.append({**event, "pid": pid, "ts": self._micros(event["ts"])})
        for end, spans in self._host_algorithm_runs():
            # Algorithms recorded together ran back to back, the last one ending when they were recorded.
            for trace in reversed(spans):
                start = end - (trace.duration_s or 0.0)
                events.append({**_span(trace.key, trace.kind, _ALGORITHMS, start, trace.duration_s or 0.0, {
                    "event": trace.event.name, "batch": trace.batch, "order": trace.order,
                    "exit_code": trace.exit_code}), "pid": pid, "ts": self._micros(start)})
                end = start
        events.sort(key=lambda e: (e["ph"] != "M", e.get("ts", 0.0)))
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"run_name": self._run_name}}

    def _host_algorithm_runs(self) -> list[tuple[float, list[Trace]]]:
        groups: list[tuple[float, list[Trace]]] = []
        for recorded, trace in self._traces:
            if trace.traced or not trace.run:
                continue
            if groups and groups[-1][0] == recorded:
                groups[-1][1].append(trace)
            else:
                groups.append((recorded, [trace]))
        return groups

    def _micros(self, seconds: float) -> float:
        return round((seconds - (self._origin or 0.0)) * 1e6, 3)

    def _continue(self, state: State) -> None:
        """Resumed: cut traces.jsonl back to the checkpoint's batch and mark where this process continues it."""
        if not is_process_zero():
            return
        resumed = state.resumed_from
        continue_jsonl(os.path.join(self.path or state.run_dir, TRACES_FILE), resumed.checkpoint, resumed.batch)
        self._continuing = True

    def _write_traces(self, state: State) -> None:
        """Add the traces recorded since the last write to traces.jsonl (the first write replaces the file)."""
        if not is_process_zero() or (self._continuing and len(self._traces) == self._written):
            return
        lines = "".join(json.dumps({**trace.to_dict(), "time_s": round(recorded - (self._origin or 0.0), 6)}) + "\n"
                        for recorded, trace in self._traces[self._written:])
        path = os.path.join(self.path or state.run_dir, TRACES_FILE)
        if self._continuing:
            with open(path, "a", encoding="utf-8") as file:
                file.write(lines)
        else:
            replace_file(path, lines)
            self._continuing = True
        self._written = len(self._traces)

    def _write(self, state: State) -> None:
        if not is_process_zero():
            return
        self._write_traces(state)
        replace_file(os.path.join(self.path or state.run_dir, TIMELINE_FILE), json.dumps(self.timeline()))


def _span(name: str, category: str, track: int, start: float, duration: float, args: dict[str, Any]) -> dict[str, Any]:
    """A complete ("X") event; ``ts`` is still host seconds here and becomes microseconds when written."""
    return {"ph": "X", "name": name, "cat": category, "tid": track, "ts": start, "dur": round(duration * 1e6, 3),
            "args": args}
