"""The hot path never waits for the device: nothing is read from it or waited for while training.

Two checks that cover for each other:

* Counting. JAX's transfer guard does not fire for CPU arrays, so the ``host_syncs`` fixture counts
  the Python entry points through which host code reads or waits on a device array:
  ``ArrayImpl._value`` (``float()``, ``int()``, ``bool()``, ``.tolist()``, f-strings and
  ``jax.device_get`` go through it) and ``ArrayImpl.block_until_ready`` / ``batched_block_until_ready``
  (``jax.block_until_ready`` of one array or of a tree, ``array.block_until_ready()``).
  ``test_the_counters_see_each_way_to_read_or_wait`` pins those routes, so a JAX upgrade that
  moves one fails here instead of blinding the counters.
* Running ahead. On CPU, ``np.asarray(array)`` and ``array.item()`` read through the buffer protocol
  in C++, which no Python hook sees. So a train step is made slow on the device (a chain of matmuls)
  and the test checks that the host has queued every step before the device has finished the first:
  a wait of any kind, by any route, on any step's result would have let the first one finish.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax._src import array as jax_array
from jax._src.lib import xla_client

from composerjax import Algorithm, ArrayLoader, Callback, ComposerClassifier, Event, Trainer
from composerjax.algorithms import EMA, GradientClipping, LabelSmoothing, MixUp
from composerjax.loggers import InMemoryLogger
from composerjax.step.runner import StepRunner


@pytest.fixture
def host_syncs(monkeypatch):
    """``(reads, waits, counting)``: while ``counting[0]`` is a function, each device array read on the
    host appends what it returns to ``reads``, and each wait for one to ``waits`` (``None`` stops counting)."""
    reads: list = []
    waits: list = []
    counting = [None]
    value = jax_array.ArrayImpl._value
    block = jax_array.ArrayImpl.block_until_ready
    batched = xla_client.batched_block_until_ready

    def note(into):
        if counting[0] is not None:
            into.append(counting[0]())

    def counted_value(self):
        note(reads)
        return value.fget(self)

    def counted_block(self):
        note(waits)
        return block(self)

    def counted_batched(arrays):
        note(waits)
        return batched(arrays)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted_value))
    monkeypatch.setattr(jax_array.ArrayImpl, "block_until_ready", counted_block)
    monkeypatch.setattr(xla_client, "batched_block_until_ready", counted_batched)
    return reads, waits, counting


def make_trainer(loggers=(), log_interval=10, algorithms=(), callbacks=()):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), num_classes=2),
                   ArrayLoader((x, y), batch_size=8, seed=0), "0ba", optax.adam(1e-2),
                   algorithms=[LabelSmoothing(0.1), MixUp(0.2), EMA(half_life="4ba"), GradientClipping(),
                               *algorithms],
                   callbacks=list(callbacks), loggers=list(loggers), log_interval=log_interval, progress_bar=False,
                   run_summary=False)


READS = {
    "float()": lambda x: float(x[0]),
    "int()": lambda x: int(x[1]),
    "bool()": lambda x: bool(x[0] > 0),
    ".tolist()": lambda x: x.tolist(),
    "f-string": lambda x: f"{x[0]:.3f}",
    "jax.device_get": jax.device_get,
}
WAITS = {
    "jax.block_until_ready(array)": jax.block_until_ready,
    "array.block_until_ready()": lambda x: x.block_until_ready(),
    "jax.block_until_ready(tree)": lambda x: jax.block_until_ready({"a": x, "b": x + 1}),
}


@pytest.mark.parametrize("kind,route", [("read", name) for name in READS] + [("wait", name) for name in WAITS])
def test_the_counters_see_each_way_to_read_or_wait(host_syncs, kind, route):
    reads, waits, counting = host_syncs
    x = jnp.arange(4.0) * 2  # a fresh array: nothing cached on the host yet
    counting[0] = lambda: route
    (READS if kind == "read" else WAITS)[route](x)
    counting[0] = None
    assert (reads, waits) == (([route], []) if kind == "read" else ([], [route]))


def test_training_neither_reads_nor_waits_on_the_device(host_syncs):
    reads, waits, counting = host_syncs
    trainer = make_trainer()
    trainer.fit("2ba")  # compile outside the count
    counting[0] = lambda: trainer.state.timestamp.batch
    trainer.fit("12ba")
    counting[0] = None
    assert trainer.state.timestamp.batch == 14
    assert reads == []
    assert waits == []


def test_logged_values_are_read_once_per_interval_not_per_step(host_syncs):
    reads, _, counting = host_syncs
    memory = InMemoryLogger()
    trainer = make_trainer([memory], log_interval=5)
    trainer.fit("2ba")
    counting[0] = lambda: trainer.state.timestamp.batch
    trainer.fit("18ba")  # to batch 20
    counting[0] = None
    assert [step for step, _ in memory.data["loss/train/total"]] == list(range(1, 21))  # every batch logged
    # ...but read in a few bursts: when 2 * log_interval steps are queued (the older half, long
    # finished), and what is left at the end of fit; never right after the step that made it.
    assert sorted(set(reads)) == [11, 16, 20]
    assert len(reads) == 18


class DeviceWork(Algorithm):
    """Makes every train step slow on the device, not on the host: a chain of matmuls in a step metric."""

    events = frozenset({Event.AFTER_TRAIN_BATCH})

    def match(self, event, state):
        return event == Event.AFTER_TRAIN_BATCH

    def apply(self, event, state, logger):
        m = jnp.full((384, 384), 1e-3, jnp.float32) + 1e-6 * state.loss
        state.step_metrics["device_work"] = jax.lax.fori_loop(0, 24, lambda _, m: jnp.tanh(m @ m), m)[0, 0]


class QueuedSteps(Callback):
    """At each BATCH_END (the step was just queued): which of the losses queued so far are ready."""

    def __init__(self) -> None:
        self.losses: list = []
        self.ready: list[list[bool]] = []

    def batch_end(self, state, logger) -> None:
        self.losses.append(state.loss)
        self.ready.append([loss.is_ready() for loss in self.losses])  # asks; never waits


@pytest.fixture(scope="module")
def slow_steps():
    queued = QueuedSteps()
    trainer = make_trainer(algorithms=[DeviceWork()], callbacks=[queued])
    trainer.fit("2ba")  # compile
    jax.block_until_ready(trainer.state.train_state)
    return trainer, queued


def queue_steps(trainer: Trainer, queued: QueuedSteps, steps: int = 8) -> list[bool]:
    """Train ``steps`` batches; return which of their losses were ready when the last one was queued."""
    queued.losses.clear()
    queued.ready.clear()
    trainer.fit(f"{steps}ba")
    ready = queued.ready[-1]
    # Wait for the losses themselves: each output buffer of a step becomes ready on its own event, so
    # the train state being ready does not mean, at that same instant, that the loss is (seen under load).
    jax.block_until_ready((trainer.state.train_state, queued.losses))
    assert len(ready) == steps
    assert all(loss.is_ready() for loss in queued.losses)  # readiness is visible to the probe
    return ready


def test_the_host_queues_every_step_before_the_device_finishes_the_first(slow_steps):
    ready = queue_steps(*slow_steps)
    assert not ready[0], (f"when the last step was queued the first was already done ({ready}): the train loop "
                          "waited for the device")


@pytest.mark.parametrize("wait", [jax.block_until_ready, np.asarray, lambda loss: loss.item()],
                         ids=["block_until_ready", "np.asarray", "item"])
def test_the_run_ahead_check_sees_a_wait_after_every_step(slow_steps, monkeypatch, wait):
    """The check above fails for a loop that waits, even by a route the counters cannot see."""
    train_batch = StepRunner.train_batch

    def train_batch_then_wait(self, batch, placed=None, plan=None):
        samples, loss, metrics = train_batch(self, batch, placed, plan)
        wait(loss)
        return samples, loss, metrics

    monkeypatch.setattr(StepRunner, "train_batch", train_batch_then_wait)
    assert all(queue_steps(*slow_steps))
