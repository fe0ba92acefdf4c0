"""AugMix: blend each image with a weighted mix of several random augmentation chains, inside the train step.

Hendrycks et al., 2020, "AugMix: A Simple Data Processing Method to Improve Robustness and
Uncertainty". ``width`` chains of 1..3 (or ``depth``) random augmentations are mixed with
Dirichlet(alpha) weights, and the mix is blended with the original image with a Beta(alpha, alpha)
weight. Unlike Composer, which adds a PIL transform to the dataset, this version augments the batch
on the device at ``BEFORE_FORWARD``, with per-image random choices drawn from ``state.step_rng``.
The paper's Jensen-Shannon consistency loss is not part of it.
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

__all__ = ["AugMix", "augmix_batch", "augmix_image", "mix_augmented"]

_MAX_RANDOM_DEPTH = 3


def _check_arguments(depth: int, width: int, alpha: float) -> tuple[int, int, float]:
    if isinstance(depth, bool) or not isinstance(depth, int) or not (depth == -1 or depth >= 1):
        raise ValueError(f"depth={depth!r}: expected an integer >= 1, or -1 for a random depth in 1..3 per chain")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width={width!r}: expected an integer >= 1 (the number of augmentation chains)")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise ValueError(f"alpha={alpha!r}: expected a number > 0 (the Dirichlet and Beta concentration)")
    return depth, width, float(alpha)


def mix_augmented(image: jax.Array, augmented: jax.Array, chain_weights: jax.Array,
                  mixing_weight: jax.Array | float) -> jax.Array:
    """Return ``(1 - m) * image + m * sum_i w_i * augmented[i]`` for ``m = mixing_weight``, ``w = chain_weights``.

    Args:
        image: the original image.
        augmented: ``(width, *image.shape)``: one augmented copy per chain.
        chain_weights: ``(width,)`` weights of the chains (a Dirichlet draw in AugMix).
        mixing_weight: the weight of the mix against the original; 0 returns the original.

    Example:
        >>> image = jnp.zeros((2, 2))
        >>> mix_augmented(image, jnp.ones((2, 2, 2)), jnp.array([0.5, 0.5]), 0.25).tolist()
        [[0.25, 0.25], [0.25, 0.25]]
    """
    mix = jnp.tensordot(jnp.asarray(chain_weights, augmented.dtype), augmented, axes=1)
    return (1.0 - mixing_weight) * image + mixing_weight * mix


def augmix_image(image: jax.Array, rng: jax.Array, severity: float = 3, depth: int = -1, width: int = 3,
                 alpha: float = 1.0, augmentation_set: str | Sequence[Augmentation] = "all") -> jax.Array:
    """AugMix one float image in [0, 1].

    Args:
        image: one image, ``(H, W)`` or ``(H, W, C)``, values in [0, 1].
        rng: a JAX PRNG key; the same key gives the same result.
        severity: the strongest intensity of each augmentation, on Composer's 0..10 scale.
        depth: augmentations per chain; -1 draws 1..3 uniformly for each chain.
        width: the number of chains mixed.
        alpha: the concentration of the Dirichlet (chain weights) and Beta (blend weight) draws;
            small values make one chain / one side dominate.
        augmentation_set: ``'all'``, ``'safe'``, ``'original'`` or a sequence of ``Augmentation``.

    Returns:
        The mixed image, same shape and dtype, values in [0, 1].

    Example:
        >>> image = jnp.linspace(0.0, 1.0, 64).reshape(8, 8)
        >>> augmix_image(image, jax.random.key(0), severity=3, width=3).shape
        (8, 8)
    """
    augmentations = resolve_augmentation_set(augmentation_set)
    severity = check_severity(severity)
    depth, width, alpha = _check_arguments(depth, width, alpha)
    image = jnp.asarray(image)
    if image.ndim not in (2, 3):
        raise ValueError(f"augmix_image: image of shape {image.shape}; expected (H, W) or (H, W, C)")
    draws = _draw(rng, (), depth, width, alpha)
    return _augmix_drawn(image, *draws, severity=severity, depth=depth, augmentations=augmentations)


def augmix_batch(images: jax.Array, rng: jax.Array, severity: float = 3, depth: int = -1, width: int = 3,
                 alpha: float = 1.0, augmentation_set: str | Sequence[Augmentation] = "all") -> jax.Array:
    """AugMix each image of an ``(N, H, W)`` or ``(N, H, W, C)`` batch with its own random choices.

    Example:
        >>> images = jnp.full((4, 8, 8, 3), 0.5)
        >>> augmix_batch(images, jax.random.key(0)).shape
        (4, 8, 8, 3)
    """
    augmentations = resolve_augmentation_set(augmentation_set)
    severity = check_severity(severity)
    depth, width, alpha = _check_arguments(depth, width, alpha)
    images = jnp.asarray(images)
    if images.ndim not in (3, 4):
        raise ValueError(f"augmix_batch: images of shape {images.shape}; expected (N, H, W) or (N, H, W, C)")
    draws = _draw(rng, (images.shape[0],), depth, width, alpha)
    return jax.vmap(lambda image, *image_draws: _augmix_drawn(
        image, *image_draws, severity=severity, depth=depth, augmentations=augmentations))(images, *draws)


def _steps(depth: int) -> int:
    return _MAX_RANDOM_DEPTH if depth == -1 else depth


def _draw(rng: jax.Array, batch_shape: tuple[int, ...], depth: int, width: int, alpha: float
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(chain_weights, mixing_weight, chain_draws)`` for ``batch_shape`` images, in as few random calls as possible.

    Dirichlet(alpha) chain weights and the Beta(alpha, alpha) blend weight come from ``width + 2``
    Gamma(alpha) variables (normalized; ``g1 / (g1 + g2)``); for alpha = 1 those are exponentials,
    drawn with the same uniform call as the augmentations (each random call site costs compile time).
    """
    per_chain = 1 + _steps(depth) * (1 + DRAWS_PER_AUGMENTATION)
    if alpha == 1.0:
        uniforms = jax.random.uniform(rng, (*batch_shape, width * per_chain + width + 2), jnp.float32)
        log_gammas = jnp.log(-jnp.log1p(-uniforms[..., :width + 2]))
        uniforms = uniforms[..., width + 2:]
    else:
        gamma_key, uniform_key = jax.random.split(rng)
        log_gammas = jax.random.loggamma(gamma_key, alpha, (*batch_shape, width + 2), jnp.float32)
        uniforms = jax.random.uniform(uniform_key, (*batch_shape, width * per_chain), jnp.float32)
    # In log space, so that tiny Gamma draws (small alpha) cannot divide zero by zero.
    chain_weights = jax.nn.softmax(log_gammas[..., :width], axis=-1)
    mixing_weight = jax.nn.sigmoid(log_gammas[..., width] - log_gammas[..., width + 1])
    return chain_weights, mixing_weight, uniforms.reshape((*batch_shape, width, per_chain))


def _augmix_drawn(image: jax.Array, chain_weights: jax.Array, mixing_weight: jax.Array, chain_draws: jax.Array,
                  *, severity: float, depth: int, augmentations: Sequence[Augmentation]) -> jax.Array:
    """AugMix one image given its weights and ``(width, 1 + steps * (1 + DRAWS_PER_AUGMENTATION))`` draws."""
    hwc = (image[..., None] if image.ndim == 2 else image).astype(jnp.float32)
    steps = _steps(depth)

    def chain(draws: jax.Array) -> jax.Array:
        if depth == -1:
            chain_depth = 1 + jnp.minimum(jnp.floor(draws[0] * _MAX_RANDOM_DEPTH), _MAX_RANDOM_DEPTH - 1)
        else:
            chain_depth = depth

        def augment(current: jax.Array, indexed_draws: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            index, step_draws = indexed_draws
            augmented = apply_random_augmentation(current, step_draws, severity, augmentations)
            return jnp.where(index < chain_depth, augmented, current), None

        out, _ = jax.lax.scan(augment, hwc, (jnp.arange(steps), draws[1:].reshape(steps, -1)))
        return out

    augmented = jax.vmap(chain)(chain_draws)
    out = jnp.clip(mix_augmented(hwc, augmented, chain_weights, mixing_weight), 0.0, 1.0)
    out = out[..., 0] if image.ndim == 2 else out
    return out.astype(image.dtype) if jnp.issubdtype(image.dtype, jnp.floating) else out


class AugMix(Algorithm):
    """Replace every training image by its AugMix at ``BEFORE_FORWARD`` (traced).

    Images must be floats in [0, 1], ``(N, H, W)`` or ``(N, H, W, C)``; normalize after this (in the
    model) rather than in the data. Eval and predict batches are left alone.

    Args:
        severity: the strongest intensity of each augmentation, 0..10. Default: 3.
        depth: augmentations per chain; -1 draws 1..3 per chain. Default: -1.
        width: the number of chains mixed. Default: 3.
        alpha: Dirichlet / Beta concentration, > 0. Default: 1.0.
        augmentation_set: ``'all'``, ``'safe'`` (leaves out the ops that overlap ImageNet-C /
            CIFAR-10-C corruptions) or ``'original'`` (the AugMix repository's enhancement ranges).
            Default: ``'all'``.
        input_key: where the images are in the batch (``state.batch_get_item`` key). Default: 0.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.augmix import AugMix

        trainer = Trainer(model, train_loader, "10ep", optax.adam(1e-3),
                          algorithms=[AugMix(severity=3, depth=-1, width=3, alpha=1.0)])
    """

    def __init__(self, severity: float = 3, depth: int = -1, width: int = 3, alpha: float = 1.0,
                 augmentation_set: str = "all", input_key: int | str = 0) -> None:
        self.severity = check_severity(severity)
        self.depth, self.width, self.alpha = _check_arguments(depth, width, alpha)
        self.augmentation_set, self.input_key = check_augmentation_arguments(augmentation_set, input_key)

    events = frozenset({Event.BEFORE_FORWARD})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        images = state.batch_get_item(self.input_key)
        key = batch_key(state.step_rng, self.name, images)
        state.batch_set_item(self.input_key, augmix_batch(
            images, key, self.severity, self.depth, self.width, self.alpha, self.augmentation_set))

    def __repr__(self) -> str:
        return (f"AugMix(severity={self.severity:g}, depth={self.depth}, width={self.width}, alpha={self.alpha!r}, "
                f"augmentation_set={self.augmentation_set!r}, input_key={self.input_key!r})")
