"""Parallelism: devices, the mesh, strategies and the shardings of parameters and batches."""

from composerjax.parallel.mesh import MESH_AXES, build_mesh
from composerjax.parallel.sharding import batch_sharding, replicated, train_state_shardings
from composerjax.parallel.strategy import (
    GPT_TENSOR_PARALLEL_RULES,
    ParallelismConfig,
    partition_metadata,
    resolve_devices,
)

__all__ = [
    "GPT_TENSOR_PARALLEL_RULES",
    "MESH_AXES",
    "ParallelismConfig",
    "batch_sharding",
    "build_mesh",
    "partition_metadata",
    "replicated",
    "resolve_devices",
    "train_state_shardings",
]
