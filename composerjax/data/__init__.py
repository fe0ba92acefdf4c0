"""Data loading: checkpointable, per-process sharded batch iterables."""

from composerjax.data.array_loader import ArrayLoader, as_batch_iterable

# GrainLoader imports grain only when one is built, so grain stays an optional extra.
from composerjax.data.grain_loader import GrainLoader

__all__ = ["ArrayLoader", "GrainLoader", "as_batch_iterable"]
