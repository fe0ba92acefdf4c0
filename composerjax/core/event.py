"""The training lifecycle: every point at which algorithms and callbacks can run."""

from __future__ import annotations

import difflib
from enum import Enum

__all__ = ["Event"]


class Event(str, Enum):
    """A point in the training, evaluation or prediction lifecycle, in the order they occur.

    Values are the lower-case names, so ``Event('before_loss')``, ``Event('BEFORE_LOSS')`` and
    ``Event.BEFORE_LOSS`` are the same member. Events from ``BEFORE_TRAIN_BATCH`` to
    ``AFTER_OPTIMIZER_STEP`` (and the forward events of eval and predict) are *traced*: they run
    inside the compiled step, where the state holds tracers.

    The members and their order are Composer's, plus one: ``AFTER_OPTIMIZER_STEP``, a traced hook
    right after the optimizer update, for algorithms that need the updated parameters inside the
    step (EMA, SWA). As in Composer, ``AFTER_TRAIN_BATCH`` runs once per batch after the gradients
    of every microbatch are accumulated and *before* the optimizer update: ``state.grads`` is
    writable there and is what the optimizer applies. ``EVAL_BEFORE_ALL``/``EVAL_AFTER_ALL``
    bracket the evaluations run during ``fit``; ``EVAL_STANDALONE_START``/``EVAL_STANDALONE_END``
    bracket a ``Trainer.eval()`` called by the user.

    Example:
        >>> Event('before_loss') is Event.BEFORE_LOSS
        True
        >>> Event.AFTER_BACKWARD.is_traced, Event.BATCH_END.is_traced
        (True, False)
    """

    INIT = "init"
    BEFORE_LOAD = "before_load"
    AFTER_LOAD = "after_load"
    FIT_START = "fit_start"
    ITERATION_START = "iteration_start"
    EPOCH_START = "epoch_start"
    BEFORE_DATALOADER = "before_dataloader"
    AFTER_DATALOADER = "after_dataloader"
    BATCH_START = "batch_start"
    BEFORE_TRAIN_BATCH = "before_train_batch"
    BEFORE_FORWARD = "before_forward"
    AFTER_FORWARD = "after_forward"
    BEFORE_LOSS = "before_loss"
    AFTER_LOSS = "after_loss"
    BEFORE_BACKWARD = "before_backward"
    AFTER_BACKWARD = "after_backward"
    AFTER_TRAIN_BATCH = "after_train_batch"
    AFTER_OPTIMIZER_STEP = "after_optimizer_step"
    BATCH_END = "batch_end"
    BATCH_CHECKPOINT = "batch_checkpoint"
    EPOCH_END = "epoch_end"
    EPOCH_CHECKPOINT = "epoch_checkpoint"
    ITERATION_END = "iteration_end"
    ITERATION_CHECKPOINT = "iteration_checkpoint"
    FIT_END = "fit_end"
    EVAL_BEFORE_ALL = "eval_before_all"
    EVAL_START = "eval_start"
    EVAL_BATCH_START = "eval_batch_start"
    EVAL_BEFORE_FORWARD = "eval_before_forward"
    EVAL_AFTER_FORWARD = "eval_after_forward"
    EVAL_BATCH_END = "eval_batch_end"
    EVAL_END = "eval_end"
    EVAL_AFTER_ALL = "eval_after_all"
    EVAL_STANDALONE_START = "eval_standalone_start"
    EVAL_STANDALONE_END = "eval_standalone_end"
    PREDICT_START = "predict_start"
    PREDICT_BATCH_START = "predict_batch_start"
    PREDICT_BEFORE_FORWARD = "predict_before_forward"
    PREDICT_AFTER_FORWARD = "predict_after_forward"
    PREDICT_BATCH_END = "predict_batch_end"
    PREDICT_END = "predict_end"

    @classmethod
    def _missing_(cls, value: object) -> Event:
        if isinstance(value, str):
            lowered = value.strip().lower()
            for member in cls:
                if member.value == lowered:
                    return member
            close = difflib.get_close_matches(lowered, [m.value for m in cls], n=3, cutoff=0.5)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise ValueError(
                f"{value!r} is not a valid Event; expected one of the {len(cls)} lifecycle event "
                f"names such as 'before_loss' or 'BATCH_END'.{hint}"
            )
        raise ValueError(f"{value!r} is not a valid Event; expected an Event or its name as a string.")

    @property
    def is_before_event(self) -> bool:
        """Whether this event opens a before/after pair (``BEFORE_*``, ``*_START``)."""
        return self in _BEFORE_EVENTS

    @property
    def is_after_event(self) -> bool:
        """Whether this event closes a before/after pair (``AFTER_*``, ``*_END``)."""
        return self in _AFTER_EVENTS

    @property
    def canonical_name(self) -> str:
        """The name without its before/after prefix or start/end suffix (``'forward'`` for AFTER_FORWARD)."""
        # Both events of a pair share a name: EVAL_BEFORE_FORWARD and EVAL_AFTER_FORWARD -> 'eval_forward'.
        name = self.value.replace("before_", "").replace("after_", "")
        for suffix in ("_start", "_end"):
            if name.endswith(suffix):
                return name[: -len(suffix)]
        return name

    @property
    def is_predict(self) -> bool:
        """Whether this event belongs to the prediction loop."""
        return self.value.startswith("predict_")

    @property
    def is_eval(self) -> bool:
        """Whether this event belongs to the evaluation loop."""
        return self.value.startswith("eval_")

    @property
    def is_traced(self) -> bool:
        """Whether this event runs inside a compiled step (its state holds tracers)."""
        return self in TRACED_EVENTS


_ORDER = list(Event)
_BEFORE_EVENTS = frozenset(e for e in Event if "before_" in e.value or e.value.endswith("_start"))
_AFTER_EVENTS = frozenset(e for e in Event if "after_" in e.value or e.value.endswith("_end"))

#: Events of the train step, in the order the compiled step runs them.
TRAIN_STEP_EVENTS: tuple[Event, ...] = tuple(
    _ORDER[_ORDER.index(Event.BEFORE_TRAIN_BATCH) : _ORDER.index(Event.AFTER_OPTIMIZER_STEP) + 1]
)
#: Events of the eval step.
EVAL_STEP_EVENTS: tuple[Event, ...] = (Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD)
#: Events of the predict step.
PREDICT_STEP_EVENTS: tuple[Event, ...] = (Event.PREDICT_BEFORE_FORWARD, Event.PREDICT_AFTER_FORWARD)
TRACED_EVENTS: frozenset[Event] = frozenset(TRAIN_STEP_EVENTS + EVAL_STEP_EVENTS + PREDICT_STEP_EVENTS)
