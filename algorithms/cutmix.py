"""CutMix: paste a random box from a paired example into each image and mix the targets by area.

The functional forms are :func:`cutmix_sample` (draw the box with :func:`cutmix_box`, and the
pairing), :func:`cutmix_batch` (paste the box; returns the exact kept-area fraction) and
:func:`cutmix_targets`; :class:`CutMix` applies them inside the compiled train step with the step's
random key. Shapes never depend on the box: the box is a mask built with comparisons, so one
compile serves every draw.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from composerjax import State
from composerjax.algorithms.mixing import BatchMixing, mix_dense_targets

__all__ = ["CutMix", "box_mask", "cutmix_batch", "cutmix_box", "cutmix_sample", "cutmix_targets"]


@functools.partial(jax.jit, static_argnames=("batch_size", "height", "width", "alpha", "uniform_sampling"))
def cutmix_sample(
    rng: jax.Array, batch_size: int, height: int, width: int, alpha: float = 1.0, uniform_sampling: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Draw ``(bbox, indices)``: the box to paste and the partner of each example.

    ``lambda ~ Beta(alpha, alpha)`` is the box's nominal kept area, the box is
    :func:`cutmix_box` of it, and ``indices`` is a random permutation of the batch.

    Args:
        rng: a JAX random key.
        batch_size: the number of examples.
        height: the images' height (axis 1).
        width: the images' width (axis 2).
        alpha: the Beta distribution's concentration, ``> 0``.
        uniform_sampling: sample the centre so every pixel is equally likely to be in the box.

    Returns:
        ``bbox`` (int32 ``[top, left, bottom, right]``, half-open) and ``indices`` (int32,
        ``(batch_size,)``).

    Example:
        >>> bbox, indices = cutmix_sample(jax.random.key(0), batch_size=4, height=8, width=8)
        >>> bbox.shape, sorted(indices.tolist())
        ((4,), [0, 1, 2, 3])
    """
    beta_key, box_key, permutation_key = jax.random.split(rng, 3)
    cutmix_lambda = jax.random.beta(beta_key, alpha, alpha, dtype=jnp.float32)
    bbox = cutmix_box(box_key, height, width, cutmix_lambda, uniform_sampling)
    indices = jax.random.permutation(permutation_key, batch_size).astype(jnp.int32)
    return bbox, indices


@functools.partial(jax.jit, static_argnames=("height", "width", "uniform_sampling"))
def cutmix_box(
    rng: jax.Array, height: int, width: int, cutmix_lambda: jax.Array | float, uniform_sampling: bool = False
) -> jax.Array:
    """Draw a box of nominal area ``1 - cutmix_lambda``: int32 ``[top, left, bottom, right]`` (half-open).

    Its sides are ``cut_h = floor(H * sqrt(1 - lambda))`` and ``cut_w = floor(W * sqrt(1 - lambda))``;
    it spans ``cut // 2`` either side of a random centre, uniform over the image (as in the paper)
    or, with ``uniform_sampling``, over the image grown by half a box on every side, so every pixel
    is equally likely to be covered. It is clipped to the image, so its real area may be smaller:
    :func:`cutmix_batch` returns the exact one.

    Example:
        >>> bbox = cutmix_box(jax.random.key(0), 8, 8, cutmix_lambda=0.75)
        >>> bool((bbox[2] - bbox[0]) <= 4 and (bbox[3] - bbox[1]) <= 4)
        True
    """
    row_key, col_key = jax.random.split(rng)
    cut_ratio = jnp.sqrt(1.0 - jnp.asarray(cutmix_lambda, jnp.float32))
    cut_h = jnp.floor(height * cut_ratio).astype(jnp.int32)
    cut_w = jnp.floor(width * cut_ratio).astype(jnp.int32)
    if uniform_sampling:
        center_y = jax.random.randint(row_key, (), (-cut_h) // 2, height + cut_h // 2)
        center_x = jax.random.randint(col_key, (), (-cut_w) // 2, width + cut_w // 2)
    else:
        center_y = jax.random.randint(row_key, (), 0, height)
        center_x = jax.random.randint(col_key, (), 0, width)
    return jnp.stack([
        jnp.clip(center_y - cut_h // 2, 0, height),
        jnp.clip(center_x - cut_w // 2, 0, width),
        jnp.clip(center_y + cut_h // 2, 0, height),
        jnp.clip(center_x + cut_w // 2, 0, width),
    ]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("height", "width"))
def box_mask(bbox: jax.Array, height: int, width: int) -> jax.Array:
    """A ``(height, width)`` bool mask, True inside the half-open box ``[top, left, bottom, right]``.

    Example:
        >>> box_mask(jnp.array([1, 0, 2, 2]), 3, 3).astype(int).tolist()
        [[0, 0, 0], [1, 1, 0], [0, 0, 0]]
    """
    rows = jnp.arange(height)[:, None]
    cols = jnp.arange(width)[None, :]
    top, left, bottom, right = bbox[0], bbox[1], bbox[2], bbox[3]
    return (rows >= top) & (rows < bottom) & (cols >= left) & (cols < right)


@jax.jit
def cutmix_batch(
    input: jax.Array, target: jax.Array, bbox: jax.Array, indices: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Paste ``input[indices]`` inside ``bbox`` into every image; return the kept-area fraction.

    Images are ``(N, H, W)`` or ``(N, H, W, C)`` (any trailing axes follow ``W``).

    Args:
        input: the batch of images.
        target: the batch's targets (examples on the first axis).
        bbox: ``[top, left, bottom, right]`` (half-open), e.g. from :func:`cutmix_sample`.
        indices: the partner of each example.

    Returns:
        ``mixed`` (the images with the box pasted from their partners), ``target[indices]`` and
        ``adjusted_lambda = 1 - box_area / (H * W)`` (float32): the exact weight of each image's own
        target.

    Example:
        >>> images = jnp.stack([jnp.zeros((2, 2)), jnp.ones((2, 2))])
        >>> mixed, permuted, lam = cutmix_batch(images, jnp.array([0, 1]), jnp.array([0, 0, 1, 1]), jnp.array([1, 0]))
        >>> mixed[0].tolist(), permuted.tolist(), float(lam)
        ([[1.0, 0.0], [0.0, 0.0]], [1, 0], 0.75)
    """
    if input.ndim < 3:
        raise ValueError(f"cutmix_batch: input has shape {input.shape}; expected images (N, H, W) or (N, H, W, C)")
    height, width = input.shape[1], input.shape[2]
    mask = box_mask(bbox, height, width).reshape((1, height, width) + (1,) * (input.ndim - 3))
    mixed = jnp.where(mask, input[indices], input)
    area = (bbox[2] - bbox[0]) * (bbox[3] - bbox[1])
    adjusted_lambda = 1.0 - area.astype(jnp.float32) / (height * width)
    return mixed, target[indices], adjusted_lambda


def cutmix_targets(
    target: jax.Array, adjusted_lambda: jax.Array | float, indices: jax.Array, num_classes: int | None = None
) -> jax.Array:
    """Return ``adjusted_lambda * y + (1 - adjusted_lambda) * y[indices]`` with ``y`` the dense targets.

    Integer labels are one-hot encoded to ``num_classes`` first; floating targets are used as they are.

    Raises:
        ValueError: integer labels without ``num_classes``.

    Example:
        >>> cutmix_targets(jnp.array([0, 1]), 0.75, jnp.array([1, 0]), num_classes=2).tolist()
        [[0.75, 0.25], [0.25, 0.75]]
    """
    return mix_dense_targets(target, adjusted_lambda, indices, num_classes, "cutmix_targets")


class CutMix(BatchMixing):
    """Train on images with a random box replaced by the same box of a paired image from the batch.

    Runs inside the compiled step. At ``BEFORE_FORWARD`` it draws ``(bbox, indices)`` with
    :func:`cutmix_sample` from the step's key (``state.step_rng``) and pastes the box from each
    image's partner (:func:`cutmix_batch`); the same box is used for the whole batch. The targets'
    weight is the exact kept area ``adjusted_lambda = 1 - box_area / (H * W)``. Then either

    * ``interpolate_loss=False``: at ``BEFORE_LOSS`` the targets become
      ``adjusted_lambda * y + (1 - adjusted_lambda) * y[indices]`` (integer labels one-hot encoded
      over the logits' last dimension, or ``num_classes``). Targets with the images' height and
      width (segmentation masks) get the box pasted instead, or
    * ``interpolate_loss=True``: at ``BEFORE_BACKWARD`` the loss becomes
      ``adjusted_lambda * loss(y) + (1 - adjusted_lambda) * loss(y[indices])`` with the model's own
      ``loss`` (a ComposerModel's). Exact for losses linear in the targets, such as cross-entropy.

    Images are ``(N, H, W)`` or ``(N, H, W, C)``. With ``device_train_microbatch_size`` it runs per
    microbatch (each has its own ``state.step_rng``): partners come from the same microbatch.

    Args:
        alpha: concentration of the symmetric Beta distribution of the nominal kept area, ``> 0``.
            Default: ``1.0`` (uniform).
        interpolate_loss: interpolate the loss instead of the targets. Default: ``False``.
        uniform_sampling: draw the box centre so every pixel is equally likely to be covered
            (instead of the centre uniform over the image, as in the paper). Default: ``False``.
        input_key: where the images are in the batch (tuple/list index or dict key). Default: ``0``.
        target_key: where the targets are in the batch. Default: ``1``.
        num_classes: the number of classes, for one-hot encoding integer labels. ``None`` takes it
            from the model's logits; set it for a plain module trained with a ``loss_fn`` that
            accepts soft targets. Default: ``None``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.cutmix import CutMix

        trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=10, rngs=nnx.Rngs(0)), 10), train_loader,
                          '10ep', optax.sgd(0.1), algorithms=[CutMix(alpha=1.0)])
        trainer.fit()
    """

    label = "CutMix"
    targets_function = staticmethod(cutmix_targets)

    def __init__(
        self,
        alpha: float = 1.0,
        interpolate_loss: bool = False,
        uniform_sampling: bool = False,
        input_key: int | str = 0,
        target_key: int | str = 1,
        num_classes: int | None = None,
    ) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
            raise ValueError(f"alpha={alpha!r}: expected a number > 0 (the Beta distribution's concentration)")
        super().__init__(interpolate_loss, input_key, target_key, num_classes, uniform_sampling=uniform_sampling)
        self.alpha = float(alpha)
        self.uniform_sampling = uniform_sampling

    def mix_inputs(self, state: State, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        """Paste the box from each image's partner; stash ``(adjusted_lambda, indices, box mask)``."""
        if inputs.ndim < 3:
            raise ValueError(f"CutMix: the inputs have shape {inputs.shape}; expected images (N, H, W) or "
                             "(N, H, W, C)")
        batch_size, height, width = inputs.shape[:3]
        bbox, indices = cutmix_sample(self.sample_key(state.step_rng), batch_size, height, width, self.alpha,
                                      self.uniform_sampling)
        mixed, _, adjusted_lambda = cutmix_batch(inputs, targets, bbox, indices)
        return mixed, (adjusted_lambda, indices, box_mask(bbox, height, width))

    def mixed_targets(self, state: State, targets: jax.Array, weight: jax.Array, indices: jax.Array,
                      *extra: Any) -> jax.Array:
        """Targets with the images' height and width (masks) get the box pasted; others are mixed by area."""
        (mask,) = extra
        if _spatial(targets, mask):
            box = mask.reshape((1, *mask.shape) + (1,) * (targets.ndim - 3))
            return jnp.where(box, targets[indices], targets)
        return super().mixed_targets(state, targets, weight, indices)

    def permuted_loss(self, state: State, targets: jax.Array, indices: jax.Array, *extra: Any) -> jax.Array:
        """The loss against the partners' targets; refused for targets with the images' height and width."""
        (mask,) = extra
        if _spatial(targets, mask):
            raise ValueError("CutMix(interpolate_loss=True) cannot interpolate the loss of targets with the "
                             f"images' height and width (shape {targets.shape}); use interpolate_loss=False")
        return super().permuted_loss(state, targets, indices)

    def __repr__(self) -> str:
        return (f"CutMix(alpha={self.alpha}, interpolate_loss={self.interpolate_loss}, "
                f"uniform_sampling={self.uniform_sampling}, input_key={self.input_key!r}, "
                f"target_key={self.target_key!r}, num_classes={self.num_classes!r})")


def _spatial(targets: jax.Array, mask: jax.Array) -> bool:
    """Targets with the images' height and width (segmentation masks), which the box is pasted into."""
    return targets.ndim >= 3 and tuple(targets.shape[1:3]) == mask.shape
