"""CutOut: zero one or more random square holes in the training images.

The functional form is :func:`cutout_batch` (draw the holes with :func:`cutout_boxes`, zero them with
:func:`zero_boxes`);
:class:`CutOut` applies them inside the compiled train step with the step's random key. The holes
are masks built with comparisons, so shapes never depend on where they fall: one compile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from composerjax import Algorithm, Event, Logger, State

__all__ = ["CutOut", "cutout_batch", "cutout_boxes", "hole_length", "zero_boxes"]


def hole_length(length: float, height: int, width: int) -> int:
    """The hole's side in pixels: ``int(length * min(H, W))`` for ``0 < length < 1``, else ``int(length)``.

    Example:
        >>> hole_length(0.5, 8, 6), hole_length(3, 8, 6)
        (3, 3)
    """
    if not length > 0:
        raise ValueError(f"length={length!r}: expected a fraction in (0, 1) of the smaller side, or pixels >= 1")
    return int(length * min(height, width)) if length < 1 else int(length)


@functools.partial(jax.jit, static_argnames=("height", "width", "num_holes", "length", "uniform_sampling"))
def cutout_boxes(
    rng: jax.Array, height: int, width: int, num_holes: int = 1, length: float = 0.5, uniform_sampling: bool = False
) -> jax.Array:
    """Draw ``num_holes`` holes as int32 rows ``[top, left, bottom, right]`` (half-open), clipped to the image.

    Each hole is a square of side ``L = hole_length(length, H, W)`` around a random centre: uniform
    over the image (as in the paper), or with ``uniform_sampling`` over the image grown by half a
    hole on every side, so every pixel is equally likely to be cut. Clipping at the border makes
    some holes smaller; for odd ``L`` the square's side is ``L - 1`` (it spans ``L // 2`` either
    side of the centre).

    Example:
        >>> cutout_boxes(jax.random.key(0), 8, 8, num_holes=2).shape
        (2, 4)
    """
    side = hole_length(length, height, width)
    row_key, col_key = jax.random.split(rng)
    if uniform_sampling:
        center_y = jax.random.randint(row_key, (num_holes,), (-side) // 2, height + side // 2)
        center_x = jax.random.randint(col_key, (num_holes,), (-side) // 2, width + side // 2)
    else:
        center_y = jax.random.randint(row_key, (num_holes,), 0, height)
        center_x = jax.random.randint(col_key, (num_holes,), 0, width)
    half = side // 2
    return jnp.stack([
        jnp.clip(center_y - half, 0, height),
        jnp.clip(center_x - half, 0, width),
        jnp.clip(center_y + half, 0, height),
        jnp.clip(center_x + half, 0, width),
    ], axis=1).astype(jnp.int32)


def cutout_batch(
    input: jax.Array, num_holes: int = 1, length: float = 0.5, uniform_sampling: bool = False, *, rng: jax.Array
) -> jax.Array:
    """Zero ``num_holes`` random square holes of side ``length`` in every image (the same holes for the batch).

    The holes are ``cutout_boxes(rng, H, W, num_holes, length, uniform_sampling)``; zeroing them is
    :func:`zero_boxes`.

    Args:
        input: images ``(N, H, W)`` or ``(N, H, W, C)`` (any trailing axes follow ``W``).
        num_holes: how many holes (they may overlap).
        length: the side: a fraction of the smaller image side if ``< 1``, else pixels.
        uniform_sampling: draw the centres so every pixel is equally likely to be cut.
        rng: a JAX random key.

    Example:
        >>> images = cutout_batch(jnp.ones((2, 8, 8)), num_holes=1, length=0.5, rng=jax.random.key(0))
        >>> images.shape, int((images == 0).sum()) <= 2 * 4 * 4
        ((2, 8, 8), True)
    """
    if input.ndim < 3:
        raise ValueError(f"cutout_batch: input has shape {input.shape}; expected images (N, H, W) or (N, H, W, C)")
    boxes = cutout_boxes(rng, input.shape[1], input.shape[2], num_holes, length, uniform_sampling)
    return zero_boxes(input, boxes)


@jax.jit
def zero_boxes(input: jax.Array, boxes: jax.Array) -> jax.Array:
    """Zero every image of ``input`` (``(N, H, W, ...)``) inside each ``[top, left, bottom, right]`` row of ``boxes``.

    Example:
        >>> zero_boxes(jnp.ones((1, 3, 3)), jnp.array([[0, 1, 2, 3]]))[0].astype(int).tolist()
        [[1, 0, 0], [1, 0, 0], [1, 1, 1]]
    """
    height, width = input.shape[1], input.shape[2]
    rows = jnp.arange(height)[None, :, None]
    cols = jnp.arange(width)[None, None, :]
    top, left, bottom, right = (boxes[:, i, None, None] for i in range(4))
    holes = jnp.any((rows >= top) & (rows < bottom) & (cols >= left) & (cols < right), axis=0)
    holes = holes.reshape((1, height, width) + (1,) * (input.ndim - 3))
    return jnp.where(holes, jnp.zeros((), input.dtype), input)


class CutOut(Algorithm):
    """Zero ``num_holes`` random squares of side ``length`` in the training images (the same for the batch).

    Runs inside the compiled step at ``BEFORE_FORWARD``: :func:`cutout_batch` with a key drawn
    from the step's key (``state.step_rng``, see ``sample_key``).
    Images are ``(N, H, W)`` or ``(N, H, W, C)``; the targets are untouched. Zero is the dataset
    mean of normalised images.

    Args:
        num_holes: how many holes to cut (they may overlap). Default: ``1``.
        length: the hole's side: a fraction of the smaller image side for ``0 < length < 1``, or a
            number of pixels for ``length >= 1``. Default: ``0.5``.
        uniform_sampling: draw the centres so every pixel is equally likely to be cut (instead of
            centres uniform over the image, as in the paper). Default: ``False``.
        input_key: where the images are in the batch (tuple/list index or dict key). Default: ``0``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.cutout import CutOut

        trainer = Trainer(model, train_loader, '10ep', optax.sgd(0.1),
                          algorithms=[CutOut(num_holes=1, length=0.5)])
        trainer.fit()
    """

    def __init__(
        self, num_holes: int = 1, length: float = 0.5, uniform_sampling: bool = False, input_key: int | str = 0
    ) -> None:
        if isinstance(num_holes, bool) or not isinstance(num_holes, int) or num_holes < 1:
            raise ValueError(f"num_holes={num_holes!r}: expected an integer >= 1")
        if isinstance(length, bool) or not isinstance(length, (int, float)) or not length > 0:
            raise ValueError(f"length={length!r}: expected a fraction in (0, 1) of the smaller side, or pixels >= 1")
        if not isinstance(uniform_sampling, bool):
            raise ValueError(f"uniform_sampling={uniform_sampling!r}: expected True or False")
        if isinstance(input_key, bool) or not isinstance(input_key, (int, str)):
            raise ValueError(f"input_key={input_key!r}: expected an int index or a str key into the batch")
        self.num_holes = num_holes
        self.length = length
        self.uniform_sampling = uniform_sampling
        self.input_key = input_key

    events = frozenset({Event.BEFORE_FORWARD})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Zero the holes in the batch's images."""
        images = state.batch_get_item(self.input_key)
        holed = cutout_batch(images, self.num_holes, self.length, self.uniform_sampling,
                             rng=self.sample_key(state.step_rng))
        state.batch_set_item(self.input_key, holed)

    def __repr__(self) -> str:
        return (f"CutOut(num_holes={self.num_holes}, length={self.length}, uniform_sampling={self.uniform_sampling}, "
                f"input_key={self.input_key!r})")
