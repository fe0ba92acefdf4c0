"""DevicePrefetcher: the next batches loaded and placed on the devices while the current step runs.

A background thread takes batches from the loader, records the loader's position right after each
one, places it on the devices with the step's batch sharding and keeps up to ``depth`` of them in a
queue. The trainer consumes them in order, so results do not change; a checkpoint records the
position after the last batch the trainer took (not the loader's own, which is ahead), and closing
the prefetcher puts the loader back there, so a resume or the next ``fit`` continues exactly.

The thread only pays when producing a batch is real work (grain operations, decoding,
augmentation, a large host-to-device copy). A batch sliced from memory in microseconds is cheaper
to hand to the step directly: on a 2-core CPU a Python thread that passes such batches along costs
the train loop several times what it saves (the two threads take turns holding the interpreter).
So the prefetcher first takes a few batches in the train loop, timing how long each takes to
produce and place, and starts the thread only when that exceeds ``threshold_s``.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

__all__ = ["DevicePrefetcher", "Prefetched"]

_END = object()


class Prefetched(NamedTuple):
    """A batch as the loader gave it, on the devices (None: the step places it), and the loader's position after it.

    The fit loop makes each one a :class:`~composerjax.core.state.BatchRecord` (``host``, ``device``).
    """

    host: Any
    device: Any
    position: Any


class _Failure(NamedTuple):
    error: BaseException


class DevicePrefetcher:
    """Iterate ``loader``'s batches, loaded and placed ahead of the step by a thread when that pays.

    Args:
        loader: the train loader (an ``ArrayLoader``, ``GrainLoader`` or any re-iterable); one
            prefetcher covers one pass, ``iter(loader)``.
        place: puts a host batch on the devices (the trainer hands in
            :func:`composerjax.parallel.sharding.batch_placer`'s function for its mesh).
        depth: batches kept ready in the queue (at least 1).
        threshold_s: start the thread when producing and placing a batch takes longer than this.
        probe: how many batches are timed in the train loop before deciding.
        start_thread: None decides by timing; True starts the thread at once; False never does.
        clock: the clock the probe reads (seconds); tests hand in their own readings.

    Example:
        >>> import numpy as np
        >>> from composerjax.data import ArrayLoader
        >>> loader = ArrayLoader(np.arange(8), batch_size=2, shuffle=False)
        >>> batches = DevicePrefetcher(loader, place=lambda batch: batch, depth=2, start_thread=True)
        >>> [item.host.tolist() for item in batches]
        [[0, 1], [2, 3], [4, 5], [6, 7]]
        >>> batches.threaded, batches.position()
        (True, {'epoch': 0, 'batch_in_epoch': 4, 'seed': 0})
    """

    def __init__(self, loader: Any, place: Callable[[Any], Any], depth: int = 2, threshold_s: float = 1e-3,
                 probe: int = 3, start_thread: bool | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth={depth!r}: expected a positive number of batches")
        self.loader, self.place, self.depth = loader, place, depth
        self.threshold_s, self.probe, self.clock = threshold_s, probe, clock
        self._iterator: Iterator[Any] = iter(loader)
        self._positioned = hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")
        self._position: Any = None  # after the last batch handed out (threaded mode)
        self._queue: queue.Queue[Any] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._timings: list[float] = []
        self._decided = start_thread is not None
        self.threaded = False
        if start_thread:
            self._start()

    # -- iteration -------------------------------------------------------------------------------
    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> Prefetched:
        if self._queue is not None:
            item = self._queue.get()
            if item is _END:
                self._queue.put(_END)  # every later next() ends too
                raise StopIteration
            if isinstance(item, _Failure):
                raise item.error
            self._position = item.position
            return item
        if self._decided:
            return Prefetched(next(self._iterator), None, None)
        # Probing: produce and place in the train loop, timed; the placed batch is used.
        start = self.clock()
        host = next(self._iterator)
        device = self._placed(host)
        self._timings.append(self.clock() - start)
        if len(self._timings) >= self.probe:
            self._decided = True
            if min(self._timings) > self.threshold_s:
                self._start()
        return Prefetched(host, device, None)

    def _start(self) -> None:
        self._decided = self.threaded = True
        if self._positioned:
            self._position = self.loader.state_dict()
        self._queue = queue.Queue(self.depth)
        self._thread = threading.Thread(target=self._produce, name="composerjax-prefetch", daemon=True)
        self._thread.start()

    def _produce(self) -> None:
        """The thread: take, record the position, place, queue; until the pass ends, fails or is closed."""
        assert self._queue is not None
        while not self._stop.is_set():
            try:
                host = next(self._iterator)
                position = self.loader.state_dict() if self._positioned else None
                item: Any = Prefetched(host, self._placed(host), position)
            except StopIteration:
                item = _END
            except BaseException as error:  # handed to the train loop, raised at the batch it belongs to
                item = _Failure(error)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.05)
                    break
                except queue.Full:
                    continue
            if item is _END or isinstance(item, _Failure):
                return

    def _placed(self, host: Any) -> Any:
        """``host`` on the devices, or None for a batch that cannot be placed: the step then says what is wrong."""
        try:
            return self.place(host)
        except Exception:
            return None

    @property
    def decided(self) -> bool:
        """Whether the thread question is settled (given at start, or timed on the first batches)."""
        return self._decided

    @property
    def inline(self) -> bool:
        """Decided against the thread: the loader's own iterator (``source``) serves the rest of the pass as well."""
        return self._decided and not self.threaded

    @property
    def source(self) -> Iterator[Any]:
        """The loader's iterator this prefetcher reads."""
        return self._iterator

    # -- position and shutdown ---------------------------------------------------------------------
    def position(self) -> Any:
        """The loader's position right after the last batch handed out (None for a loader without one)."""
        if not self._positioned:
            return None
        return self._position if self.threaded else self.loader.state_dict()

    def close(self) -> None:
        """Stop the thread and put the loader back right after the last batch handed out. Idempotent."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self._positioned and self._position is not None:
            close = getattr(self.loader, "close", None)
            if callable(close):  # a GrainLoader stops the workers of the pass the thread read ahead in
                close()
            self.loader.load_state_dict(self._position)
