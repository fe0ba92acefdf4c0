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
    # 'auto' on a host-bound step, told that 30 batches repay a group's compile.
    always = AutoStepsPerCall(target_s=1.0, max_count=4, min_remaining=0)
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


def test_auto_groups_a_host_bound_run_bit_identically():
    """A tiny model's step is microseconds of device work: 'auto' groups it by 32; the trained values do not change."""
    auto, single = long_run("auto"), long_run(1)
    chosen = auto.state.run_summary["steps_per_call"]
    record = next(record for record in auto.state.compiled_steps if record.kind == "train")
    assert chosen["chosen"] == 32, chosen
    assert chosen["flops"] == record.flops > 0 and chosen["bytes_accessed"] == record.bytes_accessed > 0
    assert chosen["estimated_step_ms"] == round(max(record.flops / 1e11, record.bytes_accessed / 2e10) * 1e3, 6)
    assert "the host bounds it; 32 steps fill a call" in chosen["reason"]
    assert any(record.batch_shapes[0][0] == 32 for record in auto.state.compiled_steps)
    assert auto.state.timestamp.batch == single.state.timestamp.batch == 160
    for a, b in zip(leaves(single), leaves(auto)):
        np.testing.assert_array_equal(a, b)


def test_auto_decides_the_same_on_a_busy_machine(monkeypatch):
    """No clock goes into the choice: a host whose every step seems to take a second decides exactly as a quiet one."""
    quiet = long_run("auto").state.run_summary["steps_per_call"]
    ticks = iter(range(10**9))
    monkeypatch.setattr(time, "perf_counter", lambda: float(next(ticks)))  # every reading a second later
    busy = long_run("auto").state.run_summary["steps_per_call"]
    assert busy == quiet and quiet["chosen"] == 32


def test_auto_groups_with_the_default_progress_bar_and_run_summary(capsys):
    """The built-ins a new user gets see each batch after the call: they do not keep the run per step."""
    trainer = long_run("auto", progress_bar=True, run_summary=True)
    chosen = trainer.state.run_summary["steps_per_call"]["chosen"]
    assert chosen == 32 and trainer.grouping_blocked_by == []
    assert any(record.batch_shapes[0][0] == chosen for record in trainer.state.compiled_steps)
    assert trainer.state.timestamp.batch == 160
    assert "steps_per_call='auto': 32 per call (a step's compiled cost is about" in capsys.readouterr().out


def test_auto_keeps_a_short_run_per_step():
    """30 batches cannot repay compiling a group: one compile, one batch per call."""
    trainer, _ = train(device_prefetch=2, steps_per_call="auto")
    chosen = trainer.state.run_summary["steps_per_call"]
    assert chosen["chosen"] == 1 and chosen["reason"].startswith("29 batches left: fewer than 2048")
    assert trainer.compile_count == 1


def test_choose_groups_by_the_power_of_two_that_fills_the_target_when_the_host_bounds_the_step():
    auto = AutoStepsPerCall(target_s=4e-3, max_count=32, max_step_s=1e-3, host_step_s=1e-4, min_remaining=2048)
    # A step of 2e5 FLOPs is 2 us on CPU: the 0.1 ms host floor sizes the call, 4 ms / 0.1 ms -> 32 (the cap).
    assert auto.choose(flops=2e5, bytes_accessed=1e5, platform="cpu", remaining=10_000)[0] == 32
    # 2e7 FLOPs: 0.2 ms -> 16 steps fill 3.2 ms; 32 would be 6.4 ms.
    assert auto.choose(flops=2e7, bytes_accessed=1e5, platform="cpu", remaining=10_000)[0] == 16
    # The bytes bound it: 1.6e7 bytes at 2e10 B/s is 0.8 ms -> 4 steps (3.2 ms).
    assert auto.choose(flops=1e3, bytes_accessed=1.6e7, platform="cpu", remaining=10_000)[0] == 4
    # Over 1 ms of device work: the device bounds the step, no group (the medium MLP: 4.2e8 FLOPs).
    count, reason = auto.choose(flops=4.2e8, bytes_accessed=4.2e7, platform="cpu", remaining=10**6)
    assert count == 1 and reason.endswith("over 1 ms, the device bounds it")
    # 3 ms on CPU is 3e11 FLOPs on a GPU's rate: the same cost is small there.
    assert auto.choose(flops=3e8, bytes_accessed=0, platform="gpu", remaining=10**6)[0] == 32
    # Too few batches left to repay one more compile; a platform or a step without cost analysis.
    assert auto.choose(flops=2e5, bytes_accessed=1e5, platform="cpu", remaining=2047) == (
        1, "2047 batches left: fewer than 2048 do not repay compiling a group")
    assert auto.choose(flops=None, bytes_accessed=None, platform="cpu", remaining=10**6) == (
        1, "no cost analysis of the step on cpu")
    assert auto.choose(flops=2e5, bytes_accessed=1e5, platform="metal", remaining=10**6)[0] == 1
    assert AutoStepsPerCall(rates={"metal": (1e12, 1e11)}).choose(2e5, 1e5, "metal", 10**6)[0] == 32


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
