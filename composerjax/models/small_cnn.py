"""A small CNN for 8x8 (digits) or 28x28 single-channel images."""

from __future__ import annotations

import jax
from flax import nnx

__all__ = ["SmallCNN"]


class SmallCNN(nnx.Module):
    """Two 3x3 conv layers with batch norm, 2x2 average pooling and a two-layer classifier head.

    Takes ``(N, H, W)`` or ``(N, H, W, C)`` images and returns ``(N, num_classes)`` logits.

    Example:
        >>> import jax.numpy as jnp
        >>> SmallCNN(num_classes=10, rngs=nnx.Rngs(0))(jnp.zeros((2, 8, 8))).shape
        (2, 10)
    """

    def __init__(
        self, num_classes: int = 10, channels: int = 32, in_channels: int = 1, image_size: int = 8, *, rngs: nnx.Rngs
    ) -> None:
        self.conv1 = nnx.Conv(in_channels, channels, (3, 3), rngs=rngs)
        self.norm1 = nnx.BatchNorm(channels, rngs=rngs)
        self.conv2 = nnx.Conv(channels, 2 * channels, (3, 3), rngs=rngs)
        self.norm2 = nnx.BatchNorm(2 * channels, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        pooled = (image_size // 2) ** 2 * 2 * channels
        self.hidden = nnx.Linear(pooled, 128, rngs=rngs)
        self.head = nnx.Linear(128, num_classes, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        if x.ndim == 3:
            x = x[..., None]
        x = nnx.relu(self.norm1(self.conv1(x)))
        x = nnx.relu(self.norm2(self.conv2(x)))
        x = nnx.avg_pool(x, (2, 2), strides=(2, 2)).reshape((x.shape[0], -1))
        return self.head(self.dropout(nnx.relu(self.hidden(x))))
