"""Where arrays live on the mesh: the one place that chooses shardings."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from composerjax.parallel.strategy import STRATEGIES, ParallelismConfig, config_for

__all__ = ["STRATEGIES", "replicated", "batch_sharding", "batch_placer", "train_state_shardings", "global_batch",
           "path_of"]


def replicated(mesh: Mesh) -> NamedSharding:
    """A copy on every device."""
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """The leading (batch) dimension split over the 'data' and 'fsdp' axes."""
    return NamedSharding(mesh, P(("data", "fsdp")))



def batch_placer(mesh: Mesh) -> Callable[[Any], Any]:
    """A function that puts a host batch (this process's share) on ``mesh`` as the train step takes it.

    With several processes it assembles the global batch; on one device it puts the batch on that
    device (jit traces a step again for an argument committed to a mesh sharding after numpy ones,
    but not for one committed to a device); on several it places the batch with :func:`batch_sharding`.
    The prefetcher places batches ahead with it, and the step places the batches nobody placed.

    Example:
        >>> import numpy as np
        >>> mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))
        >>> place = batch_placer(mesh)
        >>> type(place(np.zeros(4))).__name__
        'ArrayImpl'
    """
    sharding = batch_sharding(mesh)
    if jax.process_count() > 1:
        return lambda batch: global_batch(batch, sharding)
    target = mesh.devices.flat[0] if mesh.devices.size == 1 else sharding
    return lambda batch: jax.device_put(batch, target)

def path_of(path: tuple[Any, ...], separator: str = "/") -> str:
    """``'module/layers/0/kernel'`` for a pytree key path (orbax writes the same names with ``'.'``)."""
    names = []
    for key in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(key, attribute):
                names.append(str(getattr(key, attribute)))
                break
        else:
            names.append(str(key))
    return separator.join(names)


def train_state_shardings(mesh: Mesh, train_state: Any, strategy: str | ParallelismConfig = "auto",
                          metadata: dict[str, P] | None = None) -> Any:
    """One NamedSharding per leaf of ``train_state`` for a strategy.

    'auto' and 'ddp' replicate everything. 'fsdp' and a :class:`ParallelismConfig` give each
    parameter its spec (NNX metadata, then rules, then fsdp on the largest divisible dimension);
    optimizer and algorithm state entries that mirror a parameter (same path suffix and shape, as
    adam's moments and EMA's averages do) get that parameter's spec; the model's other variables
    and the clock stay replicated, except the floating-point matrices among the model's other
    variables (weights that do not train, such as LoRA's frozen base), which are sharded as
    parameters are.

    Raises:
        ValueError: for an unknown strategy or a spec that does not fit.
    """
    if not isinstance(strategy, ParallelismConfig) and strategy not in STRATEGIES:
        raise ValueError(f"parallelism={strategy!r}: expected one of {', '.join(STRATEGIES)} or a ParallelismConfig")
    everywhere = replicated(mesh)
    if strategy in ("auto", "ddp"):
        return jax.tree.map(lambda _: everywhere, train_state)
    config = config_for(strategy, mesh.devices.size)
    mesh_shape = dict(mesh.shape)
    metadata = metadata or {}
    param_specs: dict[str, tuple[tuple[int, ...], P]] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(train_state.params)[0]:
        name = path_of(path)
        shape = tuple(leaf.shape)
        param_specs[name] = (shape, config.spec_for(name, shape, mesh_shape, metadata.get(name)))
    by_length = sorted(param_specs, key=len, reverse=True)

    def mirrored(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        name, shape = path_of(path), tuple(getattr(leaf, "shape", ()))
        for param in by_length:
            if (name == param or name.endswith("/" + param)) and param_specs[param][0] == shape:
                return NamedSharding(mesh, param_specs[param][1])
        return NamedSharding(mesh, config.spec_for(name, shape, mesh_shape))

    def frozen_weight(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        # A floating-point matrix among the model's other variables is a weight that does not train
        # (LoRA's frozen base, a frozen embedding): the largest part of a fine-tuned model, sharded as
        # a parameter would be. Vectors (norm statistics), counters and RNG keys stay replicated.
        shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
        if len(shape) < 2 or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return everywhere
        name = path_of(path)
        return NamedSharding(mesh, config.spec_for(name, shape, mesh_shape, metadata.get(name)))

    shardings = {}
    for group, tree in train_state._asdict().items():
        if group in ("params", "opt_state", "algorithm_state"):
            shardings[group] = jax.tree_util.tree_map_with_path(mirrored, tree)
        elif group == "rest":
            shardings[group] = jax.tree_util.tree_map_with_path(frozen_weight, tree)
        else:
            shardings[group] = jax.tree.map(lambda _: everywhere, tree)
    return type(train_state)(**shardings)


def global_batch(batch: Any, sharding: NamedSharding) -> Any:
    """Turn this process's batch into the global batch the step takes.

    With one process the step's ``in_shardings`` place host arrays directly, so the batch is
    returned as is; with several, each process holds its share and the global array is assembled
    with ``jax.make_array_from_process_local_data``.
    """
    if jax.process_count() == 1:
        return batch
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), batch)
