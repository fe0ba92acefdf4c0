"""Low-precision LayerNorm: run every LayerNorm in the run's bf16 compute dtype while the weights stay float32.

The layer's input, scale and bias are cast to the low-precision dtype, the normalisation runs
there, and the result is cast back to the input's dtype. Halving the bytes a memory-bound
LayerNorm moves is the speedup; the parameters (and the optimizer state) stay in their own dtype.
As in Composer the algorithm follows the run's precision: it converts the LayerNorms of an
``'amp_bf16'`` (or ``'bf16'``) run and has no effect, with a warning, in an ``'fp32'`` run.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "SURGERY_EVENTS",
    "LPLayerNorm",
    "LowPrecisionLayer",
    "LowPrecisionLayerNorm",
    "LowPrecisionNorm",
    "apply_low_precision_layernorm",
    "low_precision_dtype",
    "low_precision_layer_norm",
    "replace_norms",
    "surgery_event",
]

#: The low-precision compute dtype of each precision name (Composer's amp names and this project's).
_DTYPES = {"amp_bf16": jnp.bfloat16, "bf16": jnp.bfloat16, "amp_fp16": jnp.float16, "fp16": jnp.float16}
#: The events at which Composer's low-precision norm algorithms may do their surgery.
SURGERY_EVENTS = (Event.INIT, Event.BEFORE_LOAD, Event.AFTER_LOAD)


def low_precision_dtype(precision: str, argument: str = "precision") -> Any:
    """The dtype a low-precision norm computes in for ``precision``; None for ``'fp32'`` (no effect).

    Raises:
        ValueError: naming ``argument``, for a precision that is not one of ``'fp32'``,
            ``'amp_bf16'``, ``'bf16'``, ``'amp_fp16'`` or ``'fp16'``.

    Example:
        >>> low_precision_dtype('amp_bf16'), low_precision_dtype('fp32')
        (<class 'jax.numpy.bfloat16'>, None)
    """
    if precision == "fp32":
        return None
    if precision not in _DTYPES:
        raise ValueError(f"{argument}={precision!r}: expected one of 'fp32', {', '.join(map(repr, _DTYPES))}")
    return _DTYPES[precision]


def surgery_event(apply_at: Event | str, algorithm: str) -> Event:
    """``apply_at`` as an Event, checked to be one of :data:`SURGERY_EVENTS` (as Composer checks it).

    Raises:
        ValueError: naming the value and the accepted events.

    Example:
        >>> surgery_event('after_load', 'LowPrecisionLayerNorm')
        <Event.AFTER_LOAD: 'after_load'>
    """
    try:
        event = Event(apply_at)
    except ValueError:
        event = None
    if event not in SURGERY_EVENTS:
        accepted = ", ".join(f"Event.{e.name} ({e.value!r})" for e in SURGERY_EVENTS)
        raise ValueError(f"{algorithm}(apply_at={apply_at!r}): expected one of {accepted}")
    return event


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


class LowPrecisionLayer(nnx.Module):
    """Base of the low-precision norm layers: the original layer's ``scale`` and ``bias``, computed in ``dtype``.

    The parameters keep their names and dtype, so the parameter tree (and a checkpoint of it) is
    the same as the original layer's. A subclass copies its own settings and implements
    :meth:`normalize`.
    """

    def __init__(self, norm: Any, dtype: Any = jnp.bfloat16) -> None:
        self.scale = norm.scale
        self.bias = norm.bias
        self.epsilon = norm.epsilon
        self.compute_dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.scale[...] if self.scale is not None else None
        bias = self.bias[...] if self.bias is not None else None
        return self.normalize(x, scale, bias)

    def normalize(self, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
        """The layer's function of ``x`` with the parameters' values (None where the layer has none)."""
        raise NotImplementedError(f"{type(self).__name__} must implement normalize(x, scale, bias)")


class LPLayerNorm(LowPrecisionLayer):
    """A LayerNorm that computes in a low-precision dtype, holding the original layer's ``scale`` and ``bias``.

    The parameters keep their names and dtype, so the parameter tree (and a checkpoint of it) is
    the same as the original ``nnx.LayerNorm``'s.

    Example:
        >>> ln = nnx.LayerNorm(4, rngs=nnx.Rngs(0))
        >>> LPLayerNorm(ln)(jnp.ones((2, 4))).dtype
        dtype('float32')
    """

    def __init__(self, layer_norm: nnx.LayerNorm, dtype: Any = jnp.bfloat16) -> None:
        super().__init__(layer_norm, dtype)
        self.num_features = layer_norm.num_features
        self.reduction_axes = layer_norm.reduction_axes

    def normalize(self, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> jax.Array:
        """:func:`low_precision_layer_norm` of ``x`` over the layer's reduction axes."""
        return low_precision_layer_norm(x, scale, bias, self.epsilon, self.compute_dtype, self.reduction_axes)


def _supported(layer_norm: nnx.LayerNorm) -> bool:
    # Parameters laid out on the last axis and statistics local to the device: the common case.
    return layer_norm.feature_axes in (-1, (-1,)) and layer_norm.axis_name is None


def apply_low_precision_layernorm(model: nnx.Module, precision: str = "amp_bf16") -> int:
    """Replace every ``nnx.LayerNorm`` of ``model`` by an ``LPLayerNorm`` computing in ``precision``; return how many.

    ``precision`` is a run precision: ``'amp_bf16'`` / ``'bf16'`` compute in bfloat16, ``'amp_fp16'`` /
    ``'fp16'`` in float16; ``'fp32'`` changes nothing and warns, as Composer's functional form does.
    LayerNorms with parameters on an axis other than the last, or with cross-device statistics
    (``axis_name``), are left alone.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
        >>> apply_low_precision_layernorm(model, 'amp_bf16')
        1
    """
    return replace_norms(model, precision, nnx.LayerNorm, LPLayerNorm, _supported)


def replace_norms(model: nnx.Module, precision: str, norm_type: type, low_precision: Callable[[Any, Any], nnx.Module],
                  supported: Callable[[Any], bool]) -> int:
    """Replace each supported ``norm_type`` module by ``low_precision(module, dtype)``; return how many.

    The shared surgery of the low-precision norms: ``precision`` names the dtype (``'fp32'`` changes
    nothing and warns, as Composer's functional forms do).

    Example:
        >>> model = nnx.Sequential(nnx.LayerNorm(4, rngs=nnx.Rngs(0)))
        >>> replace_norms(model, 'bf16', nnx.LayerNorm, LPLayerNorm, _supported)
        1
    """
    name = norm_type.__name__
    dtype = low_precision_dtype(precision)
    if dtype is None:
        warnings.warn(f"Low precision {name} only applies to low-precision runs (precision='amp_bf16' or "
                      f"'bf16'); precision='fp32': no {name} replaced", UserWarning, stacklevel=3)
        return 0
    replaced = 0

    def to_low_precision(norm: Any) -> nnx.Module:
        nonlocal replaced
        if not supported(norm):
            return norm
        replaced += 1
        return low_precision(norm, dtype)

    replace_modules(model, {norm_type: to_low_precision})
    return replaced


class LowPrecisionNorm(Algorithm):
    """Surgery that runs one kind of normalization layer in the run's low-precision dtype, at ``apply_at``.

    The shared body of :class:`LowPrecisionLayerNorm` and ``LowPrecisionGroupNorm``: a subclass names
    the layer (``norm_name``, ``required_modules``) and the surgery (``replace(model, precision)``,
    returning how many layers it converted).

    Example::

        class LowPrecisionRMSNorm(LowPrecisionNorm):
            required_modules = (nnx.RMSNorm,)
            norm_name = "RMSNorm"
            replace = staticmethod(apply_low_precision_rmsnorm)
    """

    required_modules: tuple[type, ...] = ()
    norm_name = ""
    run_last = True
    #: ``replace(model, precision) -> int``: convert the layers of ``model``; how many were converted.
    replace: Callable[[nnx.Module, str], int]

    def __init__(self, apply_at: Event | str = Event.INIT, precision: str | None = None) -> None:
        name = type(self).__name__
        self.apply_at = surgery_event(apply_at, name)
        if precision is not None and low_precision_dtype(precision) is None:
            raise ValueError(f"precision={precision!r}: expected None (follow the run's precision), 'bf16' or 'fp16'")
        self.precision = precision
        self.events = frozenset({self.apply_at})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        name, norm = type(self).__name__, self.norm_name
        precision = self.precision or state.precision
        if low_precision_dtype(precision) is None:
            warnings.warn(f"{name} had no effect: it applies only to low-precision runs "
                          "(Trainer(precision='amp_bf16') or 'bf16'); this run is 'fp32' (pass precision='bf16' "
                          "to force it)", UserWarning, stacklevel=2)
            return
        built = state.train_state is not None
        replaced = self.replace(state.model, precision)
        if built and replaced:
            state.update_model()
        logger.log_hyperparameters({f"low_precision_{norm.lower()}/num_replacements": replaced})
        if replaced == 0:
            warnings.warn(f"{name} had no effect: the model has no nnx.{norm}", UserWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(apply_at={self.apply_at}, precision={self.precision!r})"


class LowPrecisionLayerNorm(LowPrecisionNorm):
    """Run every ``nnx.LayerNorm`` in the run's low-precision dtype (weights stay float32): surgery at ``apply_at``.

    As Composer's, it follows the run's precision: under ``Trainer(precision='amp_bf16')`` (or
    ``'bf16'``) every LayerNorm becomes an ``LPLayerNorm`` that computes in bfloat16; in an
    ``'fp32'`` run it has no effect and warns. ``precision='bf16'`` (or ``'fp16'``) forces that dtype
    whatever the run's precision (e.g. low-precision LayerNorms in an fp32 run).

    ``run_last = True``: the default passes order it after every other algorithm at its event, so at
    ``INIT`` it also converts LayerNorms that other surgery creates. At ``BEFORE_LOAD`` /
    ``AFTER_LOAD`` (after the device state is built) it hands the edited model back with
    ``state.update_model()``. Logs ``low_precision_layernorm/num_replacements``.

    Args:
        apply_at: the event of the surgery: ``Event.INIT`` (default), ``Event.BEFORE_LOAD`` or
            ``Event.AFTER_LOAD`` (or their names, ``'init'``...), as in Composer.
        precision: None (default, Composer's behaviour): the run's precision decides. ``'bf16'`` or
            ``'fp16'``: always that dtype.

    Example::

        trainer = Trainer(ComposerClassifier(TinyGPT(rngs=nnx.Rngs(0)), 256), loader, '1ep',
                          precision='amp_bf16', algorithms=[LowPrecisionLayerNorm()])
    """

    required_modules = (nnx.LayerNorm,)
    norm_name = "LayerNorm"
    replace = staticmethod(apply_low_precision_layernorm)
