"""A small ResNet-style CNN: enough structure (convs, batch norm, residual blocks) for surgery."""

from __future__ import annotations

import jax
from flax import nnx

__all__ = ["BasicBlock", "SmallResNet"]


class BasicBlock(nnx.Module):
    """Two 3x3 convs with batch norm and a residual connection (1x1 conv when channels change)."""

    def __init__(self, in_channels: int, channels: int, stride: int = 1, *, rngs: nnx.Rngs) -> None:
        self.conv1 = nnx.Conv(in_channels, channels, (3, 3), strides=stride, use_bias=False, rngs=rngs)
        self.norm1 = nnx.BatchNorm(channels, rngs=rngs)
        self.conv2 = nnx.Conv(channels, channels, (3, 3), use_bias=False, rngs=rngs)
        self.norm2 = nnx.BatchNorm(channels, rngs=rngs)
        self.shortcut = (
            nnx.Conv(in_channels, channels, (1, 1), strides=stride, use_bias=False, rngs=rngs)
            if stride != 1 or in_channels != channels
            else None
        )

    def residual(self, x: jax.Array) -> jax.Array:
        """The block's residual branch (what stochastic depth drops)."""
        return self.norm2(self.conv2(nnx.relu(self.norm1(self.conv1(x)))))

    def __call__(self, x: jax.Array) -> jax.Array:
        identity = x if self.shortcut is None else self.shortcut(x)
        return nnx.relu(identity + self.residual(x))


class SmallResNet(nnx.Module):
    """Stem conv, two residual stages, global average pooling and a linear classifier.

    Takes ``(N, H, W)`` or ``(N, H, W, C)`` images, returns ``(N, num_classes)`` logits.

    Example:
        >>> import jax.numpy as jnp
        >>> SmallResNet(num_classes=10, rngs=nnx.Rngs(0))(jnp.zeros((2, 8, 8))).shape
        (2, 10)
    """

    def __init__(self, num_classes: int = 10, width: int = 16, in_channels: int = 1, *, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Conv(in_channels, width, (3, 3), use_bias=False, rngs=rngs)
        self.stem_norm = nnx.BatchNorm(width, rngs=rngs)
        self.blocks = nnx.List([
            BasicBlock(width, width, rngs=rngs),
            BasicBlock(width, 2 * width, stride=2, rngs=rngs),
        ])
        self.head = nnx.Linear(2 * width, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        x = nnx.relu(self.stem_norm(self.stem(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(axis=(1, 2)))
