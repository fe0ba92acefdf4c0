"""Continuing a run's JSON-lines record (``metrics.jsonl``, ``traces.jsonl``) when it resumes from a checkpoint.

A resumed run trains again every batch after its checkpoint. So that each batch is recorded
once, :func:`continue_jsonl` keeps what earlier processes wrote up to and including the
checkpoint's batch, drops the records of later batches (they are written again), and ends the
file with one resume marker, ``{"resumed_from": "<checkpoint>", "batch": N}``, after which the
resumed process appends. The file is rewritten atomically (a temporary file renamed over it), so a
crash while rewriting leaves it as it was. Readers skip marker lines (:func:`is_resume_marker`).

Example:
    >>> import json, os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
    >>> with open(path, "w") as file:
    ...     file.writelines(json.dumps({"step": step, "loss": 1.0}) + "\\n" for step in (1, 2, 3))
    >>> continue_jsonl(path, "/ckpt/ep0-ba2", 2)
    1
    >>> [json.loads(line) for line in open(path)][1:]
    [{'step': 2, 'loss': 1.0}, {'resumed_from': '/ckpt/ep0-ba2', 'batch': 2}]
"""

from __future__ import annotations

import json
import os
from typing import Any

from composerjax.core.event import Event

__all__ = ["RESUMED_FROM", "continue_jsonl", "is_resume_marker", "kept_on_resume", "replace_file", "resume_marker"]

#: The key that makes a line a resume marker.
RESUMED_FROM = "resumed_from"

# Host events that lead up to a batch's step: their traces carry the count of batches done before
# it, so a trace of batch N at one of them belongs to batch N + 1 (as the traced events' do).
_BEFORE_STEP = frozenset(event.value for event in (
    Event.ITERATION_START, Event.EPOCH_START, Event.BEFORE_DATALOADER, Event.AFTER_DATALOADER, Event.BATCH_START))


def resume_marker(checkpoint: str, batch: int) -> dict[str, Any]:
    """The marker line's object: the run continues from ``checkpoint``, saved after batch ``batch``.

    Example:
        >>> resume_marker("/ckpt/ep0-ba40", 40)
        {'resumed_from': '/ckpt/ep0-ba40', 'batch': 40}
    """
    return {RESUMED_FROM: checkpoint, "batch": int(batch)}


def is_resume_marker(record: Any) -> bool:
    """Whether a parsed JSON line is a resume marker (not a metrics row or a trace).

    Example:
        >>> is_resume_marker({"resumed_from": "/ckpt/ep0-ba40", "batch": 40}), is_resume_marker({"step": 3})
        (True, False)
    """
    return isinstance(record, dict) and RESUMED_FROM in record


def kept_on_resume(record: Any, batch: int) -> bool:
    """Whether a record stays when the run resumes from the checkpoint of batch ``batch``.

    Dropped: metrics rows of a later ``step``; traces (``{"event", "batch", "traced", ...}``, or
    the FileLogger's ``{"step", "traces": [...]}``) of a later batch, or of batch ``batch`` at a
    traced event or a host event leading up to the next step (those count the batch before
    theirs); markers of a later resume. Kept: everything else, rows without a step included.

    Example:
        >>> kept_on_resume({"step": 40, "loss": 0.5}, 40), kept_on_resume({"step": 41, "loss": 0.5}, 40)
        (True, False)
        >>> kept_on_resume({"event": "batch_start", "batch": 40, "traced": False}, 40)
        False
    """
    if not isinstance(record, dict):
        return True
    if RESUMED_FROM in record:
        return not _number(record.get("batch")) or record["batch"] <= batch
    traces = record.get("traces")
    trace = traces[0] if isinstance(traces, list) and traces and isinstance(traces[0], dict) else record
    at = trace.get("batch") if "event" in trace else record.get("step")
    if not _number(at):
        return True
    if at != batch or "event" not in trace:
        return at <= batch
    return not trace.get("traced") and str(trace["event"]).lower() not in _BEFORE_STEP


def continue_jsonl(path: str | os.PathLike[str], checkpoint: str, batch: int) -> int:
    """Cut ``path`` back to the records of batches up to ``batch`` and end it with a resume marker.

    A missing file is created holding the marker alone. A last line cut short (a process killed
    while writing it) is dropped; other lines that are not JSON are kept as they are.

    Args:
        path: the JSON-lines file.
        checkpoint: the checkpoint the run resumes from (its folder), written into the marker.
        batch: the checkpoint's batch.

    Returns:
        How many lines were dropped.

    Raises:
        OSError: the file cannot be read or replaced; it is then unchanged.
    """
    path = os.fspath(path)
    lines: list[str] = []
    if os.path.exists(path):
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines(keepends=True)
    kept = []
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if index == len(lines) - 1 and not line.endswith("\n"):
                continue  # torn: the process died while writing it
            kept.append(line)
            continue
        if kept_on_resume(record, batch):
            kept.append(line if line.endswith("\n") else line + "\n")
    kept.append(json.dumps(resume_marker(checkpoint, batch)) + "\n")
    replace_file(path, "".join(kept))
    return len([line for line in lines if line.strip()]) - (len(kept) - 1)


def replace_file(path: str, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it: the file is old or new, never half.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "a.jsonl")
        >>> replace_file(path, "{}\\n"); open(path).read()
        '{}\\n'
    """
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
