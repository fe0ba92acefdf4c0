"""``composerjax explain`` walks the lifecycle fit walks: it agrees with a real run's trace log, and changes nothing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import optax
import pytest
from conftest import LM_RECIPE_OVERRIDES, prepare_example
from flax import nnx

from composerjax import ComposerClassifier, Trainer
from composerjax.algorithms import EMA, GradientClipping, LabelSmoothing
from composerjax.core import Algorithm, Event
from composerjax.data import ArrayLoader
from composerjax.explain import explain
from composerjax.loggers import InMemoryLogger
from composerjax.trainer import build_trainer
from composerjax.trainer.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# Each example recipe, shortened so the real run fits in a test; explain sees the same overrides.
SHORTENED = {
    "digits_baseline.yaml": ["max_duration=2ep", "data.batch_size=128"],
    "digits_speedup.yaml": ["max_duration=3ep", "data.batch_size=128", "algorithms[1].ema.half_life=5ba"],
    "gpt_pydoc.yaml": ["max_duration=24ba", "eval_interval=12ba"],
    "gpt2_stdlib.yaml": ["max_duration=2ba", "eval_interval=0", "save_folder=null", "autoresume=false",
                         "data.worker_count=0", *LM_RECIPE_OVERRIDES["gpt2_stdlib.yaml"]],
    "gpt2_small_stdlib.yaml": ["max_duration=2ba", "eval_interval=0", "save_folder=null", "autoresume=false",
                               *LM_RECIPE_OVERRIDES["gpt2_small_stdlib.yaml"], "data.worker_count=0"],
    "finetune_llama.yaml": ["max_duration=3ba", "eval_interval=3ba", "save_folder=null"],
}


def algorithm_events(trainer: Trainer) -> set[tuple[str, str]]:
    """(event, algorithm) for every algorithm trace of the run (callbacks' traces left out)."""
    names = {type(a).__name__ for a in trainer.state.algorithms}
    return {(t.event.name, t.name) for t in trainer.engine.trace_log if t.name.split("#")[0] in names}


def explained_events(explanation) -> set[tuple[str, str]]:
    return {(plan.event, name) for plan in explanation.events for name in plan.algorithms}


@pytest.mark.parametrize("recipe", sorted(SHORTENED))
def test_explain_agrees_with_the_trace_log_of_a_real_run(recipe, tmp_path, monkeypatch):
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(SHORTENED)  # every example recipe
    monkeypatch.chdir(tmp_path)
    prepare_example(recipe, tmp_path)
    overrides = [*SHORTENED[recipe], "progress_bar=false", "run_summary=false", "loggers=[]"]
    predicted = explain(load_config(str(EXAMPLES / recipe), overrides))
    trainer = build_trainer(load_config(str(EXAMPLES / recipe), overrides))
    trainer.fit()
    trainer.close()
    real = algorithm_events(trainer)
    assert bool(real) == (recipe != "digits_baseline.yaml")  # the baseline has no algorithm: both empty
    assert explained_events(predicted) == real
    if recipe == "digits_speedup.yaml":  # EMA swaps its weights in and out around every evaluation
        assert {("EVAL_START", "EMA"), ("EVAL_END", "EMA")} <= real


class CountingAlgorithm(Algorithm):
    """Matches at every host batch event; counts its applies."""

    events = frozenset({Event.BATCH_START, Event.BATCH_END, Event.EPOCH_END})

    def __init__(self) -> None:
        self.applied = 0

    def apply(self, event, state, logger):
        self.applied += 1


def small_trainer(tmp_path: Path, **kwargs) -> Trainer:
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), batch_size=16),
                   max_duration="2ep", optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False,
                   eval_dataloader=ArrayLoader((x, y), batch_size=32), run_dir=str(tmp_path / "run"), **kwargs)


def test_explain_accepts_a_constructed_trainer_and_changes_nothing(tmp_path):
    counting, memory = CountingAlgorithm(), InMemoryLogger()
    trainer = small_trainer(tmp_path, algorithms=[counting, LabelSmoothing(0.1), EMA(half_life="2ba")],
                            loggers=[memory])
    before = (trainer.state.timestamp, len(trainer.engine.trace_log), dict(memory.data), trainer.compile_count)
    explanation = explain(trainer)
    assert counting.applied == 0  # no host apply: only match was asked
    after = (trainer.state.timestamp, len(trainer.engine.trace_log), dict(memory.data), trainer.compile_count)
    assert after == before
    assert not (tmp_path / "run").exists()
    trainer.fit()  # and the trainer trains as if explain had never run
    assert explained_events(explanation) == algorithm_events(trainer)
    assert {("EVAL_START", "EMA"), ("EVAL_END", "EMA"), ("BEFORE_LOSS", "LabelSmoothing")} <= algorithm_events(trainer)
    assert counting.applied == 8 + 8 + 2
    trainer.close()


def test_explain_of_a_recipe_writes_no_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    explain(load_config(str(EXAMPLES / "digits_speedup.yaml"), ["max_duration=1ep"]))
    assert os.listdir(tmp_path) == []


def test_the_order_explain_gives_is_the_order_the_first_batch_ran(tmp_path):
    algorithms = [EMA(half_life="2ba"), GradientClipping("norm", 1.0), LabelSmoothing(0.1)]
    trainer = small_trainer(tmp_path, algorithms=algorithms)
    explanation = explain(trainer)
    trainer.fit()
    first_batch: dict[str, list[str]] = {}
    for trace in trainer.engine.trace_log:
        if trace.batch == 0 and trace.traced:
            first_batch.setdefault(trace.event.name, []).append(trace.name)
    planned = {plan.event: plan.algorithms for plan in explanation.events if plan.traced}
    assert first_batch and {event: planned[event] for event in first_batch} == first_batch
    trainer.close()
