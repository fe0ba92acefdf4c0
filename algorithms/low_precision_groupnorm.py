"""Low-precision GroupNorm: run every GroupNorm in the run's bf16 compute dtype while the weights stay float32.

Composer's ``LowPrecisionGroupNorm``, built like :mod:`composerjax.algorithms.low_precision_layernorm`:
surgery replaces each ``nnx.GroupNorm`` by an :class:`LPGroupNorm` holding the same ``scale`` and
``bias``, which casts its input and parameters to the low-precision dtype, normalizes there and
casts the result back to the input's dtype. It follows the run's precision: an ``'amp_bf16'`` (or
``'bf16'``) run is converted, an ``'fp32'`` run is left alone with a warning.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax.algorithms.low_precision_layernorm import (
    LowPrecisionLayer,
    LowPrecisionNorm,
    low_precision_layer_norm,
    replace_norms,
)

__all__ = ["LPGroupNorm", "LowPrecisionGroupNorm", "apply_low_precision_groupnorm", "low_precision_group_norm"]


def low_precision_group_norm(
    x: jax.Array,
    num_groups: int,
    scale: jax.Array | None,
    bias: jax.Array | None,
    epsilon: float = 1e-6,
    dtype: Any = jnp.bfloat16,
) -> jax.Array:
    """GroupNorm over the last (channel) axis computed in ``dtype``, returned in ``x.dtype``.

    The channels are cut into ``num_groups`` groups of consecutive channels; each sample's group is
    normalized over its channels and every axis between the batch axis and the channels (as
    ``nnx.GroupNorm`` with its default ``reduction_axes``): ``(x - mean) / sqrt(var + eps) * scale + bias``.
    Every operand is cast to ``dtype`` first; ``scale`` / ``bias`` may be ``None``.

    Example:
        >>> y = low_precision_group_norm(jnp.array([[1.0, 3.0, 10.0, 30.0]]), 2, None, None)
        >>> y.dtype, y.tolist()  # each pair of channels normalized on its own, in bf16
        (dtype('float32'), [[-1.0, 1.0, -1.0, 1.0]])
    """
    channels = x.shape[-1]
    if channels % num_groups:
        raise ValueError(f"num_groups={num_groups!r}: must divide the {channels} channels of the input")
    low = x.astype(dtype)
    grouped = low.reshape((*x.shape[:-1], num_groups, channels // num_groups))
    axes = (*range(1, x.ndim - 1), x.ndim)  # the axes between batch and channels, and the group's channels
    # each group is a LayerNorm without parameters (computed in dtype); the affine part is per channel
    y = low_precision_layer_norm(grouped, None, None, epsilon, dtype, axes).reshape(low.shape)
    if scale is not None:
        y = y * scale.astype(dtype)
    if bias is not None:
        y = y + bias.astype(dtype)
    return y.astype(x.dtype)


class LPGroupNorm(LowPrecisionLayer):
    """A GroupNorm that computes in a low-precision dtype, holding the original layer's ``scale`` and ``bias``.

    The parameters keep their names and dtype, so the parameter tree (and a checkpoint of it) is
    the same as the original ``nnx.GroupNorm``'s.

    Example:
        >>> gn = nnx.GroupNorm(4, num_groups=2, rngs=nnx.Rngs(0))
        >>> LPGroupNorm(gn)(jnp.ones((2, 3, 4))).dtype
        dtype('float32')
    """

    def __init__(self, group_norm: nnx.GroupNorm, dtype: Any = jnp.bfloat16) -> None:
        super().__init__(group_norm, dtype)
        self.num_groups = group_norm.num_groups
        self.group_size = group_norm.group_size

    def normalize(self, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
        """:func:`low_precision_group_norm` of ``x`` in the layer's groups."""
        return low_precision_group_norm(x, self.num_groups, scale, bias, self.epsilon, self.compute_dtype)


def _supported(group_norm: nnx.GroupNorm) -> bool:
    # Default reduction axes and statistics local to the device: the common case.
    return group_norm.reduction_axes is None and group_norm.axis_name is None


def apply_low_precision_groupnorm(model: nnx.Module, precision: str = "amp_bf16") -> int:
    """Replace every ``nnx.GroupNorm`` of ``model`` by an :class:`LPGroupNorm` in ``precision``; return how many.

    ``precision`` is a run precision: ``'amp_bf16'`` / ``'bf16'`` compute in bfloat16, ``'amp_fp16'`` /
    ``'fp16'`` in float16; ``'fp32'`` changes nothing and warns, as Composer's functional form does.
    GroupNorms with explicit ``reduction_axes`` or cross-device statistics (``axis_name``) are left alone.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.GroupNorm(4, 2, rngs=nnx.Rngs(0)))
        >>> apply_low_precision_groupnorm(model, 'amp_bf16')
        1
    """
    return replace_norms(model, precision, nnx.GroupNorm, LPGroupNorm, _supported)


class LowPrecisionGroupNorm(LowPrecisionNorm):
    """Run every ``nnx.GroupNorm`` in the run's low-precision dtype (weights stay float32): surgery at ``apply_at``.

    As Composer's, it follows the run's precision: under ``Trainer(precision='amp_bf16')`` (or
    ``'bf16'``) every GroupNorm becomes an :class:`LPGroupNorm` that computes in bfloat16; in an
    ``'fp32'`` run it has no effect and warns. ``precision='bf16'`` (or ``'fp16'``) forces that dtype
    whatever the run's precision.

    It runs last at its event and hands a model edited after the device state is built back with
    ``state.update_model()``, as :class:`~composerjax.algorithms.low_precision_layernorm.LowPrecisionLayerNorm`
    does (both are a :class:`~composerjax.algorithms.low_precision_layernorm.LowPrecisionNorm`). Logs
    ``low_precision_groupnorm/num_replacements``.

    Args:
        apply_at: ``Event.INIT`` (default), ``Event.BEFORE_LOAD`` or ``Event.AFTER_LOAD`` (or its name).
        precision: None (default): the run's precision decides; ``'bf16'`` or ``'fp16'`` forces that dtype.

    Example::

        trainer = Trainer(ComposerClassifier(model_with_group_norms, 10), loader, '1ep',
                          precision='amp_bf16', algorithms=[LowPrecisionGroupNorm()])
    """

    required_modules = (nnx.GroupNorm,)
    norm_name = "GroupNorm"
    replace = staticmethod(apply_low_precision_groupnorm)
