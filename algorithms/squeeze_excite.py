"""Squeeze-and-Excitation: rescale a conv's output channels by gates computed from its global average.

Surgery at ``Event.INIT`` (Hu et al., 2018): each ``nnx.Conv`` with enough channels becomes a
:class:`SqueezeExciteConv` that holds the original conv unchanged, followed by a new
:class:`SqueezeExcite2d` block: global average pool -> Linear(C, latent) -> relu -> Linear(latent, C)
-> sigmoid -> multiply each channel by its gate.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models.surgery import replace_modules

__all__ = ["SqueezeExcite", "SqueezeExcite2d", "SqueezeExciteConv", "apply_squeeze_excite", "latent_width"]


def latent_width(channels: int, latent_channels: float) -> int:
    """The hidden width of the gate MLP: ``latent_channels``, or that fraction of ``channels`` if below 1.

    Example:
        >>> latent_width(256, 64), latent_width(256, 0.25), latent_width(2, 0.1)
        (64, 64, 1)
    """
    if latent_channels < 1:
        return max(1, int(latent_channels * channels))
    return int(latent_channels)


class SqueezeExcite2d(nnx.Module):
    """Gate the channels of ``(N, ..., C)`` activations by an MLP of their spatial mean.

    Args:
        num_features: the number of channels ``C``.
        latent_channels: the MLP's hidden width, or a fraction of ``C`` if below 1.
        rngs: initialises the two ``nnx.Linear`` layers.

    Example:
        >>> se = SqueezeExcite2d(8, 0.5, rngs=nnx.Rngs(0))
        >>> se.squeeze.out_features, se(jnp.ones((2, 4, 4, 8))).shape
        (4, (2, 4, 4, 8))
    """

    def __init__(self, num_features: int, latent_channels: float = 64, *, rngs: nnx.Rngs) -> None:
        latent = latent_width(num_features, latent_channels)
        # Without biases, as Composer's SqueezeExcite2d.
        self.squeeze = nnx.Linear(num_features, latent, use_bias=False, rngs=rngs)
        self.excite = nnx.Linear(latent, num_features, use_bias=False, rngs=rngs)

    def gates(self, x: jax.Array) -> jax.Array:
        """The ``(N, C)`` channel gates in (0, 1) for activations ``x`` of shape ``(N, ..., C)``."""
        pooled = jnp.mean(x, axis=tuple(range(1, x.ndim - 1)))
        return nnx.sigmoid(self.excite(nnx.relu(self.squeeze(pooled))))

    def __call__(self, x: jax.Array) -> jax.Array:
        gates = self.gates(x)
        return x * gates.reshape((x.shape[0],) + (1,) * (x.ndim - 2) + (x.shape[-1],)).astype(x.dtype)


class SqueezeExciteConv(nnx.Module):
    """An ``nnx.Conv`` (kept unchanged as ``conv``) followed by a :class:`SqueezeExcite2d` (``se``)."""

    def __init__(self, conv: nnx.Conv, latent_channels: float = 64, *, rngs: nnx.Rngs) -> None:
        self.conv = conv
        self.se = SqueezeExcite2d(conv.out_features, latent_channels, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.se(self.conv(x))


def apply_squeeze_excite(model: nnx.Module, latent_channels: float = 64, min_channels: int = 128,
                         rngs: nnx.Rngs | int = 0) -> int:
    """Add an SE block after every ``nnx.Conv`` of ``model`` with ``min(in, out) >= min_channels``; return how many.

    The convs keep their weights (each is wrapped, not rebuilt); the SE blocks are initialised from
    ``rngs`` (an ``nnx.Rngs`` or a seed). Convs already followed by an SE block are left alone.

    Example:
        >>> from composerjax.models import SmallResNet
        >>> apply_squeeze_excite(SmallResNet(width=4, rngs=nnx.Rngs(0)), latent_channels=0.5, min_channels=8)
        1
    """
    _check_arguments(latent_channels, min_channels)
    rngs = rngs if isinstance(rngs, nnx.Rngs) else nnx.Rngs(rngs)
    already_wrapped = {id(module.conv) for _, module in nnx.iter_modules(model)
                       if isinstance(module, SqueezeExciteConv)}
    replaced = 0

    def add_squeeze_excite(conv: nnx.Conv) -> nnx.Module:
        nonlocal replaced
        if min(conv.in_features, conv.out_features) < min_channels or id(conv) in already_wrapped:
            return conv
        replaced += 1
        return SqueezeExciteConv(conv, latent_channels, rngs=rngs)

    replace_modules(model, {nnx.Conv: add_squeeze_excite})
    return replaced


class SqueezeExcite(Algorithm):
    """Add Squeeze-and-Excitation blocks after the wide convs of the model, at ``Event.INIT``.

    Args:
        latent_channels: hidden width of each SE block's MLP, or a fraction of the conv's output
            channels if below 1.
        min_channels: only convs with ``min(in_features, out_features) >= min_channels`` get a block
            (SE blocks cost least deep in the network, where channels are many and images small).
        seed: initialises the new layers; ``None`` derives it from the trainer's ``seed``.

    Example::

        trainer = Trainer(ComposerClassifier(SmallResNet(width=64, rngs=nnx.Rngs(0)), 10), loader, '1ep',
                          algorithms=[SqueezeExcite(latent_channels=64, min_channels=128)])
    """

    required_modules = (nnx.Conv,)

    def __init__(self, latent_channels: float = 64, min_channels: int = 128, seed: int | None = None) -> None:
        _check_arguments(latent_channels, min_channels)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"seed={seed!r}: expected an integer or None (derive it from the trainer's seed)")
        self.latent_channels = latent_channels
        self.min_channels = min_channels
        self.seed = seed

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        # fold_in leaves state.rng as it is, so adding this algorithm changes no other random stream.
        key = jax.random.key(self.seed) if self.seed is not None else jax.random.fold_in(state.rng, 0x5E)
        replaced = apply_squeeze_excite(state.model, self.latent_channels, self.min_channels, nnx.Rngs(key))
        logger.log_hyperparameters({"squeeze_excite/num_replaced": replaced})
        if replaced == 0:
            warnings.warn(f"SqueezeExcite added no blocks: the model has no nnx.Conv with "
                          f"min(in_features, out_features) >= min_channels={self.min_channels}", stacklevel=2)

    def __repr__(self) -> str:
        return f"SqueezeExcite(latent_channels={self.latent_channels}, min_channels={self.min_channels})"


def _check_arguments(latent_channels: float, min_channels: int) -> None:
    if isinstance(latent_channels, bool) or not isinstance(latent_channels, (int, float)) or not latent_channels > 0:
        raise ValueError(f"latent_channels={latent_channels!r}: expected a width >= 1 or a fraction in (0, 1)")
    if latent_channels >= 1 and latent_channels != int(latent_channels):
        raise ValueError(f"latent_channels={latent_channels!r}: a width >= 1 must be a whole number")
    if isinstance(min_channels, bool) or not isinstance(min_channels, int) or min_channels < 0:
        raise ValueError(f"min_channels={min_channels!r}: expected an integer >= 0")
