"""Traces: the record of which algorithm ran at which event, in what order."""

from __future__ import annotations

from dataclasses import dataclass

from composerjax.core.event import Event

__all__ = ["Trace"]


@dataclass(slots=True)
class Trace:
    """One algorithm's run (or non-run) at one event.

    Attributes:
        name: the algorithm's class name (with a ``#k`` suffix for the k-th repeat in one event).
        event: the event.
        exit_code: what ``apply`` returned, ``None`` when it returned nothing or did not run.
        order: position among the algorithms that matched at this event (``None`` if not run).
        run: whether ``apply`` ran.
        traced: whether the event ran inside a compiled step.
        batch: the training batch index (``timestamp.batch``) when it ran.
        duration_s: wall time of ``apply`` on host events; ``None`` for traced events, whose work
            is fused into the compiled step.
        kind: ``'algorithm'``, or ``'callback'`` for a callback that records its actions
            (``Callback.trace_actions``: the trainer's checkpoint saves and evaluations).

    Example:
        >>> Trace('LabelSmoothing', Event.BEFORE_LOSS, run=True, order=0, traced=True).key
        'LabelSmoothing/BEFORE_LOSS'
    """

    name: str
    event: Event
    exit_code: int | None = None
    order: int | None = None
    run: bool = False
    traced: bool = False
    batch: int = 0
    duration_s: float | None = None
    kind: str = "algorithm"

    @property
    def key(self) -> str:
        """The key this trace has in ``run_event``'s result: ``'Name/EVENT'``."""
        return f"{self.name}/{self.event.name}"

    def to_dict(self) -> dict[str, object]:
        """A JSON-serialisable view of the trace."""
        return {
            "name": self.name,
            "event": self.event.value,
            "exit_code": self.exit_code,
            "order": self.order,
            "run": self.run,
            "traced": self.traced,
            "batch": self.batch,
            "duration_s": self.duration_s,
            "kind": self.kind,
        }
