"""The traced view of the State that algorithms see inside a compiled step."""

from __future__ import annotations

from typing import Any

from composerjax.core.state import State

__all__ = ["StepView", "traced_view"]


class StepView(State):
    """A State-shaped object for one trace of a step: traced fields are plain attributes here.

    It starts as a shallow copy of the host State, so everything an algorithm reads that is not
    traced (hyperparameters, timestamp, run name) is the host value, while whatever it sets lands
    on the view and is dropped when tracing ends: no tracer can leak into the host State.

    Besides the State fields, a view offers ``forward(params, batch)`` and
    ``loss_and_grad(params, batch)`` for algorithms that need another pass through the model
    inside the step (SAM, selective backprop).
    """

    # Plain class attributes shadow State's host properties, so they can be set per view.
    model: Any = None
    batch: Any = None
    step: Any = None
    progress: Any = None
    step_rng: Any = None
    params: Any = None
    algorithm_state: Any = None

    def forward(self, params: Any, batch: Any) -> Any:  # replaced per trace
        """Outputs of the model with ``params`` on ``batch`` (no events run)."""
        raise RuntimeError("StepView.forward is only available inside a compiled step")

    def loss_and_grad(self, params: Any, batch: Any) -> tuple[Any, Any]:  # replaced per trace
        """``(loss, grads)`` of the model with ``params`` on ``batch`` (no events run)."""
        raise RuntimeError("StepView.loss_and_grad is only available inside a compiled step")


def traced_view(state: State, **traced: Any) -> StepView:
    """Return a view of ``state`` with the ``traced`` fields set (batch, model, step, ...)."""
    view = object.__new__(StepView)
    view.__dict__.update(state.__dict__)
    view.__dict__.update(traced)
    view.__dict__["algorithm_state"] = dict(traced.get("algorithm_state", {}))
    view.__dict__["step_metrics"] = {}
    return view
