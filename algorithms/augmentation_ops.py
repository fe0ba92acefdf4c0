"""Image augmentation ops shared by RandAugment and AugMix: pure jnp functions on float images in [0, 1].

Two layers:

* **Ops** with a natural parameter (``solarize(image, threshold)``, ``rotate(image, degrees)``, ...).
  Each takes one image, ``(H, W)`` or ``(H, W, C)`` (channels last), with values in [0, 1], and returns
  an image of the same shape, in [0, 1]. They are traceable: parameters may be tracers.
* **Augmentations**: the ops with a random intensity, read from uniform draws, up to a ``severity``
  on Composer's 0..10 scale (the strongest at 10), gathered into named sets (``'all'``, ``'safe'``,
  ``'original'``). ``apply_random_augmentation`` picks one of a set with ``lax.switch``, so a whole
  chain of random choices stays inside one compiled step.

Posterize and equalize work on the 8-bit levels ``round(255 * x)``, as PIL does, and match PIL
exactly on images whose values are multiples of 1/255.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

__all__ = [
    "AUGMENTATION_SETS",
    "check_augmentation_arguments",
    "DRAWS_PER_AUGMENTATION",
    "MAX_SEVERITY",
    "Augmentation",
    "apply_random_augmentation",
    "autocontrast",
    "batch_key",
    "brightness",
    "check_severity",
    "color",
    "contrast",
    "equalize",
    "posterize",
    "resolve_augmentation_set",
    "rotate",
    "sharpness",
    "shear_x",
    "shear_y",
    "solarize",
    "translate_x",
    "translate_y",
]

MAX_SEVERITY = 10.0
_LUMA = (0.299, 0.587, 0.114)  # ITU-R 601-2, as PIL's convert('L')


# -- shape and level helpers ---------------------------------------------------------------------
def _channels_last(op: Callable[..., jax.Array]) -> Callable[..., jax.Array]:
    """Let ``op(image_hwc, ...)`` take ``(H, W)`` or ``(H, W, C)`` images and return the same shape."""

    compiled = jax.jit(op)  # one compile per shape when called eagerly; inlined when traced

    @functools.wraps(op)
    def wrapped(image: jax.Array, *args: jax.Array | float) -> jax.Array:
        image = jnp.asarray(image)
        if image.ndim not in (2, 3):
            raise ValueError(
                f"{op.__name__}: got an image of shape {image.shape}; expected one image (H, W) or (H, W, C)"
            )
        hwc = image[..., None] if image.ndim == 2 else image
        out = compiled(hwc.astype(jnp.float32), *args)
        out = out[..., 0] if image.ndim == 2 else out
        return out.astype(image.dtype) if jnp.issubdtype(image.dtype, jnp.floating) else out

    return wrapped


def _to_levels(image: jax.Array) -> jax.Array:
    """8-bit levels ``round(255 * x)`` as int32."""
    return jnp.round(jnp.clip(image, 0.0, 1.0) * 255.0).astype(jnp.int32)


def _grayscale(image: jax.Array) -> jax.Array:
    """Luma of an (H, W, C) image as (H, W, 1): PIL's weights for RGB, the channel mean otherwise."""
    if image.shape[-1] == 3:
        return jnp.tensordot(image, jnp.asarray(_LUMA, jnp.float32), axes=1)[..., None]
    return jnp.mean(image, axis=-1, keepdims=True)


def _blend(degenerate: jax.Array, image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """PIL's ``ImageEnhance``: ``degenerate + factor * (image - degenerate)``, clipped to [0, 1]."""
    return jnp.clip(degenerate + factor * (image - degenerate), 0.0, 1.0)


def _resample(image: jax.Array, matrix: jax.Array, offset: jax.Array) -> jax.Array:
    """PIL's bilinear affine ``Image.transform``: output pixel ``p = (row, col)`` reads ``matrix @ p + offset``.

    Coordinates are pixel indices (pixel centres). As in PIL, a source point outside the image
    (more than half a pixel past the outermost centres) gives 0, the fill colour; one inside blends
    its four neighbours, an edge pixel standing in for a missing neighbour.
    """
    height, width = image.shape[:2]
    rows, cols = jnp.meshgrid(jnp.arange(height, dtype=jnp.float32), jnp.arange(width, dtype=jnp.float32),
                              indexing="ij")
    src_row = matrix[0, 0] * rows + matrix[0, 1] * cols + offset[0]
    src_col = matrix[1, 0] * rows + matrix[1, 1] * cols + offset[1]
    inside = (src_row >= -0.5) & (src_row < height - 0.5) & (src_col >= -0.5) & (src_col < width - 0.5)
    row0, col0 = jnp.floor(src_row), jnp.floor(src_col)
    d_row, d_col = (src_row - row0)[..., None], (src_col - col0)[..., None]
    row0, col0 = row0.astype(jnp.int32), col0.astype(jnp.int32)
    r0, r1 = jnp.clip(row0, 0, height - 1), jnp.clip(row0 + 1, 0, height - 1)
    c0, c1 = jnp.clip(col0, 0, width - 1), jnp.clip(col0 + 1, 0, width - 1)
    top = image[r0, c0] + d_col * (image[r0, c1] - image[r0, c0])
    bottom = image[r1, c0] + d_col * (image[r1, c1] - image[r1, c0])
    return jnp.where(inside[..., None], top + d_row * (bottom - top), 0.0)


# -- ops -----------------------------------------------------------------------------------------
@_channels_last
def autocontrast(image: jax.Array) -> jax.Array:
    """Stretch each channel linearly so its minimum maps to 0 and its maximum to 1.

    A constant channel is left unchanged.

    Example:
        >>> autocontrast(jnp.array([[0.25, 0.5], [0.5, 0.75]])).tolist()
        [[0.0, 0.5], [0.5, 1.0]]
    """
    low = jnp.min(image, axis=(0, 1), keepdims=True)
    high = jnp.max(image, axis=(0, 1), keepdims=True)
    span = high - low
    stretched = (image - low) / jnp.where(span > 0, span, 1.0)
    return jnp.where(span > 0, stretched, image)


def _equalize_channel(channel: jax.Array) -> jax.Array:
    levels = _to_levels(channel)
    histogram = jnp.zeros(256, jnp.int32).at[levels.reshape(-1)].add(1)
    # PIL's rule: spread the pixels below the top level evenly over 255 steps.
    step = (levels.size - histogram[jnp.max(levels)]) // 255
    below = jnp.cumsum(histogram) - histogram
    lut = jnp.minimum((step // 2 + below) // jnp.maximum(step, 1), 255)
    return jnp.where(step > 0, lut[levels].astype(jnp.float32) / 255.0, channel)


@_channels_last
def equalize(image: jax.Array) -> jax.Array:
    """Histogram-equalize each channel over 256 levels, exactly as PIL's ``ImageOps.equalize``.

    Like PIL, a channel is left unchanged when fewer than 255 of its pixels lie below its top level
    (so images with under 256 pixels never change).
    """
    return jax.vmap(_equalize_channel, in_axes=2, out_axes=2)(image)


@_channels_last
def posterize(image: jax.Array, bits: jax.Array | int) -> jax.Array:
    """Keep the top ``bits`` (0..8) bits of each 8-bit level.

    Example:
        >>> (posterize(jnp.array([[200 / 255]]), 2) * 255).round().tolist()
        [[192.0]]
    """
    mask = jnp.left_shift(jnp.int32(0xFF), 8 - jnp.asarray(bits, jnp.int32)) & 0xFF
    return (_to_levels(image) & mask).astype(jnp.float32) / 255.0


@_channels_last
def solarize(image: jax.Array, threshold: jax.Array | float) -> jax.Array:
    """Invert (``1 - x``) every value at or above ``threshold``; a threshold above 1 changes nothing.

    Example:
        >>> solarize(jnp.array([[0.25, 0.5, 0.75]]), 0.5).tolist()
        [[0.25, 0.5, 0.25]]
    """
    return jnp.where(image >= threshold, 1.0 - image, image)


Transform = tuple[jax.Array, jax.Array]  # (matrix, offset) for _resample


def _rotation(degrees: jax.Array | float, shape: tuple[int, ...]) -> Transform:
    # About the image centre, as PIL's Image.rotate: src = centre + M (p - centre).
    theta = jnp.deg2rad(jnp.asarray(degrees, jnp.float32))
    cos, sin = jnp.cos(theta), jnp.sin(theta)
    matrix = jnp.stack([jnp.stack([cos, sin]), jnp.stack([-sin, cos])])
    centre = jnp.asarray([(shape[0] - 1) / 2.0, (shape[1] - 1) / 2.0], jnp.float32)
    return matrix, centre - matrix @ centre


def _shear(factor: jax.Array | float, axis: int) -> Transform:
    # PIL's AFFINE (1, f, 0, 0, 1, 0) on pixel edges: about the top (left) edge, not the centre.
    # axis 1 (width): the source column is col + f * (row + 0.5); axis 0 (height): row + f * (col + 0.5).
    factor = jnp.asarray(factor, jnp.float32)
    entry = (1, 0) if axis == 1 else (0, 1)
    return jnp.eye(2, dtype=jnp.float32).at[entry].set(factor), jnp.zeros(2, jnp.float32).at[axis].set(0.5 * factor)


def _translation(pixels: jax.Array | float, axis: int) -> Transform:
    return jnp.eye(2, dtype=jnp.float32), jnp.zeros(2, jnp.float32).at[axis].set(-jnp.asarray(pixels, jnp.float32))


@_channels_last
def rotate(image: jax.Array, degrees: jax.Array | float) -> jax.Array:
    """Rotate counter-clockwise by ``degrees`` about the centre, as PIL's ``Image.rotate(degrees, BILINEAR)``."""
    return _resample(image, *_rotation(degrees, image.shape))


@_channels_last
def shear_x(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Shear along the width about the top edge, as PIL's ``transform(AFFINE, (1, factor, 0, 0, 1, 0), BILINEAR)``.

    Output pixel ``(row, col)`` reads the input at ``(row, col + factor * (row + 0.5))``; zeros outside.

    Example:
        >>> shear_x(jnp.arange(1.0, 9.0).reshape(2, 4), 2.0).tolist()  # rows read 1 and 3 columns further
        [[2.0, 3.0, 4.0, 0.0], [8.0, 0.0, 0.0, 0.0]]
    """
    return _resample(image, *_shear(factor, axis=1))


@_channels_last
def shear_y(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Shear along the height about the left edge, as PIL's ``transform(AFFINE, (1, 0, 0, factor, 1, 0), BILINEAR)``.

    Output pixel ``(row, col)`` reads the input at ``(row + factor * (col + 0.5), col)``; zeros outside.
    """
    return _resample(image, *_shear(factor, axis=0))


@_channels_last
def translate_x(image: jax.Array, pixels: jax.Array | float) -> jax.Array:
    """Move the content ``pixels`` columns to the right (left if negative), filling with zeros.

    PIL's ``transform(AFFINE, (1, 0, level, 0, 1, 0))`` (Composer's ``translate_x``) is ``pixels = -level``.
    """
    return _resample(image, *_translation(pixels, axis=1))


@_channels_last
def translate_y(image: jax.Array, pixels: jax.Array | float) -> jax.Array:
    """Move the content ``pixels`` rows down (up if negative), filling with zeros.

    PIL's ``transform(AFFINE, (1, 0, 0, 0, 1, level))`` (Composer's ``translate_y``) is ``pixels = -level``.
    """
    return _resample(image, *_translation(pixels, axis=0))


@_channels_last
def color(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Scale saturation: blend the grayscale image (0) with the image (1); a single channel is unchanged."""
    return _blend(_grayscale(image), image, factor)


@_channels_last
def contrast(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Blend a flat image at the mean luma (0) with the image (1); above 1 increases contrast.

    Example:
        >>> contrast(jnp.array([[0.25, 0.75]]), 0.5).tolist()
        [[0.375, 0.625]]
    """
    return _blend(jnp.mean(_grayscale(image)), image, factor)


@_channels_last
def brightness(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Blend black (0) with the image (1): ``clip(factor * x, 0, 1)``."""
    return _blend(jnp.zeros_like(image), image, factor)


@_channels_last
def sharpness(image: jax.Array, factor: jax.Array | float) -> jax.Array:
    """Blend a smoothed image (0) with the image (1); above 1 sharpens.

    The smoothed image is PIL's SMOOTH filter ``[[1, 1, 1], [1, 5, 1], [1, 1, 1]] / 13`` on the
    interior, with the one-pixel border kept from the image.
    """
    height, width = image.shape[:2]
    if height < 3 or width < 3:
        return _blend(image, image, factor)
    interior = 4.0 * image[1:-1, 1:-1]
    for d_row in (-1, 0, 1):
        for d_col in (-1, 0, 1):
            interior = interior + image[1 + d_row:height - 1 + d_row, 1 + d_col:width - 1 + d_col]
    smoothed = image.at[1:-1, 1:-1].set(interior / 13.0)
    return _blend(smoothed, image, factor)


# -- random augmentations ------------------------------------------------------------------------
#: Uniform numbers in [0, 1) an augmentation reads: intensity, sign, coin, factor.
DRAWS_PER_AUGMENTATION = 4

AugmentationFn = Callable[[jax.Array, jax.Array, float], jax.Array]
TransformFn = Callable[[tuple[int, ...], jax.Array, float], Transform]


@dataclass(frozen=True)
class Augmentation:
    """A named random augmentation whose randomness comes in as ``draws``.

    Give either ``fn(image_hwc, draws, severity) -> image`` or, for a geometric augmentation,
    ``transform(image_shape, draws, severity) -> (matrix, offset)`` of PIL's bilinear affine
    resampling (output pixel ``p`` reads ``matrix @ p + offset``; geometric augmentations share one
    resampling when one of a set is picked at random).
    ``draws`` holds ``DRAWS_PER_AUGMENTATION`` uniform numbers in [0, 1) (drawn once for a whole
    chain, which keeps the compiled step small); ``severity`` is on Composer's 0..10 scale. The
    intensity is uniform in ``[0.01, severity / 10]`` (Composer's level, uniform in ``[0.1,
    severity]``, over 10); signed ops flip a fair coin for the direction.
    """

    name: str
    fn: AugmentationFn | None = None
    transform: TransformFn | None = None

    def __post_init__(self) -> None:
        if (self.fn is None) == (self.transform is None):
            raise ValueError(f"Augmentation({self.name!r}): give exactly one of fn or transform")

    def apply(self, image: jax.Array, draws: jax.Array, severity: float) -> jax.Array:
        """Apply to one ``(H, W, C)`` float32 image with its ``DRAWS_PER_AUGMENTATION`` draws."""
        if self.fn is not None:
            return self.fn(image, draws, severity)
        return _resample(image, *self.transform(image.shape, draws, severity))

    def __call__(self, image: jax.Array, key: jax.Array, severity: float) -> jax.Array:
        """Apply to one ``(H, W)`` or ``(H, W, C)`` image with draws taken from ``key``."""
        draws = jax.random.uniform(key, (DRAWS_PER_AUGMENTATION,), jnp.float32)
        return _channels_last(lambda hwc: self.apply(hwc, draws, severity))(image)

    def __repr__(self) -> str:
        return f"Augmentation({self.name!r})"


def _intensity(draws: jax.Array, severity: float) -> jax.Array:
    """Composer's ``_sample_level(severity) / 10``: the level is uniform in ``[0.1, severity]``."""
    return (0.1 + draws[0] * (severity - 0.1)) / MAX_SEVERITY


def _signed_intensity(draws: jax.Array, severity: float) -> jax.Array:
    return jnp.where(draws[1] < 0.5, -1.0, 1.0) * _intensity(draws, severity)


def _symmetric_factor(draws: jax.Array, severity: float) -> jax.Array:
    """An enhancement factor, 1 meaning no change: a fair coin picks U(1, severity) or U(1 - 0.09 severity, 1)."""
    up = 1.0 + draws[3] * (severity - 1.0)  # below severity 1, numpy's uniform(1, severity) lies in [severity, 1]
    down = 1.0 - draws[3] * (0.09 * severity)
    return jnp.where(draws[2] < 0.5, up, down)


def _brightness_factor(draws: jax.Array, severity: float) -> jax.Array:
    """Composer's brightness: the symmetric factor, with brightening (above 1) scaled by 0.75."""
    factor = _symmetric_factor(draws, severity)
    return jnp.where(factor > 1.0, 0.75 * factor, factor)


def _original_factor(draws: jax.Array, severity: float) -> jax.Array:
    """The AugMix repository's enhancement factor: ``0.1 + 1.8 * intensity`` (mostly below 1)."""
    return 0.1 + 1.8 * _intensity(draws, severity)


# ``op.__wrapped__`` below is an op without its shape handling: it takes an (H, W, C) float32 image.
def _enhancement(op: Callable[..., jax.Array], factor: Callable[[jax.Array, float], jax.Array]) -> AugmentationFn:
    return lambda image, draws, severity: op.__wrapped__(image, factor(draws, severity))


def _random_translation(axis: int) -> TransformFn:
    def transform(shape: tuple[int, ...], draws: jax.Array, severity: float) -> Transform:
        # Whole pixels, up to a third of the image side.
        return _translation(jnp.trunc(_signed_intensity(draws, severity) * (shape[axis] / 3.0)), axis)

    return transform


def _random_shear(axis: int) -> TransformFn:
    return lambda shape, draws, severity: _shear(0.3 * _signed_intensity(draws, severity), axis)


_SAFE = (
    Augmentation("autocontrast", lambda image, draws, severity: autocontrast.__wrapped__(image)),
    Augmentation("equalize", lambda image, draws, severity: equalize.__wrapped__(image)),
    Augmentation("posterize", lambda image, draws, severity: posterize.__wrapped__(
        image, 4 - jnp.floor(_intensity(draws, severity) * 4.0).astype(jnp.int32))),
    Augmentation("rotate", transform=lambda shape, draws, severity: _rotation(
        jnp.trunc(_signed_intensity(draws, severity) * 30.0), shape)),
    Augmentation("solarize", lambda image, draws, severity: solarize.__wrapped__(
        image, (256.0 - jnp.floor(_intensity(draws, severity) * 256.0)) / 255.0)),
    Augmentation("shear_x", transform=_random_shear(axis=1)),
    Augmentation("shear_y", transform=_random_shear(axis=0)),
    Augmentation("translate_x", transform=_random_translation(axis=1)),
    Augmentation("translate_y", transform=_random_translation(axis=0)),
)
_ENHANCEMENTS = {"color": color, "contrast": contrast, "brightness": brightness, "sharpness": sharpness}

#: Named augmentation sets, as in Composer. ``'safe'`` leaves out color, contrast, brightness and
#: sharpness, which overlap the corruptions of ImageNet-C / CIFAR-10-C; ``'all'`` adds them with a
#: factor symmetric about 1; ``'original'`` adds them with the AugMix repository's factor range.
AUGMENTATION_SETS: dict[str, tuple[Augmentation, ...]] = {
    "all": _SAFE + tuple(Augmentation(name, _enhancement(op, _brightness_factor if name == "brightness"
                                                          else _symmetric_factor))
                         for name, op in _ENHANCEMENTS.items()),
    "safe": _SAFE,
    "original": _SAFE + tuple(Augmentation(f"{name}_original", _enhancement(op, _original_factor))
                              for name, op in _ENHANCEMENTS.items()),
}


def resolve_augmentation_set(augmentation_set: str | Sequence[Augmentation]) -> tuple[Augmentation, ...]:
    """Return the augmentations named by ``augmentation_set`` (a key of ``AUGMENTATION_SETS``) or given as a list.

    Example:
        >>> [a.name for a in resolve_augmentation_set('safe')][:3]
        ['autocontrast', 'equalize', 'posterize']
    """
    if isinstance(augmentation_set, str):
        if augmentation_set not in AUGMENTATION_SETS:
            raise ValueError(
                f"augmentation_set={augmentation_set!r}: expected one of {sorted(AUGMENTATION_SETS)} "
                "or a sequence of Augmentation"
            )
        return AUGMENTATION_SETS[augmentation_set]
    augmentations = tuple(augmentation_set)
    if not augmentations or not all(isinstance(a, Augmentation) for a in augmentations):
        raise ValueError(
            f"augmentation_set={augmentation_set!r}: expected one of {sorted(AUGMENTATION_SETS)} "
            "or a non-empty sequence of Augmentation"
        )
    return augmentations


def batch_key(step_rng: jax.Array, name: str, images: jax.Array) -> jax.Array:
    """The key an augmentation algorithm named ``name`` uses for ``images`` in a step.

    ``step_rng`` is folded with the name (so other algorithms drawing from it get independent
    numbers) and with a checksum of the images: with gradient accumulation every microbatch of a
    step sees the same ``step_rng``, and this keeps their augmentations apart.
    """
    key = jax.random.fold_in(step_rng, zlib.crc32(name.encode()) & 0x7FFFFFFF)
    words = jax.lax.bitcast_convert_type(jnp.asarray(images, jnp.float32), jnp.uint32).reshape(-1)
    # Position-weighted, so that reordered images give another checksum (uint32 wraps around).
    checksum = jnp.sum(words * jnp.arange(1, words.size + 1, dtype=jnp.uint32))
    return jax.random.fold_in(key, checksum)


def check_augmentation_arguments(augmentation_set: str, input_key: int | str) -> tuple[str, int | str]:
    """Validate the ``augmentation_set`` and ``input_key`` arguments shared by RandAugment and AugMix."""
    if not isinstance(augmentation_set, str):
        raise ValueError(f"augmentation_set={augmentation_set!r}: expected one of 'all', 'safe', 'original'")
    resolve_augmentation_set(augmentation_set)
    if isinstance(input_key, bool) or not isinstance(input_key, (int, str)):
        raise ValueError(f"input_key={input_key!r}: expected an int index or a str key into the batch")
    return augmentation_set, input_key


def check_severity(severity: float) -> float:
    """Return ``severity`` as a float, or raise ValueError unless it is a number in [0, 10]."""
    if isinstance(severity, bool) or not isinstance(severity, (int, float)) or not 0 <= severity <= MAX_SEVERITY:
        raise ValueError(f"severity={severity!r}: expected a number in [0, {MAX_SEVERITY:g}]")
    return float(severity)


def apply_random_augmentation(image: jax.Array, draws: jax.Array, severity: float,
                              augmentations: Sequence[Augmentation]) -> jax.Array:
    """Apply one augmentation chosen uniformly from ``augmentations`` to an ``(H, W, C)`` float32 image.

    ``draws`` holds ``1 + DRAWS_PER_AUGMENTATION`` uniform numbers in [0, 1): the first picks the
    augmentation, the rest go to it. The choice is a ``lax.switch``, so it stays traceable; under
    ``vmap`` every branch is computed and one is selected per image, so the geometric augmentations
    pick their transform first and share a single resampling.
    """
    count = len(augmentations)
    index = jnp.minimum(jnp.floor(draws[0] * count).astype(jnp.int32), count - 1)
    op_draws = draws[1:]
    if any(a.transform is not None for a in augmentations):
        identity = (jnp.eye(2, dtype=jnp.float32), jnp.zeros(2, jnp.float32))
        transforms = [functools.partial(a.transform, image.shape, severity=severity) if a.transform is not None
                      else (lambda draws: identity) for a in augmentations]
        resampled = _resample(image, *jax.lax.switch(index, transforms, op_draws))
    branches = [functools.partial(a.fn, severity=severity) if a.fn is not None
                else (lambda image, draws: resampled) for a in augmentations]
    return jax.lax.switch(index, branches, image, op_draws)
