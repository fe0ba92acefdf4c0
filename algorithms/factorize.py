"""Factorize: replace large Linear and Conv layers by two thinner ones through a low-rank bottleneck.

A layer with weight ``W`` (``fan_in x out``) becomes two layers ``A`` (``fan_in x r``) and ``B``
(``r x out``) with no nonlinearity in between, initialised from the truncated SVD of ``W`` so that
``A @ B`` is the best rank-``r`` approximation of ``W`` (exactly ``W`` when ``r >= rank(W)``). A
``k x k`` convolution becomes a ``k x k`` convolution to ``r`` channels followed by a ``1 x 1``
convolution to the original output channels; its kernel is flattened to ``(k*k*C_in) x C_out`` for
the SVD. A layer is replaced only when the factorization has fewer weights than the original.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = [
    "Factorize",
    "FactorizedConv",
    "FactorizedLinear",
    "apply_factorization",
    "factorize_matrix",
    "latent_size",
    "reduces_parameters",
]


def factorize_matrix(matrix: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    """Return ``(a, b)`` with ``a @ b`` the best rank-``rank`` approximation of ``matrix`` (truncated SVD).

    The singular values are split evenly between the factors (``a = U_r sqrt(S_r)``,
    ``b = sqrt(S_r) V_r^T``), so both factors have comparable scale. Computed on the host in float32
    and returned as jax arrays in the matrix's dtype.

    Example:
        >>> a, b = factorize_matrix(jnp.array([[4.0, 0.0], [0.0, 1.0]]), 1)
        >>> (a @ b).tolist()
        [[4.0, 0.0], [0.0, 0.0]]
    """
    if matrix.ndim != 2:
        raise ValueError(f"factorize_matrix: expected a 2-d matrix, got shape {matrix.shape}")
    if not 1 <= rank <= min(matrix.shape):
        raise ValueError(f"rank={rank}: expected an integer in [1, {min(matrix.shape)}] for a matrix of shape "
                         f"{matrix.shape}")
    # On the host with numpy: this runs once per layer at INIT, where XLA would compile per shape.
    u, s, vt = np.linalg.svd(np.asarray(matrix, np.float32), full_matrices=False)
    root = np.sqrt(s[:rank])
    a = u[:, :rank] * root[None, :]
    b = root[:, None] * vt[:rank]
    return jnp.asarray(a, matrix.dtype), jnp.asarray(b, matrix.dtype)


def latent_size(latent: int | float, in_size: int, out_size: int) -> int:
    """The bottleneck width: ``latent`` itself if >= 1, else that fraction of ``min(in_size, out_size)`` (>= 1).

    Example:
        >>> latent_size(0.25, 512, 256), latent_size(32, 512, 256)
        (64, 32)
    """
    if latent < 1:
        return max(1, int(latent * min(in_size, out_size)))
    return int(latent)


def reduces_parameters(fan_in: int, out_size: int, rank: int) -> bool:
    """Whether two factors of rank ``rank`` hold fewer weights than the ``fan_in x out_size`` original.

    Example:
        >>> reduces_parameters(256, 256, 127), reduces_parameters(256, 256, 128)
        (True, False)
    """
    return rank * (fan_in + out_size) < fan_in * out_size


def _constant(value: jax.Array) -> Any:
    """An initializer that returns ``value`` (the factors are computed, not drawn)."""
    return lambda key, shape, dtype=None: jnp.asarray(value, dtype if dtype is not None else value.dtype)


class FactorizedLinear(nnx.Module):
    """``linear1(linear0(x))``: a Linear through a rank-``latent_features`` bottleneck.

    ``linear0`` (``in -> r``, no bias) and ``linear1`` (``r -> out``, the original bias).

    Example:
        >>> linear = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        >>> factorized = FactorizedLinear.from_linear(linear, rank=8)  # full rank: same function
        >>> x = jnp.ones((2, 8))
        >>> bool(jnp.allclose(factorized(x), linear(x), atol=1e-5))
        True
    """

    def __init__(self, linear0: nnx.Linear, linear1: nnx.Linear) -> None:
        self.linear0 = linear0
        self.linear1 = linear1
        self.in_features, self.out_features = linear0.in_features, linear1.out_features
        self.latent_features = linear0.out_features

    @classmethod
    def from_linear(cls, linear: nnx.Linear, rank: int) -> FactorizedLinear:
        """Factorize ``linear`` at ``rank``, initialised from the truncated SVD of its kernel."""
        a, b = factorize_matrix(linear.kernel[...], rank)
        common = {"dtype": linear.dtype, "param_dtype": linear.param_dtype, "precision": linear.precision}
        rngs = nnx.Rngs(0)  # unused: every initializer below is a constant
        linear0 = nnx.Linear(linear.in_features, rank, use_bias=False, kernel_init=_constant(a), rngs=rngs, **common)
        bias_init = _constant(linear.bias[...]) if linear.use_bias else nnx.initializers.zeros
        linear1 = nnx.Linear(rank, linear.out_features, use_bias=linear.use_bias, kernel_init=_constant(b),
                             bias_init=bias_init, rngs=rngs, **common)
        return cls(linear0, linear1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.linear1(self.linear0(x))


class FactorizedConv(nnx.Module):
    """``conv1(conv0(x))``: a ``k x k`` conv to ``r`` latent channels, then a ``1 x 1`` conv to the outputs.

    ``conv0`` keeps the original kernel size, strides, padding and dilations (no bias); ``conv1`` is
    ``1 x 1`` with the original bias. Works for 1-, 2- and 3-d convolutions.

    Example:
        >>> conv = nnx.Conv(4, 4, (3, 3), rngs=nnx.Rngs(0))
        >>> factorized = FactorizedConv.from_conv(conv, rank=4)  # full rank of the 36 x 4 kernel
        >>> x = jnp.ones((1, 5, 5, 4))
        >>> bool(jnp.allclose(factorized(x), conv(x), atol=1e-5))
        True
    """

    def __init__(self, conv0: nnx.Conv, conv1: nnx.Conv) -> None:
        self.conv0 = conv0
        self.conv1 = conv1
        self.in_features, self.out_features = conv0.in_features, conv1.out_features
        self.latent_channels = conv0.out_features

    @classmethod
    def from_conv(cls, conv: nnx.Conv, rank: int) -> FactorizedConv:
        """Factorize ``conv`` at ``rank``, initialised from the truncated SVD of its flattened kernel."""
        if conv.feature_group_count != 1 or conv.mask is not None:
            raise ValueError("FactorizedConv.from_conv: grouped or masked convolutions are not supported")
        kernel = conv.kernel[...]
        *window, in_channels, out_channels = kernel.shape
        a, b = factorize_matrix(kernel.reshape(-1, out_channels), rank)
        common = {"dtype": conv.dtype, "param_dtype": conv.param_dtype, "precision": conv.precision}
        rngs = nnx.Rngs(0)  # unused: every initializer below is a constant
        conv0 = nnx.Conv(in_channels, rank, tuple(window), strides=conv.strides, padding=conv.padding,
                         input_dilation=conv.input_dilation, kernel_dilation=conv.kernel_dilation,
                         use_bias=False, kernel_init=_constant(a.reshape(*window, in_channels, rank)),
                         rngs=rngs, **common)
        ones = (1,) * len(window)
        bias_init = _constant(conv.bias[...]) if conv.use_bias else nnx.initializers.zeros
        conv1 = nnx.Conv(rank, out_channels, ones, padding="VALID", use_bias=conv.use_bias,
                         kernel_init=_constant(b.reshape(*ones, rank, out_channels)), bias_init=bias_init,
                         rngs=rngs, **common)
        return cls(conv0, conv1)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.conv1(self.conv0(x))


def _factorize(model: nnx.Module, factorize_convs: bool, factorize_linears: bool, min_channels: int,
               latent_channels: int | float, min_features: int, latent_features: int | float) -> dict[str, int]:
    counts = {"linear": 0, "conv": 0}

    def linear_policy(linear: nnx.Linear) -> nnx.Module:
        fan_in, out = linear.in_features, linear.out_features
        rank = latent_size(latent_features, fan_in, out)
        if min(fan_in, out) < min_features or not reduces_parameters(fan_in, out, rank):
            return linear
        counts["linear"] += 1
        return FactorizedLinear.from_linear(linear, rank)

    def conv_policy(conv: nnx.Conv) -> nnx.Module:
        *window, in_channels, out = conv.kernel.shape
        if conv.feature_group_count != 1 or conv.mask is not None or min(in_channels, out) < min_channels:
            return conv
        fan_in = in_channels * math.prod(window)
        rank = latent_size(latent_channels, in_channels, out)
        if not reduces_parameters(fan_in, out, rank):
            return conv
        counts["conv"] += 1
        return FactorizedConv.from_conv(conv, rank)

    policies: dict[type, Any] = {}
    if factorize_linears:
        policies[nnx.Linear] = linear_policy
    if factorize_convs:
        policies[nnx.Conv] = conv_policy
    replace_modules(model, policies)  # counts every visit; ``counts`` holds the real replacements
    return counts


def apply_factorization(
    model: nnx.Module,
    factorize_convs: bool = True,
    factorize_linears: bool = True,
    min_channels: int = 512,
    latent_channels: int | float = 0.25,
    min_features: int = 512,
    latent_features: int | float = 0.25,
) -> int:
    """Factorize the qualifying ``nnx.Linear`` / ``nnx.Conv`` layers of ``model`` in place; return how many.

    A Linear qualifies when both its input and output features are ``>= min_features``, a Conv when
    both its channel counts are ``>= min_channels`` (grouped and masked convs are left alone), and
    either only when the factorization at the chosen rank has fewer weights than the original.
    The defaults are those of Composer's ``apply_factorization`` (512 / 0.25); the :class:`Factorize`
    algorithm's are 256 / 0.25 for convs and 256 / 128 for linears, as Composer's class.

    Example:
        >>> model = nnx.Sequential(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(16, 2, rngs=nnx.Rngs(1)))
        >>> apply_factorization(model, min_features=8, latent_features=0.25)
        1
        >>> model.layers[0].latent_features
        4
    """
    _validate(factorize_convs, factorize_linears, min_channels, latent_channels, min_features, latent_features)
    counts = _factorize(model, factorize_convs, factorize_linears, min_channels, latent_channels, min_features,
                        latent_features)
    return counts["linear"] + counts["conv"]


def _validate(factorize_convs: Any, factorize_linears: Any, min_channels: Any, latent_channels: Any,
              min_features: Any, latent_features: Any) -> None:
    for name, value in (("factorize_convs", factorize_convs), ("factorize_linears", factorize_linears)):
        if not isinstance(value, bool):
            raise ValueError(f"{name}={value!r}: expected True or False")
    for name, value in (("min_channels", min_channels), ("min_features", min_features)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected a positive integer")
    for name, value in (("latent_channels", latent_channels), ("latent_features", latent_features)):
        fraction = isinstance(value, float) and 0 < value < 1
        count = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        if not (fraction or count):
            raise ValueError(f"{name}={value!r}: expected a fraction in (0, 1) of min(in, out) or an integer >= 1")


class Factorize(Algorithm):
    """Split large Linear and Conv layers into two low-rank layers at INIT (SVD-initialised).

    Runs once at ``Event.INIT`` (host): model surgery on ``state.model`` before its parameters are
    placed, so the optimizer state is built for the factorized layers. Logs the number of
    replacements as ``factorize/num_linear_replacements`` and ``factorize/num_conv_replacements``.

    Args:
        factorize_convs: factorize ``nnx.Conv`` layers.
        factorize_linears: factorize ``nnx.Linear`` layers.
        min_channels: leave convs with fewer input or output channels alone.
        latent_channels: bottleneck channels: a float in (0, 1) is a fraction of ``min(in, out)``
            (at least 1), an integer >= 1 the rank itself.
        min_features: leave linears with fewer input or output features alone.
        latent_features: bottleneck features, as ``latent_channels`` (Composer's default: 128 features).

    Example::

        trainer = Trainer(model, loader, '1ep', algorithms=[Factorize(min_features=512, latent_features=0.25)])
    """

    required_modules = (nnx.Linear, nnx.Conv)

    def __init__(
        self,
        factorize_convs: bool = True,
        factorize_linears: bool = True,
        min_channels: int = 256,
        latent_channels: int | float = 0.25,
        min_features: int = 256,
        latent_features: int | float = 128,
    ) -> None:
        _validate(factorize_convs, factorize_linears, min_channels, latent_channels, min_features, latent_features)
        self.factorize_convs = factorize_convs
        self.factorize_linears = factorize_linears
        self.min_channels = min_channels
        self.latent_channels = latent_channels
        self.min_features = min_features
        self.latent_features = latent_features

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        counts = _factorize(state.model, self.factorize_convs, self.factorize_linears, self.min_channels,
                            self.latent_channels, self.min_features, self.latent_features)
        logger.log_hyperparameters({
            "factorize/num_linear_replacements": counts["linear"],
            "factorize/num_conv_replacements": counts["conv"],
        })
        if counts["linear"] + counts["conv"] == 0:
            warnings.warn("Factorize had no effect: no Linear or Conv layer is large enough (min_features="
                          f"{self.min_features}, min_channels={self.min_channels}) to gain from factorization",
                          UserWarning, stacklevel=2)

    def __repr__(self) -> str:
        return (f"Factorize(factorize_convs={self.factorize_convs}, factorize_linears={self.factorize_linears}, "
                f"min_channels={self.min_channels}, latent_channels={self.latent_channels}, "
                f"min_features={self.min_features}, latent_features={self.latent_features})")
