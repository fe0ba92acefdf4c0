"""The fast defaults change speed only: prefetching and steps_per_call='auto' train bit for bit as per-step training."""

from __future__ import annotations

import time

import grain
import jax
import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.algorithms import EMA, MixUp
from composerjax.data import GrainLoader
from composerjax.loggers import InMemoryLogger
from composerjax.trainer.auto_grouping import AutoStepsPerCall

X = np.random.default_rng(0).normal(size=(80, 6)).astype(np.float32)
Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)


class Records:
    def __len__(self) -> int:
        return len(X)

    def __getitem__(self, index: int):
        return X[index], Y[index]


class HostWork(grain.transforms.Map):
    """Real per-record host work (0.4 ms), so producing a batch of 8 costs about 3 ms: the prefetch thread starts."""

    def map(self, record):
        time.sleep(4e-4)
        return record


def model() -> ComposerClassifier:
    rngs = nnx.Rngs(0)
    return ComposerClassifier(nnx.Sequential(nnx.Linear(6, 16, rngs=rngs), nnx.relu, nnx.Linear(16, 2, rngs=rngs)), 2)


def train(device_prefetch: int, steps_per_call, auto: AutoStepsPerCall | None = None) -> tuple[Trainer, InMemoryLogger]:
    memory = InMemoryLogger()
    loader = GrainLoader(Records(), batch_size=8, shuffle=True, seed=1, operations=[HostWork()])  # 10 batches/epoch
    trainer = Trainer(model(), loader, "3ep", optax.adam(1e-2), algorithms=[MixUp(alpha=0.4), EMA(half_life="3ba")],
                      loggers=[memory], log_interval=1, progress_bar=False, run_summary=False,
                      device_prefetch=device_prefetch, steps_per_call=steps_per_call)
    if auto is not None:
        trainer.auto_grouping = auto
    trainer.fit()
    trainer.close()
    return trainer, memory


def leaves(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state))]


def test_prefetch_on_off_and_auto_grouping_train_bit_identical_with_a_stochastic_recipe():
    plain, plain_log = train(device_prefetch=0, steps_per_call=1)
    prefetched, prefetched_log = train(device_prefetch=2, steps_per_call=1)
    # 'auto' as it decides on a host-bound run, told here that grouping always pays (the decision is timing).
    always = AutoStepsPerCall(window=3, target_s=1.0, max_count=4, host_share=0.0, payback=0.0)
    grouped, grouped_log = train(device_prefetch=2, steps_per_call="auto", auto=always)
    assert plain.prefetch_threaded is None and prefetched.prefetch_threaded and grouped.prefetch_threaded
    assert grouped.state.run_summary["steps_per_call"]["chosen"] == 4
    assert [record.batch_shapes[0][0] for record in grouped.state.compiled_steps if record.kind == "train"] == [8, 4]
    assert plain.state.timestamp.batch == prefetched.state.timestamp.batch == grouped.state.timestamp.batch == 30
    reference = leaves(plain)
    assert len(reference) > 10  # parameters, Adam's moments, the EMA average, the clock
    for other in (prefetched, grouped):
        for a, b in zip(reference, leaves(other)):
            np.testing.assert_array_equal(a, b)
    losses = plain_log.data["loss/train/total"]
    assert len(losses) == 30
    assert prefetched_log.data["loss/train/total"] == losses == grouped_log.data["loss/train/total"]


class StopAt(Callback):
    """Stop fit() after batch ``at`` (grouped calls end there: ``next_due``)."""

    accepts_grouped_batches = True

    def __init__(self, at: int) -> None:
        self.at = at

    def next_due(self, timestamp):
        return self.at if timestamp.counts.batch < self.at else None

    def batch_end(self, state, logger) -> None:
        if state.timestamp.counts.batch == self.at:
            state.stop_training()


def long_run(steps_per_call, **kwargs) -> Trainer:
    x = np.random.default_rng(1).normal(size=(4096, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    kwargs = {"progress_bar": False, "run_summary": False, **kwargs}
    trainer = Trainer(model(), ArrayLoader((x, y), batch_size=8, shuffle=True, seed=2), "1000000ba",
                      optax.adam(1e-3), callbacks=[StopAt(160)], steps_per_call=steps_per_call, **kwargs)
    trainer.fit()
    return trainer


def test_auto_measures_a_host_bound_run_and_groups_it_bit_identically():
    """A tiny model's step is mostly dispatch: 'auto' groups it, and the trained values do not change."""
    auto, single = long_run("auto"), long_run(1)
    chosen = auto.state.run_summary["steps_per_call"]
    assert chosen["host_share"] >= 0.5 and chosen["chosen"] >= 2, chosen
    assert any(record.batch_shapes[0][0] == chosen["chosen"] for record in auto.state.compiled_steps)
    assert auto.state.timestamp.batch == single.state.timestamp.batch == 160
    for a, b in zip(leaves(single), leaves(auto)):
        np.testing.assert_array_equal(a, b)


def test_auto_groups_with_the_default_progress_bar_and_run_summary(capsys):
    """The built-ins a new user gets see each batch after the call: they do not keep the run per step."""
    trainer = long_run("auto", progress_bar=True, run_summary=True)
    chosen = trainer.state.run_summary["steps_per_call"]["chosen"]
    assert chosen >= 2 and trainer.grouping_blocked_by == []
    assert any(record.batch_shapes[0][0] == chosen for record in trainer.state.compiled_steps)
    assert trainer.state.timestamp.batch == 160
    assert f"steps_per_call='auto': {chosen} per call" in capsys.readouterr().out


def test_auto_keeps_a_short_run_per_step():
    """30 batches cannot repay compiling a group: one compile, one batch per call."""
    trainer, _ = train(device_prefetch=2, steps_per_call="auto")
    assert trainer.state.run_summary["steps_per_call"]["chosen"] == 1
    assert trainer.compile_count == 1


def test_choose_groups_by_the_power_of_two_that_fills_the_target_when_it_pays():
    auto = AutoStepsPerCall(target_s=4e-3, max_count=32, host_share=0.5, payback=2.0)
    assert auto.choose(seconds_per_step=2e-4, host_share=0.9, remaining=10_000, compile_seconds=0.5) == 16
    assert auto.choose(seconds_per_step=1e-5, host_share=0.9, remaining=10**6, compile_seconds=0.5) == 32  # the cap
    assert auto.choose(seconds_per_step=2e-4, host_share=0.4, remaining=10**6, compile_seconds=0.5) == 1  # device-bound
    # 100 batches save 100 * 0.9 * 2e-4 * 15/16 = 0.017 s: less than twice a 0.5 s compile.
    assert auto.choose(seconds_per_step=2e-4, host_share=0.9, remaining=100, compile_seconds=0.5) == 1
    assert auto.choose(seconds_per_step=3e-3, host_share=0.9, remaining=10**6, compile_seconds=0.5) == 1  # K=2 > 4 ms


def conv_run(steps_per_call) -> Trainer:
    rngs = nnx.Rngs(0)
    conv = nnx.Sequential(nnx.Conv(1, 4, (3, 3), rngs=rngs), nnx.relu, lambda x: x.reshape(x.shape[0], -1),
                          nnx.Linear(4 * 6 * 6, 2, rngs=rngs))
    x = np.random.default_rng(3).normal(size=(64, 6, 6, 1)).astype(np.float32)
    y = (x[:, 0, 0, 0] > 0).astype(np.int32)
    trainer = Trainer(ComposerClassifier(conv, 2), ArrayLoader((x, y), batch_size=8, shuffle=True, seed=2), "2ep",
                      optax.adam(1e-2), progress_bar=False, run_summary=False, steps_per_call=steps_per_call)
    trainer.fit()
    return trainer


def test_a_convolving_step_stays_a_plain_program_and_auto_keeps_it_per_step():
    """XLA:CPU runs a convolution inside a loop on a slow path: such a step is not looped, nor grouped by 'auto'."""
    auto, single, grouped = conv_run("auto"), conv_run(1), conv_run(4)
    assert auto.state.run_summary["steps_per_call"]["chosen"] == 1
    assert "convolves" in auto.state.run_summary["steps_per_call"]["reason"]
    assert all(record.batch_shapes[0][0] == 8 for record in auto.state.compiled_steps)
    builder = single.runner.builder
    (plan, step), = builder._train.items()
    assert builder.convolving == {plan}
    batch = next(iter(ArrayLoader((np.zeros((8, 6, 6, 1), np.float32), np.zeros(8, np.int32)), batch_size=8)))
    assert "while" not in step.lower(single.state.train_state, batch).as_text()  # no loop around the step
    stacked = jax.tree.map(lambda leaf: np.stack([leaf, leaf]), batch)
    assert "while" in builder._looped(plan, 2).lower(single.state.train_state, stacked).as_text()  # a group loops
    for a, b in zip(leaves(single), leaves(auto)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(leaves(single), leaves(grouped)):  # a group is still a loop: equal up to rounding
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
