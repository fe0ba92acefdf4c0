"""ArrayLoader: checkpointable, per-process sharded batches from in-memory numpy pytrees."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
from jax.tree_util import keystr, tree_flatten_with_path, tree_unflatten

from composerjax.data.process_sharding import resolve_process

__all__ = ["ArrayLoader", "as_batch_iterable"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    """Return ``value`` as an int, or raise ValueError naming ``name`` and what is accepted."""
    # bool is an int subclass, but ``batch_size=True`` is always a mistake.
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"`{name}` must be {kind}, got {value!r}")
    return int(value)


class ArrayLoader:
    """Iterate over batches of an in-memory pytree of arrays, resumable mid-epoch.

    Every leaf of ``arrays`` is indexed along its leading dimension, and each batch has the
    same pytree structure as ``arrays``. The order of epoch ``e`` depends only on ``(seed, e)``,
    so a loader restored with :meth:`load_state_dict` yields exactly the batches the
    uninterrupted run would have yielded.

    In a multi-process run every process builds the same loader with its own
    ``process_index``: each global batch is a contiguous block of ``global_batch_size``
    indices of the epoch's order, and process ``p`` takes the ``p``-th ``batch_size`` slice of
    it, so processes see disjoint samples whose union is what one process with
    ``global_batch_size`` would see.

    Iterating mutates the loader's position; use one live iterator at a time.

    Args:
        arrays: A pytree (tuple, list, dict, nested) of arrays sharing the leading dimension N.
            Leaves (numpy/jax arrays) are converted with ``np.asarray``; Python lists are pytree
            nodes, so wrap list data with ``np.asarray`` first.
        batch_size: Samples per batch on THIS process.
        shuffle: Shuffle every epoch with a permutation seeded by ``(seed, epoch)``.
        seed: Non-negative seed for the per-epoch permutations.
        drop_last: Drop the last, incomplete global batch. Otherwise it is split as evenly as
            possible across processes (a share may be empty when it is smaller than the
            number of processes, so every process still yields the same number of batches).
        drop_remainder: the same as ``drop_last`` (grain's name for it); when given it wins.
        process_index: This process's rank; with ``process_count``, defaults to
            ``jax.process_index()``.
        process_count: The number of processes; defaults to ``jax.process_count()``.

    Example:
        >>> import numpy as np
        >>> loader = ArrayLoader((np.arange(10), np.arange(10) * 2), batch_size=4, shuffle=False)
        >>> len(loader)
        2
        >>> [x.tolist() for x, _ in loader]
        [[0, 1, 2, 3], [4, 5, 6, 7]]
        >>> loader.state_dict()
        {'epoch': 1, 'batch_in_epoch': 0, 'seed': 0}
    """

    def __init__(
        self,
        arrays: Any,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        drop_remainder: bool | None = None,
    ) -> None:
        self._batch_size = _check_int("batch_size", batch_size, 1)
        self._seed = _check_int("seed", seed, 0)
        self._shuffle = bool(shuffle)
        self._drop_last = bool(drop_last if drop_remainder is None else drop_remainder)
        self._process_index, self._process_count = resolve_process(process_index, process_count)
        self._leaves, self._treedef = self._flatten(arrays)
        self._num_samples = int(self._leaves[0].shape[0])

        global_batch_size = self.global_batch_size
        if self._num_samples == 0 or (self._drop_last and self._num_samples < global_batch_size):
            raise ValueError(
                f"no batch would be produced: `arrays` has {self._num_samples} samples but the global "
                f"batch size is {global_batch_size} (batch_size={self._batch_size} x "
                f"process_count={self._process_count}) with drop_last={self._drop_last}; "
                "lower batch_size or pass drop_last=False"
            )
        # Bounds into the epoch's order are fixed for the loader's life; precomputing them keeps
        # the per-batch work to one slice per leaf.
        self._bounds = self._batch_bounds()
        self._epoch = 0
        self._batch_in_epoch = 0

    @staticmethod
    def _flatten(arrays: Any) -> tuple[list[np.ndarray], Any]:
        paths_and_leaves, treedef = tree_flatten_with_path(arrays)
        if not paths_and_leaves:
            raise ValueError(f"`arrays` must hold at least one array, got an empty pytree: {arrays!r}")
        paths = [keystr(path) for path, _ in paths_and_leaves]
        leaves = [np.asarray(leaf) for _, leaf in paths_and_leaves]
        scalars = [path or "<root>" for path, leaf in zip(paths, leaves, strict=True) if leaf.ndim == 0]
        if scalars:
            raise ValueError(
                f"every leaf of `arrays` needs a leading (sample) dimension; scalar leaves: {scalars} "
                "(Python lists are pytree nodes, not arrays: wrap them with np.asarray)"
            )
        expected = leaves[0].shape[0]
        mismatched = [
            f"{path}: {leaf.shape[0]}"
            for path, leaf in zip(paths, leaves, strict=True)
            if leaf.shape[0] != expected
        ]
        if mismatched:
            raise ValueError(
                "all leaves of `arrays` must share the leading dimension of "
                f"{paths[0] or '<root>'} ({expected}); these differ: {', '.join(mismatched)}"
            )
        return leaves, treedef

    def _batch_bounds(self) -> list[tuple[int, int]]:
        """Return this process's ``(start, stop)`` into the epoch's order for every batch."""
        batch_size, index, count = self._batch_size, self._process_index, self._process_count
        global_batch_size = batch_size * count
        num_full = self._num_samples // global_batch_size
        bounds = [
            (block_start + index * batch_size, block_start + (index + 1) * batch_size)
            for block_start in range(0, num_full * global_batch_size, global_batch_size)
        ]
        remainder = self._num_samples - num_full * global_batch_size
        if not self._drop_last and remainder:
            # Same shares as np.array_split(last_block, count): the first `remainder % count`
            # processes get one extra sample.
            share, extra = divmod(remainder, count)
            start = num_full * global_batch_size + index * share + min(index, extra)
            bounds.append((start, start + share + (1 if index < extra else 0)))
        return bounds

    @property
    def batch_size(self) -> int:
        """Samples per batch on this process."""
        return self._batch_size

    @property
    def global_batch_size(self) -> int:
        """Samples per batch summed over all processes (``batch_size * process_count``)."""
        return self._batch_size * self._process_count

    @property
    def num_samples(self) -> int:
        """The number of samples N (the shared leading dimension)."""
        return self._num_samples

    @property
    def epoch(self) -> int:
        """The epoch the next batch is drawn from (advanced when an epoch is exhausted)."""
        return self._epoch

    def __len__(self) -> int:
        """Return the number of batches per epoch (the same on every process)."""
        return len(self._bounds)

    def _order(self, epoch: int) -> np.ndarray | None:
        """Return the sample order of ``epoch``, or None when it is ``arange(N)``."""
        if not self._shuffle:
            return None
        return np.random.default_rng([self._seed, epoch]).permutation(self._num_samples)

    def __iter__(self) -> Iterator[Any]:
        """Yield the remaining batches of the current epoch, then advance to the next epoch.

        A loader left at the end of an epoch (all batches taken, iterator not exhausted)
        starts the next epoch here, so a loop that stops after ``len(loader)`` batches still
        gets a fresh epoch from the next ``iter()``.
        """
        if self._batch_in_epoch >= len(self._bounds):
            self._epoch += 1
            self._batch_in_epoch = 0
        return self._iterate_epoch(self._epoch, self._batch_in_epoch)

    def _iterate_epoch(self, epoch: int, first_batch: int) -> Iterator[Any]:
        order = self._order(epoch)
        self._current_order = (epoch, order)
        leaves, treedef, bounds = self._leaves, self._treedef, self._bounds
        # The position lives on the loader (not in this generator), so next_stacked() can take batches too.
        while self._epoch == epoch and self._batch_in_epoch < len(bounds):
            batch_index = self._batch_in_epoch
            start, stop = bounds[batch_index]
            if order is None:
                # Slices are views: no copy on the unshuffled path.
                batch_leaves = [leaf[start:stop] for leaf in leaves]
            else:
                indices = order[start:stop]
                batch_leaves = [leaf[indices] for leaf in leaves]
            # Advanced before yielding, so a state_dict() taken while the consumer holds this
            # batch resumes right after it.
            self._batch_in_epoch = batch_index + 1
            yield tree_unflatten(treedef, batch_leaves)
        # Only advance if nobody moved the loader (set_epoch/load_state_dict) meanwhile.
        if self._epoch == epoch and self._batch_in_epoch == len(bounds):
            self._epoch = epoch + 1
            self._batch_in_epoch = 0

    def next_stacked(self, count: int) -> Any | None:
        """Take the next ``count`` batches of the running epoch as one pytree with a leading ``count`` axis.

        One gather instead of ``count`` batches and a stack (``Trainer(steps_per_call=K)`` uses it).
        Returns None, taking nothing, when fewer than ``count`` equal, contiguous batches remain.

        Example:
            >>> loader = ArrayLoader(np.arange(12), batch_size=2, shuffle=False)
            >>> iterator = iter(loader)
            >>> loader.next_stacked(3).tolist()
            [[0, 1], [2, 3], [4, 5]]
            >>> next(iterator).tolist()
            [6, 7]
        """
        first = self._batch_in_epoch
        bounds = self._bounds
        if first + count > len(bounds):
            return None
        window = bounds[first:first + count]
        size = window[0][1] - window[0][0]
        if any(stop - start != size or (i and start != window[i - 1][1]) for i, (start, stop) in enumerate(window)):
            return None
        epoch, order = getattr(self, "_current_order", (None, None))
        if epoch != self._epoch:
            order = self._order(self._epoch)
        begin, end = window[0][0], window[-1][1]
        if order is None:
            taken = [leaf[begin:end].reshape(count, size, *leaf.shape[1:]) for leaf in self._leaves]
        else:
            indices = order[begin:end].reshape(count, size)
            taken = [leaf[indices] for leaf in self._leaves]
        self._batch_in_epoch = first + count
        return tree_unflatten(self._treedef, taken)

    def set_epoch(self, epoch: int) -> None:
        """Start the next ``iter()`` at the first batch of ``epoch``.

        Example: ``loader.set_epoch(3)``; the next ``iter(loader)`` uses epoch 3's permutation.
        """
        self._epoch = _check_int("epoch", epoch, 0)
        self._batch_in_epoch = 0

    def state_dict(self) -> dict[str, int]:
        """Return the loader's position as plain ints (JSON-serializable).

        Example: ``loader.state_dict()`` -> ``{'epoch': 0, 'batch_in_epoch': 3, 'seed': 0}``.
        """
        return {"epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch, "seed": self._seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position from :meth:`state_dict`; the next ``iter()`` continues from it.

        Example: ``ArrayLoader(arrays, 4).load_state_dict(loader.state_dict())`` resumes right
        after the last batch ``loader`` yielded, with the same permutation.
        """
        missing = [key for key in ("epoch", "batch_in_epoch", "seed") if key not in state]
        if missing:
            raise ValueError(
                f"ArrayLoader state is missing {missing}; expected keys 'epoch', 'batch_in_epoch', 'seed', "
                f"got {sorted(state)}"
            )
        epoch = _check_int("epoch", state["epoch"], 0)
        batch_in_epoch = _check_int("batch_in_epoch", state["batch_in_epoch"], 0)
        if batch_in_epoch > len(self):
            raise ValueError(
                f"`batch_in_epoch` must be in [0, {len(self)}] for this loader, got {batch_in_epoch}"
            )
        self._seed = _check_int("seed", state["seed"], 0)
        self._epoch = epoch
        self._batch_in_epoch = batch_in_epoch


def as_batch_iterable(data: Any) -> Any:
    """Return ``data`` if the trainer can iterate batches from it, else raise TypeError.

    Accepted: an :class:`ArrayLoader`, or any re-iterable (``__iter__``) of numpy/jax pytrees.

    Example:
        >>> batches = [(np.zeros((2, 3)), np.zeros(2))]
        >>> as_batch_iterable(batches) is batches
        True
    """
    if isinstance(data, ArrayLoader) or hasattr(data, "__iter__"):
        return data
    raise TypeError(
        f"cannot iterate batches from a {type(data).__module__}.{type(data).__qualname__}; expected an "
        "ArrayLoader, or any re-iterable (an object with __iter__) of numpy/jax pytrees"
    )
