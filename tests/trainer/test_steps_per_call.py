"""steps_per_call=K: K batches per compiled call, the same parameters and every batch's metrics logged."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.algorithms import EMA, LabelSmoothing
from composerjax.loggers import InMemoryLogger

X = np.random.default_rng(0).normal(size=(80, 6)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def make(steps_per_call: int = 1, duration: str = "3ep", **kwargs) -> tuple[Trainer, InMemoryLogger]:
    memory = InMemoryLogger()
    rngs = nnx.Rngs(0)
    model = ComposerClassifier(nnx.Sequential(nnx.Linear(6, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 2, rngs=rngs)), 2)
    trainer = Trainer(model, ArrayLoader((X, Y), batch_size=8, seed=1), duration, optax.adam(1e-2),  # 10 batches/epoch
                      algorithms=[LabelSmoothing(0.1), EMA(half_life="3ba")], loggers=[memory], log_interval=1,
                      steps_per_call=steps_per_call, progress_bar=False, run_summary=False, **kwargs)
    return trainer, memory


def state_leaves(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state))]


def test_grouped_steps_equal_per_step_training_and_log_every_batch():
    single, single_log = make(1)
    single.fit()
    grouped, grouped_log = make(4)
    grouped.fit()
    assert grouped.state.timestamp.batch == single.state.timestamp.batch == 30
    for a, b in zip(state_leaves(single), state_leaves(grouped)):
        np.testing.assert_array_equal(a, b)
    steps = [step for step, _ in grouped_log.data["loss/train/total"]]
    assert steps == list(range(1, 31))
    np.testing.assert_allclose([v for _, v in grouped_log.data["loss/train/total"]],
                               [v for _, v in single_log.data["loss/train/total"]], rtol=1e-6)
    # The first batch runs alone (EMA starts at its BATCH_END); then groups of 4 wherever 4 fit in the epoch.
    kinds = [(record.kind, record.batch_shapes[0][0]) for record in grouped.state.compiled_steps]
    assert kinds == [("train", 8), ("train", 4)]  # the single step (batch of 8), the stacked call (4 batches)
    batches = [t.batch for t in grouped.engine.trace_log if t.traced and t.name == "EMA"]
    assert batches == list(range(30))  # the trace log still has every step


class Listener(Callback):
    def __init__(self) -> None:
        self.seen = []

    def batch_end(self, state, logger) -> None:
        self.seen.append(state.timestamp.batch)


def test_a_per_batch_listener_or_a_save_inside_the_group_keeps_steps_single(tmp_path):
    listener = Listener()
    trainer, _ = make(4, "1ep", callbacks=[listener])
    trainer.fit()
    assert listener.seen == list(range(1, 11))
    assert [r.batch_shapes[0][0] for r in trainer.state.compiled_steps] == [8]  # never grouped
    saving, _ = make(4, "1ep", save_folder=str(tmp_path), save_interval="3ba")
    saving.fit()
    saving.close()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3, 6, 9, 10]
    with pytest.raises(ValueError, match="steps_per_call=0"):
        make(0)
