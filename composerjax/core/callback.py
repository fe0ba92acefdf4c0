"""The Callback base class: observe the run at any event, without changing how it trains."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from composerjax.core.event import Event

if TYPE_CHECKING:
    from composerjax.core.logger import Logger
    from composerjax.core.state import State
    from composerjax.core.time import Timestamp

__all__ = ["Callback"]


class Callback:
    """Base class for callbacks: override the methods named after the events you care about.

    Callbacks run after the algorithms at every event (before them at ``INIT``). The engine calls
    only the methods a subclass overrides, so an event nobody listens to costs nothing. At traced
    events (inside the compiled step) a callback may only add arrays to ``state.step_metrics``;
    those come back from the step and reach loggers every ``log_interval`` batches.

    Example:
        >>> class CountBatches(Callback):
        ...     def __init__(self) -> None:
        ...         self.batches = 0
        ...     def batch_end(self, state, logger):
        ...         self.batches += 1
        ...     def state_dict(self):
        ...         return {"batches": self.batches}
        ...     def load_state_dict(self, state):
        ...         self.batches = state["batches"]
        >>> CountBatches().batches
        0
    """

    #: True when the per-batch handlers (``batch_start``, ``batch_end``, ``batch_checkpoint``, ...)
    #: may run after a grouped compiled call (``steps_per_call``), once per batch of the group with
    #: that batch's timestamp, instead of between two batches. A listener that leaves it False
    #: switches grouping off (``Trainer.grouping_blocked_by`` names it).
    accepts_grouped_batches: ClassVar[bool] = False

    #: True to have the engine record a :class:`~composerjax.core.trace.Trace` (with its duration)
    #: each time one of this callback's handlers returns True, i.e. did its job (a save, an eval).
    trace_actions: ClassVar[bool] = False

    def next_due(self, timestamp: Timestamp) -> int | None:
        """The batch count at which this callback next acts, if it acts on a batch schedule; else None.

        A grouped compiled call (``steps_per_call``) never runs past it, so the callback's
        ``batch_end`` / ``batch_checkpoint`` sees the state right after that batch.

        Example:
            >>> from composerjax.core.time import Timestamp
            >>> Callback().next_due(Timestamp()) is None
            True
        """
        del timestamp
        return None

    def fit_error(self, state: State, logger: Logger, error: BaseException) -> None:
        """Called when ``fit`` fails with ``error`` (not an event: no trace), before it propagates."""

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        """Dispatch ``event`` to the method of the same name; override to see every event."""
        getattr(self, event.value)(state, logger)

    def init(self, state: State, logger: Logger) -> None:
        """Called at ``Event.INIT``."""

    def before_load(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_LOAD``."""

    def after_load(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_LOAD``."""

    def fit_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.FIT_START``."""

    def iteration_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.ITERATION_START``."""

    def epoch_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EPOCH_START``."""

    def before_dataloader(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_DATALOADER``."""

    def after_dataloader(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_DATALOADER``."""

    def batch_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BATCH_START``."""

    def before_train_batch(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_TRAIN_BATCH``."""

    def before_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_FORWARD``."""

    def after_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_FORWARD``."""

    def before_loss(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_LOSS``."""

    def after_loss(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_LOSS``."""

    def before_backward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BEFORE_BACKWARD``."""

    def after_backward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_BACKWARD``."""

    def after_train_batch(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_TRAIN_BATCH`` (traced: the whole batch's gradients, before the update)."""

    def after_optimizer_step(self, state: State, logger: Logger) -> None:
        """Called at ``Event.AFTER_OPTIMIZER_STEP`` (traced: right after the update, new ``state.params``)."""

    def batch_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BATCH_END``."""

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        """Called at ``Event.BATCH_CHECKPOINT``."""

    def epoch_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EPOCH_END``."""

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EPOCH_CHECKPOINT``."""

    def iteration_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.ITERATION_END``."""

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        """Called at ``Event.ITERATION_CHECKPOINT``."""

    def fit_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.FIT_END``."""

    def eval_before_all(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_BEFORE_ALL``."""

    def eval_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_START``."""

    def eval_batch_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_BATCH_START``."""

    def eval_before_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_BEFORE_FORWARD``."""

    def eval_after_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_AFTER_FORWARD``."""

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_BATCH_END``."""

    def eval_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_END``."""

    def eval_after_all(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_AFTER_ALL``."""

    def eval_standalone_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_STANDALONE_START`` (a ``Trainer.eval()`` called by the user)."""

    def eval_standalone_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.EVAL_STANDALONE_END``."""

    def predict_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_START``."""

    def predict_batch_start(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_BATCH_START``."""

    def predict_before_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_BEFORE_FORWARD``."""

    def predict_after_forward(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_AFTER_FORWARD``."""

    def predict_batch_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_BATCH_END``."""

    def predict_end(self, state: State, logger: Logger) -> None:
        """Called at ``Event.PREDICT_END``."""

    def close(self, state: State, logger: Logger) -> None:
        """Release resources (files, threads). Called once by ``Engine.close``."""

    def post_close(self) -> None:
        """Called after every callback's ``close`` succeeded for this callback."""

    def state_dict(self) -> dict[str, Any]:
        """Host state to checkpoint."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""


#: The event methods a Callback may override, by event.
EVENT_METHODS: dict[Event, str] = {event: event.value for event in Event}


def overridden_events(callback: Callback) -> frozenset[Event]:
    """Return the events whose method ``callback``'s class overrides (all events if ``run_event`` is)."""
    cls = type(callback)
    if cls.run_event is not Callback.run_event:
        return frozenset(Event)
    return frozenset(e for e, m in EVENT_METHODS.items() if getattr(cls, m) is not getattr(Callback, m))
