"""Weight standardization: convolve with each output channel's kernel standardized to mean 0, variance 1.

Surgery at ``Event.INIT`` (Qiao et al., 2019): each ``nnx.Conv`` keeps its ``kernel`` parameter as it
is and standardizes it in the forward pass, so gradients flow through the standardization. This
uses ``nnx.Conv``'s own hook: its ``conv_general_dilated`` attribute becomes a
:class:`StandardizedConvolution` wrapping the original function, so padding, dilation, groups, mask
and bias behave as before and the parameter tree does not change.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "StandardizedConvolution",
    "WeightStandardization",
    "apply_weight_standardization",
    "is_standardized",
    "standardize_kernel",
]


def standardize_kernel(kernel: jax.Array, epsilon: float = 1e-10) -> jax.Array:
    """Standardize each output channel of an ``(..., in, out)`` kernel over all its other axes.

    ``(w - mean) / sqrt(var + epsilon)`` (biased variance), computed in at least float32 and
    returned in the kernel's dtype.

    Example:
        >>> w = standardize_kernel(jnp.array([[1.0, 10.0], [3.0, 10.0]]))
        >>> w[:, 0].tolist(), w[:, 1].tolist()
        ([-1.0, 1.0], [0.0, 0.0])
    """
    weights = kernel.astype(jnp.promote_types(kernel.dtype, jnp.float32))
    axes = tuple(range(kernel.ndim - 1))
    mean = weights.mean(axes, keepdims=True)
    var = jnp.square(weights - mean).mean(axes, keepdims=True)
    return ((weights - mean) * jax.lax.rsqrt(var + epsilon)).astype(kernel.dtype)


@dataclasses.dataclass(frozen=True)
class StandardizedConvolution:
    """A ``conv_general_dilated`` that standardizes its kernel (``rhs``) before calling ``convolution``."""

    convolution: Callable[..., jax.Array] = jax.lax.conv_general_dilated
    epsilon: float = 1e-10

    def __call__(self, lhs: jax.Array, rhs: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        return self.convolution(lhs, standardize_kernel(rhs, self.epsilon), *args, **kwargs)


def is_standardized(conv: nnx.Conv) -> bool:
    """Whether ``conv`` already computes with a standardized kernel."""
    return isinstance(conv.conv_general_dilated, StandardizedConvolution)


def apply_weight_standardization(model: nnx.Module, n_last_layers_ignore: int = 0) -> int:
    """Make the convs of ``model`` standardize their kernels, except the last ``n_last_layers_ignore``.

    Convs are ordered as ``replace_modules`` walks the model: the order attributes were assigned in
    ``__init__`` (so a ``BasicBlock``'s ``shortcut`` comes after its ``conv2``), not the order of the
    forward pass. Returns how many convs were changed; convs already standardized count as ignored.

    Example:
        >>> from composerjax.models import SmallResNet
        >>> apply_weight_standardization(SmallResNet(width=4, rngs=nnx.Rngs(0)), n_last_layers_ignore=1)
        5
    """
    _check_n_last_layers_ignore(n_last_layers_ignore)
    convs: list[nnx.Conv] = []

    def collect(conv: nnx.Conv) -> nnx.Module:
        convs.append(conv)
        return conv

    replace_modules(model, {nnx.Conv: collect})
    standardized = 0
    for conv in convs[:max(0, len(convs) - n_last_layers_ignore)]:
        if not is_standardized(conv):
            conv.conv_general_dilated = StandardizedConvolution(conv.conv_general_dilated)
            standardized += 1
    return standardized


class WeightStandardization(Algorithm):
    """Standardize conv kernels per output channel in the forward pass (surgery at ``Event.INIT``).

    Usually paired with a normalization of the activations (group norm, batch norm).

    Args:
        n_last_layers_ignore: leave the last this many convs (in definition order) as they are.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(rngs=nnx.Rngs(0)), 10), loader, '1ep',
                          algorithms=[WeightStandardization(n_last_layers_ignore=0)])
    """

    required_modules = (nnx.Conv,)

    def __init__(self, n_last_layers_ignore: int = 0) -> None:
        _check_n_last_layers_ignore(n_last_layers_ignore)
        self.n_last_layers_ignore = n_last_layers_ignore

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        standardized = apply_weight_standardization(state.model, self.n_last_layers_ignore)
        logger.log_hyperparameters({"weight_standardization/num_replaced": standardized})
        if standardized == 0:
            warnings.warn(f"WeightStandardization changed no modules: the model has no nnx.Conv beyond the "
                          f"n_last_layers_ignore={self.n_last_layers_ignore} ignored ones", stacklevel=2)

    def __repr__(self) -> str:
        return f"WeightStandardization(n_last_layers_ignore={self.n_last_layers_ignore})"


def _check_n_last_layers_ignore(n_last_layers_ignore: int) -> None:
    if (isinstance(n_last_layers_ignore, bool) or not isinstance(n_last_layers_ignore, int)
            or n_last_layers_ignore < 0):
        raise ValueError(f"n_last_layers_ignore={n_last_layers_ignore!r}: expected an integer >= 0")
