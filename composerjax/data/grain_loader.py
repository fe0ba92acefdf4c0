"""GrainLoader: checkpointable, per-process sharded batches from a grain random-access data source."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from composerjax.data.array_loader import _check_int

__all__ = ["GrainLoader"]

_STATE_KEYS = ("epoch", "batch_in_epoch", "seed", "iterator")


def _import_grain() -> Any:
    # grain is an optional extra: importing composerjax must not need it, only building a GrainLoader.
    try:
        import grain
    except ImportError as error:
        raise ImportError("GrainLoader needs grain; install it with `pip install 'composerjax[grain]'`") from error
    return grain


def _allow_unparsed_absl_flags() -> None:
    # grain's worker processes read an absl flag; outside `absl.app.run` flags are never parsed and
    # that read raises UnparsedFlagAccessError, so accept the defaults as the parsed values.
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


#: The default read threads and read-ahead buffer (records) of a GrainLoader: see ``read_options``.
READ_THREADS, READ_BUFFER = 16, 32


class GrainLoader:
    """Iterate over batches of a grain data source with ``grain.DataLoader``, resumable mid-epoch.

    Each epoch ``e`` is one ``grain.DataLoader`` pass (``IndexSampler(num_epochs=1)``) whose
    shuffle seed depends only on ``(seed, e)``; :meth:`state_dict` records the epoch and grain's
    own iterator state, so a loader restored with :meth:`load_state_dict` yields exactly the
    batches the uninterrupted run would have yielded, including with ``worker_count > 0``.

    With ``shard_by_process`` every process builds the same loader: the records are shuffled
    globally, and process ``p`` of ``P`` takes records ``p, p + P, ...`` of the epoch's order
    (``len(data_source) % P`` records are dropped), so each global batch is split across
    processes and every process yields the same number of batches.

    With ``worker_count > 0`` each worker process batches its own strided share of this process's
    records and batches come round-robin from the workers: the batches differ from those of
    ``worker_count=0`` and ``len(loader)`` accounts for one partial (or dropped) batch per worker.
    Workers need absl flags parsed; when they are not, this loader marks them parsed (defaults).

    Iterating mutates the loader's position; use one live iterator at a time.

    Args:
        data_source: A random-access source: anything with ``__len__`` and ``__getitem__`` whose
            items are records (pytrees of numpy arrays), e.g. a ``grain.sources`` source, a
            numpy array, or a ``grain.MapDataset`` (without ``filter``, so every index is a record).
        batch_size: Records per batch on THIS process.
        shuffle: Shuffle every epoch with a seed derived from ``(seed, epoch)``.
        seed: Non-negative seed for the per-epoch shuffles and the rngs of ``RandomMap`` operations.
        drop_remainder: Drop the last, incomplete batch (of every worker when ``worker_count > 0``).
        operations: ``grain.transforms.Map``/``RandomMap``/``TfRandomMap`` applied to each record
            before batching. Operations that change the number of records (``Filter``,
            ``FlatMap``, ``Batch``) are refused: ``len(loader)`` must be exact for the trainer.
        worker_count: Worker processes for reading and transforming; 0 reads in this process.
        read_options: ``grain.ReadOptions`` for the threads that read records (in this process, or
            in each worker). None (the default) is grain's 16 threads with a buffer of 32 records
            instead of grain's 500: grain spends time in proportion to that buffer on every record
            (on 2 cores a batch of 64 records took 2.7 to 3.8 times as long with 500, measured by
            benchmarks/fast_defaults.py). The options change speed only, never which records a
            batch holds.
        shard_by_process: Split records across JAX processes (``jax.process_index()`` of
            ``jax.process_count()``); if False every process reads every record.
        pad_remainder: With ``drop_remainder=False``, fill an incomplete batch up to ``batch_size``
            with records made of these values: a tuple with one fill value per field of a record
            (``(0, -100)`` for ``(inputs, targets)``: targets a loss and its metrics ignore), so every
            batch has one shape and an eval step compiles once. None (the default) leaves it short.

    Example:
        >>> import numpy as np
        >>> loader = GrainLoader(np.arange(10), batch_size=4, shuffle=False)
        >>> len(loader)
        2
        >>> [batch.tolist() for batch in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> loader.state_dict()
        {'epoch': 1, 'batch_in_epoch': 0, 'seed': 0, 'iterator': None}
    """

    def __init__(
        self,
        data_source: Any,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_remainder: bool = True,
        operations: Sequence[Any] = (),
        worker_count: int = 0,
        read_options: Any = None,
        shard_by_process: bool = True,
        pad_remainder: tuple[Any, ...] | None = None,
    ) -> None:
        grain = _import_grain()
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._seed = _check_int("seed", seed, 0)
        self._worker_count = _check_int("worker_count", worker_count, 0)
        self._shuffle = bool(shuffle)
        self._drop_remainder = bool(drop_remainder)
        if pad_remainder is not None and (self._drop_remainder or not isinstance(pad_remainder, tuple)):
            raise ValueError(f"pad_remainder={pad_remainder!r}: expected a tuple of fill values, one per field of a "
                             "record, with drop_remainder=False (there is no incomplete batch to fill otherwise), "
                             "or None")
        self._pad_remainder = pad_remainder
        self._data_source = self._check_source(data_source)
        self._operations = self._check_operations(grain, operations)
        self.read_options = self._check_read_options(grain, read_options)
        self._shard_options = (
            grain.sharding.ShardByJaxProcess(drop_remainder=True) if shard_by_process else grain.sharding.NoSharding()
        )
        self._num_batches = self._count_batches()
        if self._num_batches == 0:
            raise ValueError(
                f"no batch would be produced: `data_source` has {len(self._data_source)} records, "
                f"{self.records_per_epoch} of them on this process (shard_count="
                f"{self._shard_options.shard_count}), with batch_size={self._batch_size}, "
                f"worker_count={self._worker_count} and drop_remainder={self._drop_remainder}; "
                "lower batch_size or worker_count, or pass drop_remainder=False"
            )
        if self._worker_count:
            _allow_unparsed_absl_flags()
        self._epoch = 0
        self._batch_in_epoch = 0
        # grain's state at `_batch_in_epoch` while no iterator is live (after load_state_dict).
        self._iterator_state: dict[str, Any] | None = None
        self._live_iterator: Any = None

    def _check_read_options(self, grain: Any, read_options: Any) -> Any:
        if read_options is None:
            return grain.ReadOptions(num_threads=READ_THREADS, prefetch_buffer_size=READ_BUFFER)
        if not isinstance(read_options, grain.ReadOptions):
            raise ValueError(f"`read_options` must be a grain.ReadOptions or None ({READ_THREADS} threads, a buffer "
                             f"of {READ_BUFFER} records); got {read_options!r}")
        return read_options

    @staticmethod
    def _check_source(data_source: Any) -> Any:
        if not (hasattr(data_source, "__len__") and hasattr(data_source, "__getitem__")):
            raise ValueError(
                f"`data_source` must be a random-access source (with __len__ and __getitem__), such as a "
                f"grain.sources source, a numpy array or a grain.MapDataset; got a "
                f"{type(data_source).__module__}.{type(data_source).__qualname__}"
            )
        return data_source

    @staticmethod
    def _check_operations(grain: Any, operations: Any) -> list[Any]:
        accepted = (grain.transforms.Map, grain.transforms.RandomMap, grain.transforms.TfRandomMap)
        if isinstance(operations, accepted) or not isinstance(operations, Sequence):
            raise ValueError(
                f"`operations` must be a list or tuple of grain.transforms.Map/RandomMap/TfRandomMap, "
                f"got {operations!r}"
            )
        for index, operation in enumerate(operations):
            if not isinstance(operation, accepted):
                raise ValueError(
                    f"`operations[{index}]` must be a grain.transforms.Map, RandomMap or TfRandomMap (one "
                    f"record in, one record out), got {operation!r}; GrainLoader batches itself "
                    "(batch_size), and Filter/FlatMap would make len(loader) wrong"
                )
        return list(operations)

    @property
    def batch_size(self) -> int:
        """Records per batch on this process."""
        return self._batch_size

    @property
    def records_per_epoch(self) -> int:
        """Records this process reads per epoch (its shard of ``data_source``)."""
        return len(self._data_source) // self._shard_options.shard_count

    @property
    def epoch(self) -> int:
        """The epoch the next batch is drawn from (advanced when an epoch is exhausted)."""
        return self._epoch

    def _count_batches(self) -> int:
        records, workers, batch_size = self.records_per_epoch, max(self._worker_count, 1), self._batch_size
        # Worker w batches records w, w + workers, ... of this process's share on its own.
        shares = [len(range(worker, records, workers)) for worker in range(workers)]
        if self._drop_remainder:
            return sum(share // batch_size for share in shares)
        return sum(-(-share // batch_size) for share in shares)

    def __len__(self) -> int:
        """Return the number of batches per epoch on this process (the same on every process)."""
        return self._num_batches

    def _sampler(self, epoch: int, seed: int) -> Any:
        grain = _import_grain()
        # Sharding is left to the DataLoader: the sampler's own sharding would give each process a
        # fixed contiguous block of records for every epoch instead of a share of a global shuffle.
        return grain.samplers.IndexSampler(
            num_records=len(self._data_source),
            shard_options=grain.sharding.NoSharding(),
            shuffle=self._shuffle,
            num_epochs=1,
            # grain wants a Python int of at most 32 bits; hashing (seed, epoch) keeps the epochs of
            # different seeds apart (seed + epoch would make seed=0/epoch=1 equal seed=1/epoch=0).
            seed=int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0]),
        )

    def _data_loader(self, epoch: int) -> Any:
        grain = _import_grain()
        return grain.DataLoader(
            data_source=self._data_source,
            sampler=self._sampler(epoch, self._seed),
            operations=[*self._worker_guard(grain), *self._operations,
                        grain.transforms.Batch(self._batch_size, self._drop_remainder)],
            worker_count=self._worker_count,
            shard_options=self._shard_options,
            read_options=self.read_options,
        )

    def _worker_guard(self, grain: Any) -> list[Any]:
        """With worker processes, a first operation that makes them die with this process (ExitWithTrainer)."""
        if not self._worker_count:
            return []
        from composerjax.data.grain_operations import ExitWithTrainer  # imports grain

        return [ExitWithTrainer(os.getpid())]

    def __iter__(self) -> Iterator[Any]:
        """Yield the remaining batches of the current epoch, then advance to the next epoch.

        A loader left at the end of an epoch (all batches taken, iterator not exhausted)
        starts the next epoch here, so a loop that stops after ``len(loader)`` batches still
        gets a fresh epoch from the next ``iter()``.
        """
        if self._batch_in_epoch >= self._num_batches:
            self._epoch += 1
            self._batch_in_epoch = 0
            self._iterator_state = None
        elif self._live_iterator is not None:
            # A new iter() mid-epoch (say a second Trainer.fit call) continues where the live one stands.
            self._iterator_state = self.state_dict()["iterator"]
        grain_iterator = iter(self._data_loader(self._epoch))
        if self._iterator_state is not None:
            # The saved state leaves out grain's `data_source` entry (see state_dict); grain checks
            # it against repr(data_source), so put back this loader's.
            fresh_state = json.loads(grain_iterator.get_state().decode())
            restored_state = {**self._iterator_state, "data_source": fresh_state["data_source"]}
            grain_iterator.set_state(json.dumps(restored_state).encode())
        self._live_iterator = grain_iterator
        return self._iterate_epoch(grain_iterator, self._epoch)

    def _iterate_epoch(self, grain_iterator: Any, epoch: int) -> Iterator[Any]:
        for batch in grain_iterator:
            # A later iter()/load_state_dict()/set_epoch() owns the position now.
            if self._live_iterator is not grain_iterator:
                return
            # Advanced before yielding, so a state_dict() taken while the consumer holds this
            # batch resumes right after it.
            self._batch_in_epoch += 1
            yield batch if self._pad_remainder is None else self._padded(batch)
        if self._live_iterator is grain_iterator:
            self._epoch = epoch + 1
            self._batch_in_epoch = 0
            self._iterator_state = None
            self._live_iterator = None

    def _padded(self, batch: Any) -> Any:
        """``batch`` filled up to ``batch_size`` with ``pad_remainder``'s records (as it is when full)."""
        fields = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if len(fields) != len(self._pad_remainder):
            raise ValueError(f"pad_remainder={self._pad_remainder!r}: the records have {len(fields)} field(s); "
                             "expected one fill value per field")
        short = self._batch_size - len(fields[0])
        if short <= 0:
            return batch
        filled = tuple(np.concatenate([field, np.full((short, *field.shape[1:]), fill, field.dtype)])
                       for field, fill in zip(fields, self._pad_remainder))
        return type(batch)(filled) if isinstance(batch, (tuple, list)) else filled[0]

    def close(self) -> None:
        """Stop the live grain iterator's worker processes and free their prefetched shared memory.

        The position is kept: the next ``iter()`` continues right after the last batch taken.
        A run that stops mid-epoch with ``worker_count > 0`` would otherwise leave the workers'
        prefetched batches in shared memory until the interpreter exits. ``Trainer.close()``
        calls it. Idempotent.

        Example: ``loader.close()``.
        """
        iterator = self._live_iterator
        if iterator is None:
            return
        if self._batch_in_epoch:
            self._iterator_state = self.state_dict()["iterator"]
        self._live_iterator = None
        inner = getattr(iterator, "_iterator", None)  # grain's DataLoaderIterator wraps a DatasetIterator
        close = getattr(inner, "close", None)
        if callable(close):
            close()

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the first batch of ``epoch``.

        Example: ``loader.set_epoch(3)``; the next ``iter(loader)`` uses epoch 3's shuffle.
        """
        self._epoch = _check_int("epoch", epoch, 0)
        self._batch_in_epoch = 0
        self._iterator_state = None
        self._live_iterator = None

    def state_dict(self) -> dict[str, Any]:
        """Return the loader's position, JSON-serializable; ``iterator`` is grain's state or None.

        Example: ``loader.state_dict()`` -> ``{'epoch': 0, 'batch_in_epoch': 3, 'seed': 0,
        'iterator': {'version': 2, 'last_seen_indices': {'0': 11}, ...}}``.
        """
        iterator_state = self._iterator_state
        if self._batch_in_epoch == 0:
            iterator_state = None
        elif self._live_iterator is not None:
            iterator_state = json.loads(self._live_iterator.get_state().decode())
            # repr(data_source) embeds a memory address for most sources, so it would never match
            # in the resumed process, and it can print the data; the position does not need it.
            iterator_state.pop("data_source", None)
        return {
            "epoch": self._epoch,
            "batch_in_epoch": self._batch_in_epoch,
            "seed": self._seed,
            "iterator": iterator_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position from :meth:`state_dict`; the next ``iter()`` continues from it.

        Example: ``GrainLoader(source, 4).load_state_dict(loader.state_dict())`` resumes right
        after the last batch ``loader`` yielded, with the same shuffle.
        """
        missing = [key for key in _STATE_KEYS if key not in state]
        if missing:
            raise ValueError(
                f"GrainLoader state is missing {missing}; expected keys {list(_STATE_KEYS)}, got {sorted(state)}"
            )
        epoch = _check_int("epoch", state["epoch"], 0)
        batch_in_epoch = _check_int("batch_in_epoch", state["batch_in_epoch"], 0)
        if batch_in_epoch > len(self):
            raise ValueError(f"`batch_in_epoch` must be in [0, {len(self)}] for this loader, got {batch_in_epoch}")
        seed = _check_int("seed", state["seed"], 0)
        iterator_state = state["iterator"]
        if batch_in_epoch == 0 or batch_in_epoch == len(self):
            # At an epoch boundary the position alone says where the next iter() starts.
            iterator_state = None
        elif not isinstance(iterator_state, dict):
            raise ValueError(
                f"`iterator` must be the grain iterator state (a dict) saved by GrainLoader.state_dict when "
                f"batch_in_epoch={batch_in_epoch} is inside an epoch, got {iterator_state!r}"
            )
        else:
            self._check_iterator_state(iterator_state, epoch, seed)
        self._seed = seed
        self._epoch = epoch
        self._batch_in_epoch = batch_in_epoch
        self._iterator_state = iterator_state
        self._live_iterator = None

    def _check_iterator_state(self, iterator_state: dict[str, Any], epoch: int, seed: int) -> None:
        """Refuse a grain state this loader cannot continue (grain would only say so at iter())."""
        if iterator_state.get("worker_count") != self._worker_count:
            raise ValueError(
                f"`iterator` was saved with worker_count={iterator_state.get('worker_count')!r} but this loader "
                f"has worker_count={self._worker_count}; the worker count decides which records form each "
                "batch, so resume with the same worker_count"
            )
        expected = repr(self._sampler(epoch, seed))
        if iterator_state.get("sampler") != expected:
            raise ValueError(
                f"`iterator` was saved for the sampler {iterator_state.get('sampler')!r} but this loader's "
                f"epoch {epoch} uses {expected!r}; resume with the same data_source length and shuffle"
            )
