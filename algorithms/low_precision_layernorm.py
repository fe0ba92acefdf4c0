"""Low-precision LayerNorm: run every LayerNorm in bf16 (or fp16) while the weights stay float32.

The layer's input, scale and bias are cast to the low-precision dtype, the normalisation runs
there, and the result is cast back to the input's dtype. Halving the bytes a memory-bound
LayerNorm moves is the speedup; the parameters (and the optimizer state) stay in their own dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "LPLayerNorm",
    "LowPrecisionLayerNorm",
    "apply_low_precision_layernorm",
    "low_precision_layer_norm",
]

_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


def low_precision_layer_norm(
    x: jax.Array,
    scale: jax.Array | None,
    bias: jax.Array | None,
    epsilon: float = 1e-6,
    dtype: Any = jnp.bfloat16,
    reduction_axes: int | Sequence[int] = -1,
) -> jax.Array:
    """LayerNorm computed in ``dtype``: ``(x - mean) / sqrt(var + eps) * scale + bias``, returned in ``x.dtype``.

    Every operand is cast to ``dtype`` first; ``scale`` / ``bias`` may be ``None``.

    Example:
        >>> y = low_precision_layer_norm(jnp.array([[1.0, 2.0, 3.0]]), None, None)
        >>> y.dtype, y.tolist()  # sqrt(3/2) = 1.2247... rounded to bf16
        (dtype('float32'), [[-1.2265625, 0.0, 1.2265625]])
    """
    low = x.astype(dtype)
    axes = (reduction_axes,) if isinstance(reduction_axes, int) else tuple(reduction_axes)
    mean = jnp.mean(low, axis=axes, keepdims=True)
    centered = low - mean
    variance = jnp.mean(centered * centered, axis=axes, keepdims=True)
    y = centered * jax.lax.rsqrt(variance + jnp.asarray(epsilon, dtype))
    if scale is not None:
        y = y * scale.astype(dtype)
    if bias is not None:
        y = y + bias.astype(dtype)
    return y.astype(x.dtype)


class LPLayerNorm(nnx.Module):
    """A LayerNorm that computes in a low-precision dtype, holding the original layer's ``scale`` and ``bias``.

    The parameters keep their names and dtype, so the parameter tree (and a checkpoint of it) is
    the same as the original ``nnx.LayerNorm``'s.

    Example:
        >>> ln = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
        >>> LPLayerNorm(ln)(jnp.ones((2, 4))).dtype
        dtype('float32')
    """

    def __init__(self, layer_norm: nnx.LayerNorm, dtype: Any = jnp.bfloat16) -> None:
        self.scale = layer_norm.scale
        self.bias = layer_norm.bias
        self.num_features = layer_norm.num_features
        self.epsilon = layer_norm.epsilon
        self.reduction_axes = layer_norm.reduction_axes
        self.compute_dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        return low_precision_layer_norm(x, scale, bias, self.epsilon, self.compute_dtype, self.reduction_axes)


def _supported(layer_norm: nnx.LayerNorm) -> bool:
    # Parameters laid out on the last axis and statistics local to the device: the common case.
    return layer_norm.feature_axes in (-1, (-1,)) and layer_norm.axis_name is None


def _dtype_for(precision: Any) -> Any:
    if precision not in _DTYPES:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(_DTYPES)}")
    return _DTYPES[precision]


def apply_low_precision_layernorm(model: nnx.Module, precision: str = "bf16") -> int:
    """Replace every ``nnx.LayerNorm`` of ``model`` by an ``LPLayerNorm`` computing in ``precision``; return how many.

    LayerNorms with parameters on an axis other than the last, or with cross-device statistics
    (``axis_name``), are left alone.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
        >>> apply_low_precision_layernorm(model)
        1
    """
    dtype = _dtype_for(precision)
    replaced = 0

    def to_low_precision(layer_norm: nnx.LayerNorm) -> nnx.Module:
        nonlocal replaced
        if not _supported(layer_norm):
            return layer_norm
        replaced += 1
        return LPLayerNorm(layer_norm, dtype)

    replace_modules(model, {nnx.LayerNorm: to_low_precision})
    return replaced


class LowPrecisionLayerNorm(Algorithm):
    """Run every ``nnx.LayerNorm`` in bf16 (weights stay float32), applied at INIT after other surgery.

    Runs once at ``Event.INIT`` (host): surgery on ``state.model``. ``run_last = True`` so the
    default passes order it after every other INIT algorithm, and it also converts LayerNorms that
    other surgery creates. For mixed precision of the whole model use ``Trainer(precision='bf16')``;
    this algorithm makes only the LayerNorms low precision (in an fp32 run), or keeps them there
    explicitly (in a bf16 run). Logs ``low_precision_layernorm/num_replacements``.

    Args:
        precision: ``'bf16'`` (default) or ``'fp16'``.

    Example::

        trainer = Trainer(ComposerClassifier(TinyGPT(rngs=nnx.Rngs(0)), 256), loader, '1ep',
                          algorithms=[LowPrecisionLayerNorm()])
    """

    required_modules = (nnx.LayerNorm,)

    run_last = True

    def __init__(self, precision: str = "bf16") -> None:
        self.dtype = _dtype_for(precision)
        self.precision = precision

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        replaced = apply_low_precision_layernorm(state.model, self.precision)
        logger.log_hyperparameters({"low_precision_layernorm/num_replacements": replaced})
        if replaced == 0:
            warnings.warn("LowPrecisionLayerNorm had no effect: the model has no nnx.LayerNorm", UserWarning,
                          stacklevel=2)

    def __repr__(self) -> str:
        return f"LowPrecisionLayerNorm(precision={self.precision!r})"
