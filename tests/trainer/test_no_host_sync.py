"""The hot path never waits for the device: no device value is read on the host while training.

JAX's transfer guard does not fire for CPU arrays, so the test counts reads of ``ArrayImpl._value``
(the one place a device array becomes a host numpy array: ``float()``, ``.item()``, ``np.asarray``
and ``jax.device_get`` all go through it).
"""

from __future__ import annotations

import numpy as np
import optax
import pytest
from flax import nnx
from jax._src import array as jax_array

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms import EMA, GradientClipping, LabelSmoothing, MixUp
from composerjax.loggers import InMemoryLogger


@pytest.fixture
def host_reads(monkeypatch):
    """``(reads, counting)``: while ``counting[0]`` is a function, each device array read on the host
    appends what it returns (``None`` stops counting)."""
    reads: list = []
    counting = [None]
    original = jax_array.ArrayImpl._value

    def counted(self):
        if counting[0] is not None:
            reads.append(counting[0]())
        return original.fget(self)

    monkeypatch.setattr(jax_array.ArrayImpl, "_value", property(counted))
    return reads, counting


def make_trainer(loggers=(), log_interval=10):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), num_classes=2),
                   ArrayLoader((x, y), batch_size=8, seed=0), "0ba", optax.adam(1e-2),
                   algorithms=[LabelSmoothing(0.1), MixUp(0.2), EMA(half_life="4ba"), GradientClipping()],
                   loggers=list(loggers), log_interval=log_interval, progress_bar=False, run_summary=False)


def test_training_reads_nothing_from_the_device(host_reads):
    reads, counting = host_reads
    trainer = make_trainer()
    trainer.fit("2ba")  # compile outside the count
    counting[0] = lambda: trainer.state.timestamp.batch
    trainer.fit("12ba")
    counting[0] = None
    assert trainer.state.timestamp.batch == 14
    assert reads == []


def test_logged_values_are_read_once_per_interval_not_per_step(host_reads):
    reads, counting = host_reads
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
