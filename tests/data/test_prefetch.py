"""DevicePrefetcher: the same batches in the same order, the position after each one taken, the loader put back."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from composerjax.data import ArrayLoader, DevicePrefetcher, GrainLoader


def array_loader() -> ArrayLoader:
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    return ArrayLoader((x, np.arange(20)), batch_size=4, shuffle=True, seed=3)


def test_threaded_batches_and_positions_equal_plain_iteration():
    plain = array_loader()
    expected = []
    for batch in plain:
        expected.append((batch, plain.state_dict()))
    loader = array_loader()
    prefetcher = DevicePrefetcher(loader, place=lambda batch: ("placed", batch), depth=2, start_thread=True)
    taken = []
    for item in prefetcher:
        taken.append(item)
        assert prefetcher.position() == expected[len(taken) - 1][1]  # not the loader's own: it reads ahead
    assert prefetcher.threaded and len(taken) == len(expected) == 5
    for item, (batch, position) in zip(taken, expected):
        for got, want in zip(item.host, batch):
            np.testing.assert_array_equal(got, want)
        assert item.device[0] == "placed" and item.device[1] is item.host
        assert item.position == position


def test_close_puts_the_loader_back_after_the_last_batch_taken():
    loader = array_loader()
    fifth_taken = threading.Event()

    def place(batch):  # the thread places each batch it took; the fifth is the one it then waits to queue
        if loader.state_dict()["batch_in_epoch"] == 5:
            fifth_taken.set()
        return batch

    prefetcher = DevicePrefetcher(loader, place=place, depth=2, start_thread=True)
    first, second = next(prefetcher), next(prefetcher)
    # The thread queues batches 3 and 4 and waits with batch 5: the loader is 3 batches further, however
    # long the thread takes to get there (the event, not a clock, says when it has).
    assert fifth_taken.wait(300)  # a hang guard only
    assert loader.state_dict()["batch_in_epoch"] == 5
    prefetcher.close()
    assert loader.state_dict() == {"epoch": 0, "batch_in_epoch": 2, "seed": 3}
    rest = [batch for batch in loader]  # continues with batch 3 of the epoch
    plain = [batch for batch in array_loader()]
    np.testing.assert_array_equal(first.host[0], plain[0][0])
    np.testing.assert_array_equal(second.host[0], plain[1][0])
    assert len(rest) == 3
    for got, want in zip(rest, plain[2:]):
        np.testing.assert_array_equal(got[0], want[0])


def test_a_grain_loader_read_ahead_resumes_exactly():
    source = np.arange(30, dtype=np.int64)
    loader = GrainLoader(source, batch_size=3, shuffle=True, seed=1)
    every = [batch.tolist() for batch in GrainLoader(source, batch_size=3, shuffle=True, seed=1)]
    prefetcher = DevicePrefetcher(loader, place=lambda batch: batch, depth=2, start_thread=True)
    taken = [next(prefetcher).host.tolist() for _ in range(4)]
    saved = prefetcher.position()
    prefetcher.close()
    resumed = GrainLoader(source, batch_size=3, shuffle=True, seed=1)
    resumed.load_state_dict(saved)
    assert taken + [batch.tolist() for batch in resumed] == every


class Clock:
    """Readings ``step`` seconds apart: the probe reads it before and after each batch, so a batch costs ``step``."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def batches(count: int = 6) -> list[np.ndarray]:
    return [np.full((2,), index) for index in range(count)]


def test_the_thread_starts_only_when_a_batch_costs_more_than_the_threshold():
    """The decision is a function of the probe's readings alone: the same readings, the same choice on any machine."""
    fast = DevicePrefetcher(batches(), place=lambda batch: batch, threshold_s=2e-3, probe=3, clock=Clock(2.0**-10))
    assert [int(item.host[0]) for item in fast] == list(range(6))
    assert not fast.threaded and fast._timings == [2.0**-10] * 3  # 0.98 ms
    slow = DevicePrefetcher(batches(), place=lambda batch: batch, threshold_s=2e-3, probe=3, clock=Clock(2.0**-8))
    assert [int(item.host[0]) for item in slow] == list(range(6))
    assert slow.threaded and slow._timings == [2.0**-8] * 3  # 3.9 ms
    assert slow.position() is None  # a plain iterable keeps no position


def test_a_failing_loader_raises_at_its_batch_after_the_good_ones():
    def batches():
        yield np.zeros(2)
        yield np.ones(2)
        raise RuntimeError("record 17 is corrupt")

    class Loader:
        def __iter__(self):
            return batches()

    prefetcher = DevicePrefetcher(Loader(), place=lambda batch: batch, start_thread=True)
    assert next(prefetcher).host[0] == 0 and next(prefetcher).host[0] == 1
    with pytest.raises(RuntimeError, match="record 17 is corrupt"):
        next(prefetcher)


def test_depth_must_be_a_positive_count():
    with pytest.raises(ValueError, match="depth=0: expected a positive number of batches"):
        DevicePrefetcher(array_loader(), place=lambda batch: batch, depth=0)
