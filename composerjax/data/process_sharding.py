"""Split global batches across JAX processes: each process keeps its contiguous slice of every batch.

For data sources that yield GLOBAL batches on every process (a list of arrays, a generator class,
a third-party loader). :class:`~composerjax.data.ArrayLoader` and
:class:`~composerjax.data.GrainLoader` split by process themselves and need no wrapping.

Example:
    >>> import numpy as np
    >>> batches = [{'x': np.arange(8)}, {'x': np.arange(8, 14)}]
    >>> [b['x'].tolist() for b in shard_by_process(batches, process_index=1, process_count=2)]
    [[4, 5, 6, 7], [11, 12, 13]]
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

__all__ = ["ProcessShardedLoader", "resolve_process", "shard_by_process", "slice_for_process"]


def slice_for_process(
    batch: Any, process_index: int, process_count: int, drop_remainder: bool = True, batch_index: int | None = None
) -> Any:
    """Return process ``process_index``'s contiguous ``1 / process_count`` share of a global ``batch``.

    Every leaf of ``batch`` (a pytree of arrays) is sliced along its leading (batch) dimension,
    which all leaves must share. With ``drop_remainder`` the last ``size % process_count`` samples
    are dropped; without it a size that does not divide is an error.

    Args:
        batch: A pytree of numpy/jax arrays with a common leading dimension.
        process_index: The share to return, in ``[0, process_count)``.
        process_count: How many shares the batch is cut into.
        drop_remainder: Drop samples that do not divide evenly instead of raising.
        batch_index: The batch's position in its iterable, named in error messages.

    Raises:
        ValueError: Leaves disagree on the batch size, the batch is smaller than ``process_count``,
            or (``drop_remainder=False``) its size does not divide by ``process_count``.

    Example:
        >>> x, y = slice_for_process((np.arange(10), np.arange(10) * 10), 1, 3)
        >>> x.tolist(), y.tolist()
        ([3, 4, 5], [30, 40, 50])
    """
    leaves, treedef = jax.tree.flatten(batch)
    where = "batch" if batch_index is None else f"batch {batch_index}"
    if not leaves:
        raise ValueError(f"{where} has no arrays to split across processes")
    sizes = {int(np.shape(leaf)[0]) if np.ndim(leaf) else None for leaf in leaves}
    if None in sizes:
        raise ValueError(f"{where} holds a scalar; every leaf needs a leading batch dimension to be split")
    if len(sizes) > 1:
        raise ValueError(f"{where}: leaves disagree on the batch size (leading dimensions {sorted(sizes)})")
    size = sizes.pop()
    if size < process_count:
        raise ValueError(f"{where} has {size} samples, fewer than the {process_count} processes it is split across; "
                         "drop small batches in the wrapped loader (drop_last)")
    if size % process_count and not drop_remainder:
        raise ValueError(f"{where} has {size} samples, which does not divide across {process_count} processes; "
                         "pass drop_remainder=True to drop the last "
                         f"{size % process_count}, or use a global batch size divisible by {process_count}")
    share = size // process_count
    start = process_index * share
    return jax.tree.unflatten(treedef, [leaf[start:start + share] for leaf in leaves])


class ProcessShardedLoader:
    """Wrap a re-iterable of GLOBAL batches so each process yields only its slice of every batch.

    Process ``p`` of ``P`` yields samples ``[p * B // P, (p + 1) * B // P)`` of each global batch
    of size ``B``, so the processes' slices, in process order, make up the global batch (minus the
    ``B % P`` trailing samples with ``drop_remainder``). ``len()``, ``state_dict()`` /
    ``load_state_dict()`` and ``set_epoch()`` / ``epoch`` come from the wrapped object when it has
    them, so checkpoints and resumption work as with the wrapped loader.

    Args:
        loader: Any re-iterable of batches: pytrees of arrays with a leading batch dimension.
        drop_remainder: Drop the trailing ``B % P`` samples of a batch; if False such a batch raises.
        process_index: This process's rank; with ``process_count``, defaults to ``jax.process_index()``.
        process_count: The number of processes; defaults to ``jax.process_count()``.

    Example:
        >>> batches = [(np.arange(6), np.arange(6) % 2)] * 2
        >>> loader = ProcessShardedLoader(batches, process_index=0, process_count=3)
        >>> len(loader), [x.tolist() for x, _ in loader]
        (2, [[0, 1], [0, 1]])
    """

    _PASSED_THROUGH = ("state_dict", "load_state_dict", "set_epoch", "epoch")

    def __init__(
        self,
        loader: Any,
        drop_remainder: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
    ) -> None:
        if not hasattr(loader, "__iter__"):
            raise TypeError(f"`loader` must be a re-iterable of batches (an object with __iter__), "
                            f"got a {type(loader).__name__}")
        self.loader = loader
        self.drop_remainder = bool(drop_remainder)
        self.process_index, self.process_count = resolve_process(process_index, process_count)

    def __iter__(self) -> Iterator[Any]:
        for batch_index, batch in enumerate(self.loader):
            yield slice_for_process(batch, self.process_index, self.process_count, self.drop_remainder, batch_index)

    def __len__(self) -> int:
        try:
            return len(self.loader)
        except TypeError:
            raise TypeError(f"the wrapped {type(self.loader).__name__} has no len()") from None

    @property
    def global_batch_size(self) -> int:
        """Samples per batch over all processes, when the wrapped loader has a fixed ``global_batch_size``."""
        if not hasattr(self.loader, "global_batch_size"):
            raise AttributeError(f"the wrapped {type(self.loader).__name__} has no fixed global_batch_size")
        size = int(self.loader.global_batch_size)
        return size - size % self.process_count if self.drop_remainder else size

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the class lacks; `hasattr(wrapper, 'state_dict')` follows the wrapped loader.
        if name in ProcessShardedLoader._PASSED_THROUGH and "loader" in self.__dict__:
            return getattr(self.loader, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __repr__(self) -> str:
        return (f"ProcessShardedLoader({self.loader!r}, drop_remainder={self.drop_remainder}, "
                f"process_index={self.process_index}, process_count={self.process_count})")


def shard_by_process(
    iterable: Any, drop_remainder: bool = True, process_index: int | None = None, process_count: int | None = None
) -> ProcessShardedLoader:
    """Each process's share of every global batch of ``iterable``: ``ProcessShardedLoader(iterable, ...)``.

    Example:
        >>> [x.tolist() for x in shard_by_process([np.arange(5)], process_index=1, process_count=2)]
        [[2, 3]]
    """
    return ProcessShardedLoader(iterable, drop_remainder, process_index, process_count)


def resolve_process(process_index: int | None, process_count: int | None) -> tuple[int, int]:
    """``(process_index, process_count)`` as given, checked, or JAX's own when both are None.

    The one place the data loaders (:class:`~composerjax.data.ArrayLoader`,
    :class:`ProcessShardedLoader`) read which share of a global batch is theirs. JAX is asked when
    the loader is built, not at import, so that ``jax.distributed`` can be initialised first.

    Raises:
        ValueError: only one of the two is given, one is not an integer in range (``process_count``
            >= 1, ``0 <= process_index < process_count``).

    Example:
        >>> resolve_process(1, 4), resolve_process(None, None)
        ((1, 4), (0, 1))
    """
    if process_index is None and process_count is None:
        return jax.process_index(), jax.process_count()
    if process_index is None or process_count is None:
        raise ValueError("pass both `process_index` and `process_count`, or neither to use "
                         f"jax.process_index()/jax.process_count(); got process_index={process_index!r}, "
                         f"process_count={process_count!r}")
    for name, value, minimum in (("process_count", process_count, 1), ("process_index", process_index, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise ValueError(f"`{name}` must be {kind}, got {value!r}")
    if process_index >= process_count:
        raise ValueError(f"`process_index` must be in [0, process_count={process_count}), got {process_index!r}")
    return int(process_index), int(process_count)
