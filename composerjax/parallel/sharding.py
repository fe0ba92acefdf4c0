"""Where arrays live on the mesh: the one place that chooses shardings."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

__all__ = ["STRATEGIES", "replicated", "batch_sharding", "train_state_shardings", "global_batch"]

STRATEGIES = ("auto", "ddp")


def replicated(mesh: Mesh) -> NamedSharding:
    """A copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension split over the 'data' and 'fsdp' axes."""
    return NamedSharding(mesh, P(("data", "fsdp")))


def train_state_shardings(mesh: Mesh, train_state: Any, strategy: str = "auto") -> Any:
    """One sharding per leaf of ``train_state``: replicated for 'auto' and 'ddp'.

    Raises:
        ValueError: for an unknown strategy.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"parallelism={strategy!r}: expected one of {', '.join(STRATEGIES)}")
    sharding = replicated(mesh)
    return jax.tree.map(lambda _: sharding, train_state)


def global_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Turn this process's batch into the global batch the step takes.

    With one process the step's ``in_shardings`` place host arrays directly, so the batch is
    returned as is; with several, each process holds its share and the global array is assembled
    with ``jax.make_array_from_process_local_data``.
    """
    if jax.process_count() == 1:
        return batch
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)
