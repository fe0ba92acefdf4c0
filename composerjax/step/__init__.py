"""Building and caching the compiled train/eval/predict steps; traced events run here."""

from composerjax.step.builder import StepBuilder, merge_model, split_model
from composerjax.step.view import StepView, traced_view

__all__ = ["StepBuilder", "StepView", "merge_model", "split_model", "traced_view"]
