"""The core API: events, time, state, algorithms, callbacks, traces, the engine and its passes."""

from composerjax.core.algorithm import Algorithm
from composerjax.core.callback import Callback
from composerjax.core.engine import Engine, Plan, UndeclaredEventWarning
from composerjax.core.evaluator import Evaluator, ensure_evaluators
from composerjax.core.event import Event
from composerjax.core.passes import (
    DEFAULT_PASSES,
    AlgorithmPass,
    set_filo_order,
    sort_run_first_and_last,
    warn_if_multiple_loss_interpolation,
)
from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp, TimeUnit, ensure_time
from composerjax.core.trace import Trace
from composerjax.core.train_state import TrainState

__all__ = [
    "Algorithm",
    "AlgorithmPass",
    "Callback",
    "DEFAULT_PASSES",
    "Engine",
    "Evaluator",
    "Event",
    "Plan",
    "State",
    "TrainState",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trace",
    "UndeclaredEventWarning",
    "ensure_evaluators",
    "ensure_time",
    "set_filo_order",
    "sort_run_first_and_last",
    "warn_if_multiple_loss_interpolation",
]
