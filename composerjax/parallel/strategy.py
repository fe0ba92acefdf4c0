"""Parallelism strategies: which devices form the mesh, its shape, and each parameter's PartitionSpec."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

__all__ = [
    "ACCELERATORS",
    "GPT_TENSOR_PARALLEL_RULES",
    "STRATEGIES",
    "ParallelismConfig",
    "partition_metadata",
    "resolve_devices",
    "resolve_parallelism",
]

STRATEGIES = ("auto", "ddp", "fsdp")
ACCELERATORS = ("auto", "cpu", "gpu", "tpu")
_MESH_AXES = ("data", "fsdp", "tensor")

# Megatron-style tensor parallelism for composerjax.models.TinyGPT: the first matmul of attention
# and of the MLP split by output columns, the second by input rows, so each block needs one
# all-reduce per matmul pair; embeddings and norms stay replicated.
GPT_TENSOR_PARALLEL_RULES: tuple[tuple[str, P], ...] = (
    (r"attention/qkv/kernel$", P(None, "tensor")),
    (r"attention/qkv/bias$", P("tensor")),
    (r"attention/proj/kernel$", P("tensor", None)),
    (r"mlp/up/kernel$", P(None, "tensor")),
    (r"mlp/up/bias$", P("tensor")),
    (r"mlp/down/kernel$", P("tensor", None)),
    (r"head/kernel$", P(None, "tensor")),
    (r"head/bias$", P("tensor")),
)


@dataclass(frozen=True)
class ParallelismConfig:
    """How the train state is laid out over a Mesh with axes ``('data', 'fsdp', 'tensor')``.

    Args:
        fsdp: devices along the 'fsdp' axis: parameters and optimizer state are split on their
            largest dimension that this divides (the batch is split over 'data' x 'fsdp').
        tensor: devices along the 'tensor' axis, used by ``rules`` and by NNX partitioning
            metadata (``nnx.with_partitioning``); the batch is replicated along it.
        rules: ``(regex, PartitionSpec)`` pairs matched (``re.search``) against a parameter's
            path such as ``'module/blocks/0/mlp/up/kernel'``; the first match wins. A parameter
            with NNX partitioning metadata uses that instead. A rule's spec is combined with
            fsdp on a dimension it leaves free.
        min_fsdp_size: parameters with fewer elements stay replicated (the gathers would cost
            more than the memory saved).

    The 'data' axis takes the devices left over: ``devices / (fsdp * tensor)``.

    Example:
        >>> config = ParallelismConfig(tensor=2, rules=GPT_TENSOR_PARALLEL_RULES)
        >>> spec = config.spec_for("blocks/0/mlp/up/kernel", (64, 256), {"data": 2, "fsdp": 1, "tensor": 2})
        >>> spec == P(None, "tensor")
        True
    """

    fsdp: int = 1
    tensor: int = 1
    rules: Sequence[tuple[str, P]] = field(default_factory=tuple)
    min_fsdp_size: int = 0

    def __post_init__(self) -> None:
        for name in ("fsdp", "tensor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelismConfig({name}={value!r}): expected a positive integer (devices)")
        if isinstance(self.min_fsdp_size, bool) or not isinstance(self.min_fsdp_size, int) or self.min_fsdp_size < 0:
            raise ValueError(f"ParallelismConfig(min_fsdp_size={self.min_fsdp_size!r}): expected an integer >= 0")
        compiled = []
        for index, rule in enumerate(self.rules):
            if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], P)):
                raise ValueError(f"ParallelismConfig(rules[{index}]={rule!r}): expected a (regex, PartitionSpec) pair")
            try:
                compiled.append((re.compile(rule[0]), rule[1]))
            except re.error as error:
                raise ValueError(f"ParallelismConfig(rules[{index}]): {rule[0]!r} is not a regex: {error}") from error
            for axis in _axes_of(rule[1]):
                if axis not in _MESH_AXES:
                    raise ValueError(f"ParallelismConfig(rules[{index}]): axis {axis!r} is not a mesh axis; expected "
                                     f"one of {_MESH_AXES}")
        object.__setattr__(self, "_compiled", tuple(compiled))

    def spec_for(self, path: str, shape: tuple[int, ...], mesh_shape: dict[str, int],
                 metadata: P | None = None) -> P:
        """The PartitionSpec of one parameter (or a same-shaped optimizer/algorithm entry)."""
        spec = metadata
        if spec is None:
            for pattern, rule_spec in self._compiled:  # type: ignore[attr-defined]
                if pattern.search(path):
                    spec = rule_spec
                    break
        dims: list[Any] = list(spec) + [None] * (len(shape) - len(spec)) if spec is not None else [None] * len(shape)
        if len(dims) > len(shape):
            raise ValueError(f"partition spec {spec} for {path!r} has more entries than its shape {shape}")
        for index, axes in enumerate(dims):
            size = 1
            for axis in (axes if isinstance(axes, tuple) else (axes,)):
                if axis is not None:
                    size *= mesh_shape[axis]
            if shape[index] % size:
                raise ValueError(f"partition spec {spec} for {path!r}: dimension {index} of shape {shape} does not "
                                 f"divide over {size} devices")
        fsdp = mesh_shape.get("fsdp", 1)
        used = set(_axes_of(P(*dims)))
        if fsdp > 1 and "fsdp" not in used and _size(shape) >= max(self.min_fsdp_size, 1):
            free = [i for i, axes in enumerate(dims) if axes is None and shape[i] % fsdp == 0]
            if free:
                largest = max(free, key=lambda i: (shape[i], -i))
                dims[largest] = "fsdp"
        while dims and dims[-1] is None:
            dims.pop()
        return P(*dims)


def _axes_of(spec: P) -> list[str]:
    axes = []
    for entry in spec:
        for axis in entry if isinstance(entry, tuple) else (entry,):
            if axis is not None:
                axes.append(axis)
    return axes


def _size(shape: tuple[int, ...]) -> int:
    size = 1
    for dim in shape:
        size *= dim
    return size


def resolve_parallelism(parallelism: str | ParallelismConfig) -> ParallelismConfig | str:
    """Check ``Trainer(parallelism=...)``; 'auto' and 'ddp' stay strings, 'fsdp' needs the device count.

    Example:
        >>> resolve_parallelism("ddp")
        'ddp'
    """
    if isinstance(parallelism, ParallelismConfig):
        return parallelism
    if parallelism not in STRATEGIES:
        raise ValueError(f"parallelism={parallelism!r}: expected one of {', '.join(map(repr, STRATEGIES))} or a "
                         "ParallelismConfig(fsdp=..., tensor=..., rules=...)")
    return parallelism


def config_for(parallelism: str | ParallelismConfig, device_count: int) -> ParallelismConfig:
    """The ParallelismConfig a strategy name stands for on ``device_count`` devices."""
    if isinstance(parallelism, ParallelismConfig):
        if device_count % (parallelism.fsdp * parallelism.tensor):
            raise ValueError(f"parallelism: fsdp={parallelism.fsdp} x tensor={parallelism.tensor} does not divide the "
                             f"{device_count} devices of the mesh")
        return parallelism
    if parallelism == "fsdp":
        return ParallelismConfig(fsdp=device_count)
    return ParallelismConfig()  # 'auto' and 'ddp': everything replicated, the batch split


def resolve_devices(accelerator: str = "auto", devices: Any = "auto") -> list[jax.Device]:
    """The devices of the mesh for ``Trainer(accelerator=..., devices=...)``.

    ``devices`` is 'auto' (every device of the backend, across all processes), a count N (the
    first N local devices of each process) or a list of local device indices (or of
    ``jax.Device`` objects). A request the machine cannot satisfy raises ValueError naming what
    is available.

    Example:
        >>> len(resolve_devices("cpu", 1))
        1
    """
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r}: expected one of {', '.join(map(repr, ACCELERATORS))}")
    if isinstance(devices, (list, tuple)) and devices and all(isinstance(d, jax.Device) for d in devices):
        return list(devices)
    backend = jax.default_backend() if accelerator == "auto" else accelerator
    try:
        every = jax.devices(backend)
    except RuntimeError as error:
        raise ValueError(f"accelerator={accelerator!r}: no {backend} devices on this machine; available: "
                         f"{_available()}") from error
    local = [d for d in every if d.process_index == jax.process_index()]
    if devices is None or devices == "auto":
        return every
    if isinstance(devices, bool):
        raise ValueError(f"devices={devices!r}: expected 'auto', a positive count or a list of device indices")
    if isinstance(devices, int):
        if not 1 <= devices <= len(local):
            raise ValueError(f"devices={devices}: this process has {len(local)} {backend} device(s); expected 1 to "
                             f"{len(local)} or 'auto'")
        indices = list(range(devices))
    elif isinstance(devices, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in devices):
        indices = list(devices)
        bad = [i for i in indices if not 0 <= i < len(local)]
        if bad or len(set(indices)) != len(indices) or not indices:
            raise ValueError(f"devices={devices!r}: expected distinct indices in 0..{len(local) - 1} (this process has "
                             f"{len(local)} {backend} device(s))")
    else:
        raise ValueError(f"devices={devices!r}: expected 'auto', a positive count or a list of device indices")
    # The same local indices on every process, so the mesh is the same shape everywhere.
    by_process: dict[int, list[jax.Device]] = {}
    for device in every:
        by_process.setdefault(device.process_index, []).append(device)
    return [group[i] for _, group in sorted(by_process.items()) for i in indices]


def _available() -> str:
    found = []
    for backend in ("cpu", "gpu", "tpu"):
        try:
            found.append(f"{backend} ({len(jax.devices(backend))} device(s))")
        except RuntimeError:
            pass
    return ", ".join(found) or "none"


def partition_metadata(model: nnx.Module) -> dict[str, P]:
    """``{variable path: PartitionSpec}`` for the variables created with ``nnx.with_partitioning``.

    Parameters and the model's other variables alike (a frozen weight keeps its layer's spec).

    Example:
        >>> partition_metadata(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
        {}
    """
    found = {}
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        metadata = variable.get_metadata() if hasattr(variable, "get_metadata") else {}
        names = metadata.get("out_sharding") or metadata.get("sharding_names") or metadata.get("sharding")
        if names:
            found["/".join(str(key) for key in path)] = P(*names)
    return found
