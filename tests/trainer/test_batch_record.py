"""One route from the loader to the step: each batch travels as one record, with its device copy when prefetched."""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Callback, ComposerClassifier, Trainer
from composerjax.core.state import BatchRecord, State
from composerjax.step.runner import StepRunner

X = np.random.default_rng(0).normal(size=(64, 6)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)


def batches(sizes: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    starts = np.cumsum([0, *sizes])
    return [(X[a:b], Y[a:b]) for a, b in zip(starts[:-1], starts[1:])]


class SlowLoader:
    """A re-iterable loader whose batches take 3 ms each to produce: the prefetch thread starts."""

    def __init__(self, items: list) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self):
        for item in self.items:
            time.sleep(3e-3)
            yield item


class FlipLabels(Callback):
    """Replaces the batch on the host after the loader gave it (so any copy placed ahead is of the old batch)."""

    def after_dataloader(self, state, logger) -> None:
        x, y = state.batch
        state.batch = (x, 1 - y)


class Listens(Callback):
    """Listens at AFTER_DATALOADER without touching the batch."""

    def after_dataloader(self, state, logger) -> None:
        pass


def model() -> ComposerClassifier:
    return ComposerClassifier(nnx.Linear(6, 2, rngs=nnx.Rngs(0)), 2)


@pytest.fixture
def placed_copies(monkeypatch) -> list:
    """What each StepRunner.train_batch call got as the batch's device copy (None: none came with it)."""
    seen: list = []
    train_batch = StepRunner.train_batch

    def spy(self, batch, placed=None, plan=None):
        seen.append(None if placed is None else (jax.device_get(placed), batch))
        return train_batch(self, batch, placed, plan)

    monkeypatch.setattr(StepRunner, "train_batch", spy)
    return seen


def train(loader, callbacks=(), device_prefetch: int = 0, steps_per_call: int = 1, duration: str = "3ba") -> Trainer:
    trainer = Trainer(model(), loader, duration, optax.sgd(0.1), callbacks=list(callbacks), progress_bar=False,
                      run_summary=False, device_prefetch=device_prefetch, steps_per_call=steps_per_call)
    trainer.fit()
    trainer.close()
    return trainer


def params(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state.params))]


def test_state_batch_is_the_records_host_and_assigning_it_drops_the_device_copy():
    state = State(model=None)
    assert state.batch is None and state.batch_record == BatchRecord(None, None)
    state.batch_record = BatchRecord((1, 2), "on device")
    assert state.batch == (1, 2) and state.batch_record.device == "on device"
    state.batch_set_item(0, 5)  # a host change, as an algorithm at AFTER_DATALOADER makes it
    assert state.batch_record == BatchRecord((5, 2), None)
    state.batch = (7, 8)
    assert state.batch_record == BatchRecord((7, 8), None)


def test_a_prefetched_batch_reaches_the_step_with_its_own_device_copy(placed_copies):
    train(batches([8, 8, 8]), callbacks=[Listens()], device_prefetch=2)  # the probe places the first batches
    assert len(placed_copies) == 3 and all(copy is not None for copy in placed_copies)
    for (device, host) in placed_copies:
        assert all(np.array_equal(d, h) for d, h in zip(device, host))


def test_a_batch_replaced_on_the_host_trains_instead_of_its_prefetched_copy(placed_copies):
    flipped = train(batches([8, 8, 8]), callbacks=[FlipLabels()], device_prefetch=2)
    assert placed_copies == [None, None, None]  # the copies were of the loader's batches: dropped with them
    unprefetched = train(batches([8, 8, 8]), callbacks=[FlipLabels()], device_prefetch=0)
    unflipped = train(batches([8, 8, 8]), callbacks=[Listens()], device_prefetch=2)
    assert all(np.array_equal(a, b) for a, b in zip(params(flipped), params(unprefetched)))
    assert not all(np.array_equal(a, b) for a, b in zip(params(flipped), params(unflipped)))


def test_a_ragged_group_runs_batch_by_batch_with_the_device_copies_the_prefetch_thread_made(placed_copies):
    # Batch 0 runs alone (no batch seen yet to plan a group with); batches 1-4 make a ragged group, run one
    # step each from the records the group fetched; 5-7 are too few for a group.
    sizes = [8, 8, 8, 4, 8, 8, 8, 8]
    grouped = train(SlowLoader(batches(sizes)), device_prefetch=2, steps_per_call=4, duration="8ba")
    assert grouped.state.timestamp.counts.batch == 8
    assert [copy is not None for copy in placed_copies] == [True] * 8
    assert [len(host[0]) for _, host in placed_copies] == sizes
    del placed_copies[:]
    single = train(batches(sizes), device_prefetch=0, steps_per_call=1, duration="8ba")
    assert len(placed_copies) == 8
    assert all(np.array_equal(a, b) for a, b in zip(params(grouped), params(single)))
