"""RandAugment: apply ``depth`` image augmentations, each chosen uniformly at random, inside the train step.

Cubuk et al., 2020, "RandAugment: Practical automated data augmentation with a reduced search space".
Unlike Composer, which adds a PIL transform to the dataset, this version augments the batch on the
device at ``BEFORE_FORWARD``, with per-image random choices drawn from ``state.step_rng``.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from composerjax import Algorithm, Event, Logger, State

from .augmentation_ops import (
    DRAWS_PER_AUGMENTATION,
    Augmentation,
    apply_random_augmentation,
    batch_key,
    check_augmentation_arguments,
    check_severity,
    resolve_augmentation_set,
)

__all__ = ["RandAugment", "randaugment_batch", "randaugment_image"]


def _check_depth(depth: int) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth={depth!r}: expected an integer >= 1 (the number of augmentations per image)")
    return depth


def randaugment_image(image: jax.Array, rng: jax.Array, depth: int = 2, severity: float = 9,
                      augmentation_set: str | Sequence[Augmentation] = "all") -> jax.Array:
    """RandAugment one float image in [0, 1]: ``depth`` augmentations in a row, each picked uniformly.

    Args:
        image: one image, ``(H, W)`` or ``(H, W, C)``, values in [0, 1].
        rng: a JAX PRNG key; the same key gives the same augmentations.
        depth: the number of augmentations applied in a row (N in the paper).
        severity: the strongest intensity, on Composer's 0..10 scale (M in the paper); each
            augmentation draws its intensity uniformly up to it.
        augmentation_set: ``'all'``, ``'safe'``, ``'original'`` (see ``AUGMENTATION_SETS``) or a
            sequence of ``Augmentation``.

    Returns:
        The augmented image, same shape and dtype, values in [0, 1].

    Example:
        >>> image = jnp.linspace(0.0, 1.0, 64).reshape(8, 8)
        >>> randaugment_image(image, jax.random.key(0), depth=2, severity=9).shape
        (8, 8)
    """
    augmentations = resolve_augmentation_set(augmentation_set)
    severity, depth = check_severity(severity), _check_depth(depth)
    image = jnp.asarray(image)
    if image.ndim not in (2, 3):
        raise ValueError(f"randaugment_image: image of shape {image.shape}; expected (H, W) or (H, W, C)")
    draws = jax.random.uniform(rng, (depth, 1 + DRAWS_PER_AUGMENTATION), jnp.float32)
    return _randaugment_drawn(image, draws, severity, augmentations)


def randaugment_batch(images: jax.Array, rng: jax.Array, depth: int = 2, severity: float = 9,
                      augmentation_set: str | Sequence[Augmentation] = "all") -> jax.Array:
    """RandAugment each image of an ``(N, H, W)`` or ``(N, H, W, C)`` batch with its own random choices.

    Example:
        >>> images = jnp.full((4, 8, 8, 3), 0.5)
        >>> randaugment_batch(images, jax.random.key(0)).shape
        (4, 8, 8, 3)
    """
    augmentations = resolve_augmentation_set(augmentation_set)
    severity, depth = check_severity(severity), _check_depth(depth)
    images = jnp.asarray(images)
    if images.ndim not in (3, 4):
        raise ValueError(f"randaugment_batch: images of shape {images.shape}; expected (N, H, W) or (N, H, W, C)")
    # One random call for the whole batch: each call site costs compile time, whatever its size.
    draws = jax.random.uniform(rng, (images.shape[0], depth, 1 + DRAWS_PER_AUGMENTATION), jnp.float32)
    return jax.vmap(lambda image, image_draws: _randaugment_drawn(image, image_draws, severity, augmentations))(
        images, draws)


def _randaugment_drawn(image: jax.Array, draws: jax.Array, severity: float,
                       augmentations: Sequence[Augmentation]) -> jax.Array:
    """RandAugment one image given its ``(depth, 1 + DRAWS_PER_AUGMENTATION)`` uniform draws."""
    hwc = (image[..., None] if image.ndim == 2 else image).astype(jnp.float32)

    def augment(current: jax.Array, step_draws: jax.Array) -> tuple[jax.Array, None]:
        return apply_random_augmentation(current, step_draws, severity, augmentations), None

    out, _ = jax.lax.scan(augment, hwc, draws)
    out = jnp.clip(out[..., 0] if image.ndim == 2 else out, 0.0, 1.0)
    return out.astype(image.dtype) if jnp.issubdtype(image.dtype, jnp.floating) else out


class RandAugment(Algorithm):
    """Augment every training image with ``depth`` random augmentations at ``BEFORE_FORWARD`` (traced).

    Images must be floats in [0, 1], ``(N, H, W)`` or ``(N, H, W, C)``; normalize after this (in the
    model) rather than in the data. Eval and predict batches are left alone.

    Args:
        severity: the strongest intensity, 0..10 (M in the paper). Default: 9.
        depth: augmentations applied in a row to each image (N in the paper). Default: 2.
        augmentation_set: ``'all'``, ``'safe'`` (leaves out the ops that overlap ImageNet-C /
            CIFAR-10-C corruptions) or ``'original'`` (the AugMix repository's enhancement ranges).
            Default: ``'all'``.
        input_key: where the images are in the batch (``state.batch_get_item`` key). Default: 0.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.randaugment import RandAugment

        trainer = Trainer(model, train_loader, "10ep", optax.adam(1e-3),
                          algorithms=[RandAugment(severity=9, depth=2, augmentation_set="all")])
    """

    def __init__(self, severity: float = 9, depth: int = 2, augmentation_set: str = "all",
                 input_key: int | str = 0) -> None:
        self.severity = check_severity(severity)
        self.depth = _check_depth(depth)
        self.augmentation_set, self.input_key = check_augmentation_arguments(augmentation_set, input_key)

    events = frozenset({Event.BEFORE_FORWARD})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        images = state.batch_get_item(self.input_key)
        key = batch_key(state.step_rng, self.name, images)
        state.batch_set_item(self.input_key, randaugment_batch(
            images, key, self.depth, self.severity, self.augmentation_set))

    def __repr__(self) -> str:
        return (f"RandAugment(severity={self.severity:g}, depth={self.depth}, "
                f"augmentation_set={self.augmentation_set!r}, input_key={self.input_key!r})")
