"""Data loading: checkpointable, per-process sharded batch iterables."""

from composerjax.data.array_loader import ArrayLoader, as_batch_iterable

# GrainLoader imports grain only when one is built, so grain stays an optional extra.
from composerjax.data.grain_loader import GrainLoader
from composerjax.data.process_sharding import ProcessShardedLoader, shard_by_process, slice_for_process

__all__ = ["ArrayLoader", "GrainLoader", "ProcessShardedLoader", "as_batch_iterable", "shard_by_process",
           "slice_for_process"]
