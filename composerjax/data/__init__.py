"""Data loading: checkpointable, per-process sharded batch iterables."""

from composerjax.data.array_loader import ArrayLoader, as_batch_iterable

__all__ = ["ArrayLoader", "as_batch_iterable"]
