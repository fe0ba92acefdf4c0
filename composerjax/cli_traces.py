"""``composerjax traces``: which algorithms and callbacks ran at each event of a run, and where two runs differ.

It reads ``RUN_DIR/traces.jsonl``, written by the ``TraceRecorder`` callback (one
:class:`~composerjax.core.trace.Trace` per line), and prints per event, in lifecycle order, the
algorithms in the order they ran and the callbacks that record their actions, labelled
``callback``, with their run counts, kind, batches, exit codes and host time. ``--diff OTHER_RUN``
prints only the differences and answers with its exit status, as ``diff`` does: 0 the runs are
the same, 1 they differ, 2 an error.

Example::

    composerjax traces runs/digits-speedup
    composerjax traces runs/digits-speedup --diff runs/digits-baseline   # exit status 1: they differ
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from typing import Any

from composerjax.cli_common import HelpFormatter, UsageError, add_debug
from composerjax.cli_run import TRACES_FILE, read_jsonl, run_file

__all__ = ["add_traces", "traces_command"]

_TRACES_EXIT_STATUSES = """exit statuses:
  0    success; with --diff: the two runs are the same (same algorithms and callbacks at the same
       events, in the same order, as often)
  1    with --diff: the runs differ; without it: an unexpected error (one line; --debug shows the
       traceback)
  2    bad input: a missing or unreadable run folder or file, a line that is not a trace; with
       --diff, also any unexpected error (as diff(1): 0 same, 1 different, 2 trouble)"""


def add_traces(subparsers: Any) -> None:
    """Declare ``composerjax traces`` and its arguments on the command line's ``subparsers``."""
    parser = subparsers.add_parser(
        "traces",
        help="which algorithms and callbacks ran at each event, in what order, how often",
        description=(
            "Summarise RUN_DIR/traces.jsonl (written by the composerjax.callbacks.trace_recorder.TraceRecorder "
            "callback): for each event, in lifecycle order, the algorithms that ran there in the order they were "
            "applied, and the callbacks that record their actions (the trainer's EvalRunner and CheckpointSaver, "
            "any callback with trace_actions = True), labelled 'callback'; how many times, whether inside the "
            "compiled step (traced) or on the host, the batches they ran at, the exit codes their apply returned "
            "and the total host time they took. With --diff, show only where two runs differ: algorithms or "
            "callbacks present at an event in one run and not the other, a different order, different run counts; "
            "the exit status then says whether they differ, as diff's does."
        ),
        epilog=_TRACES_EXIT_STATUSES + "\n\nexamples:\n  composerjax traces runs/digits-speedup\n"
                                       "  composerjax traces runs/digits-speedup --diff runs/digits-baseline",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run folder holding traces.jsonl (or the file itself)")
    parser.add_argument("--diff", metavar="OTHER_RUN",
                        help="another run folder (or traces.jsonl) to compare against; exit status 0 when the runs "
                             "are the same, 1 when they differ, 2 on an error")
    add_debug(parser)
    parser.set_defaults(handler=traces_command)


@dataclass
class _AlgorithmRuns:
    """What one algorithm (or one callback that records its actions) did at one event over a run."""

    name: str
    first_seen: int
    kind: str = "algorithm"  # Trace.kind: 'algorithm' or 'callback'
    runs: int = 0
    orders: dict[int, int] = field(default_factory=dict)  # position -> how often
    traced: set[bool] = field(default_factory=set)
    seconds: float = 0.0
    batches: list[int] = field(default_factory=list)
    exit_codes: dict[Any, int] = field(default_factory=dict)  # Trace.exit_code (None left out) -> how often

    @property
    def position(self) -> tuple[int, int]:
        """Where it usually ran among the event's algorithms: its most frequent order, then first seen."""
        usual = max(self.orders.items(), key=lambda item: (item[1], -item[0]))[0] if self.orders else 0
        return usual, self.first_seen

    @property
    def is_callback(self) -> bool:
        return self.kind == "callback"

    @property
    def label(self) -> str:
        """Its name, with ``(callback)`` after a callback's."""
        return f"{self.name} (callback)" if self.is_callback else self.name


def traces_command(args: argparse.Namespace) -> int:
    """``composerjax traces RUN_DIR [--diff OTHER_RUN]``: with --diff, 0 the same, 1 different, 2 an error."""
    if args.diff is not None:
        args.unexpected_error_status = 2  # as diff(1): 1 means "they differ", so trouble of any kind is 2
    run = _summarise_traces(read_jsonl(run_file(args.run_dir, TRACES_FILE, "traces")))
    if args.diff is None:
        print(_format_traces(args.run_dir, run))
        return 0
    other = _summarise_traces(read_jsonl(run_file(args.diff, TRACES_FILE, "traces")))
    differences = _trace_differences(run, other)
    print(_format_trace_diff(args.run_dir, args.diff, differences))
    return 1 if differences else 0


def _summarise_traces(records: list[tuple[str, int, dict[str, Any]]]) -> dict[str, dict[str, _AlgorithmRuns]]:
    """``{event: {name: runs}}`` from traces.jsonl records; events and names in first-seen order."""
    events: dict[str, dict[str, _AlgorithmRuns]] = {}
    for index, (path, line, record) in enumerate(records):
        try:
            name, event = str(record["name"]), str(record["event"]).upper()
        except KeyError as missing:
            raise UsageError(f"{path}:{line}: a trace needs 'name' and 'event'; {missing} is missing") from None
        if record.get("run") is False:
            continue
        algorithms = events.setdefault(event, {})
        runs = algorithms.get(name) or algorithms.setdefault(name, _AlgorithmRuns(name, index))
        if record.get("kind") == "callback":
            runs.kind = "callback"
        runs.runs += 1
        order = record.get("order")
        if isinstance(order, int):
            runs.orders[order] = runs.orders.get(order, 0) + 1
        runs.traced.add(bool(record.get("traced", False)))
        if isinstance(record.get("duration_s"), (int, float)):
            runs.seconds += float(record["duration_s"])
        if isinstance(record.get("batch"), int):
            runs.batches.append(record["batch"])
        code = record.get("exit_code")
        if code is not None:
            code = code if isinstance(code, (int, str)) and not isinstance(code, bool) else json.dumps(code)
            runs.exit_codes[code] = runs.exit_codes.get(code, 0) + 1
    return {event: events[event] for event in sorted(events, key=_event_rank)}


def _event_rank(event: str) -> tuple[int, str]:
    """Lifecycle position of an event name (unknown names last, alphabetically)."""
    from composerjax.core.event import Event

    try:
        return list(Event).index(Event(event.lower())), event
    except ValueError:
        return len(Event), event


def _in_order(algorithms: dict[str, _AlgorithmRuns]) -> list[_AlgorithmRuns]:
    return sorted(algorithms.values(), key=lambda runs: runs.position)


def _kind(runs: _AlgorithmRuns) -> str:
    if runs.is_callback:
        return "callback"
    return "/".join(name for flag, name in ((False, "host"), (True, "traced")) if flag in runs.traced)


def _exit_codes(runs: _AlgorithmRuns) -> str:
    """The exit codes apply returned, each with how often: ``'7 (2 runs)'``; ``'-'`` when it returned none."""
    codes = sorted(runs.exit_codes.items(), key=lambda item: (not isinstance(item[0], int), str(item[0])))
    return ", ".join(f"{code} ({count} run{'' if count == 1 else 's'})" for code, count in codes) or "-"


def _format_traces(label: str, events: dict[str, dict[str, _AlgorithmRuns]]) -> str:
    every = [runs for algorithms in events.values() for runs in algorithms.values()]
    algorithm_runs = sum(runs.runs for runs in every if not runs.is_callback)
    callback_runs = sum(runs.runs for runs in every if runs.is_callback)
    batches = [b for runs in every for b in runs.batches]
    span = f", batches {min(batches)}-{max(batches)}" if batches else ""
    callbacks = f" and {_count(callback_runs, 'callback action')}" if callback_runs else ""
    lines = [f"traces of {label}: {_count(algorithm_runs, 'algorithm run')}{callbacks} at "
             f"{_count(len(events), 'event')}{span}"]
    if not events:
        lines.append("  (no algorithm or callback ran)")
    host_seconds = {False: 0.0, True: 0.0}  # is_callback -> seconds
    for event, algorithms in events.items():
        rows = [("order", "name", "runs", "kind", "batches", "exit codes", "host time")]
        for runs in _in_order(algorithms):
            orders = ",".join(str(order) for order in sorted(runs.orders)) or "-"
            host = False in runs.traced
            host_seconds[runs.is_callback] += runs.seconds
            rows.append((orders, runs.name, str(runs.runs), _kind(runs), _batch_range(runs.batches),
                         _exit_codes(runs), _seconds(runs.seconds) if host else "-"))
        lines.append("")
        lines.append(event)
        lines.extend("  " + line for line in _table(rows))
    lines.append("")
    in_callbacks = f"; in callbacks: {_seconds(host_seconds[True])}" if callback_runs else ""
    lines.append(f"total host time in algorithms: {_seconds(host_seconds[False])}{in_callbacks}")
    return "\n".join(lines)


def _trace_differences(run: dict[str, dict[str, _AlgorithmRuns]],
                       other: dict[str, dict[str, _AlgorithmRuns]]) -> list[str]:
    """Where run A and run B differ, one line each; empty when they are the same."""
    lines = []
    for event in sorted(set(run) | set(other), key=_event_rank):
        ours, theirs = run.get(event, {}), other.get(event, {})
        only_ours = [runs.label for runs in _in_order(ours) if runs.name not in theirs]
        only_theirs = [runs.label for runs in _in_order(theirs) if runs.name not in ours]
        if only_ours:
            lines.append(f"{event}: only in A: {', '.join(only_ours)}")
        if only_theirs:
            lines.append(f"{event}: only in B: {', '.join(only_theirs)}")
        shared_ours = [runs.label for runs in _in_order(ours) if runs.name in theirs]
        shared_theirs = [runs.label for runs in _in_order(theirs) if runs.name in ours]
        if shared_ours != shared_theirs:
            lines.append(f"{event}: order differs: A runs {', '.join(shared_ours)}; "
                         f"B runs {', '.join(shared_theirs)}")
        for runs in _in_order(ours):
            if runs.name in theirs and runs.runs != theirs[runs.name].runs:
                lines.append(f"{event}: {runs.label} ran {runs.runs} times in A, {theirs[runs.name].runs} in B")
    return lines


def _format_trace_diff(label: str, other_label: str, differences: list[str]) -> str:
    lines = [f"differences between {label} (A) and {other_label} (B):"]
    lines.extend(f"  {line}" for line in differences)
    if not differences:
        lines.append("  none: the same algorithms and callbacks ran at the same events, in the same order, as often")
    return "\n".join(lines)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _batch_range(batches: list[int]) -> str:
    if not batches:
        return "-"
    low, high = min(batches), max(batches)
    return str(low) if low == high else f"{low}-{high}"


def _seconds(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.3g} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds * 1e6:.3g} us"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
