"""The device mesh: one Mesh with named axes ('data', 'fsdp', 'tensor') and Auto axis types."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

__all__ = ["MESH_AXES", "build_mesh"]

MESH_AXES = ("data", "fsdp", "tensor")


def build_mesh(devices: Sequence[jax.Device] | None = None, fsdp: int = 1, tensor: int = 1) -> Mesh:
    """Build the mesh over ``devices`` (all devices by default); the data axis takes what is left.

    Axis types are Auto: ``jax.make_mesh`` defaults to Explicit, which GSPMD-style steps do not use.

    Example:
        >>> build_mesh().axis_names
        ('data', 'fsdp', 'tensor')
    """
    devices = list(devices) if devices is not None else jax.devices()
    count = len(devices)
    if count % (fsdp * tensor):
        raise ValueError(f"fsdp={fsdp} x tensor={tensor} does not divide the {count} devices")
    shape = (count // (fsdp * tensor), fsdp, tensor)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * 3)
