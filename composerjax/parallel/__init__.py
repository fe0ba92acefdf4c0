"""Parallelism: the mesh and the shardings of parameters and batches."""

from composerjax.parallel.mesh import MESH_AXES, build_mesh
from composerjax.parallel.sharding import batch_sharding, replicated, train_state_shardings

__all__ = ["MESH_AXES", "batch_sharding", "build_mesh", "replicated", "train_state_shardings"]
