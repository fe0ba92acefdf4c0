"""ColOut: drop a random fraction of the rows and columns of each training image.

The image shrinks by a fixed number of rows and columns, so each step does less work and the model
sees slightly distorted images. The functional forms are :func:`colout_indices` (which rows and
columns to keep) and :func:`colout_batch`; :class:`ColOut` applies them inside the compiled train
step. The number kept is fixed by the image size, so one compile serves every draw.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from composerjax import Algorithm, Event, Logger, State

__all__ = ["ColOut", "colout_batch", "colout_indices", "kept_size"]


def kept_size(size: int, p_drop: float) -> int:
    """How many of ``size`` rows (or columns) are kept: ``int((1 - p_drop) * size)``, at least 1.

    Composer's count: the kept fraction truncated (``int``), not rounded. The floor of 1 keeps an
    image from vanishing where Composer would return an empty one.

    Example:
        >>> kept_size(8, 0.15), kept_size(32, 0.15), kept_size(4, 0.9)
        (6, 27, 1)
    """
    return max(1, int((1.0 - p_drop) * size))


@functools.partial(jax.jit, static_argnames=("height", "width", "p_row", "p_col"))
def colout_indices(rng: jax.Array, height: int, width: int, p_row: float = 0.15, p_col: float = 0.15
                   ) -> tuple[jax.Array, jax.Array]:
    """Draw the sorted rows and columns to keep: ``kept_size(H, p_row)`` rows, ``kept_size(W, p_col)`` columns.

    Each is the sorted head of a random permutation, so every subset of that size is equally likely
    and the kept rows stay in their original order.

    Example:
        >>> rows, cols = colout_indices(jax.random.key(0), 8, 8, p_row=0.5, p_col=0.25)
        >>> rows.shape, cols.shape, bool((jnp.diff(rows) > 0).all())
        ((4,), (6,), True)
    """
    row_key, col_key = jax.random.split(rng)
    rows = jnp.sort(jax.random.permutation(row_key, height)[:kept_size(height, p_row)])
    cols = jnp.sort(jax.random.permutation(col_key, width)[:kept_size(width, p_col)])
    return rows.astype(jnp.int32), cols.astype(jnp.int32)


def colout_batch(
    input: jax.Array, p_row: float = 0.15, p_col: float = 0.15, *, rng: jax.Array, per_example: bool = False
) -> jax.Array:
    """Keep ``kept_size(H, p_row)`` random rows and ``kept_size(W, p_col)`` random columns of every image.

    Images are ``(N, H, W)`` or ``(N, H, W, C)`` (any trailing axes follow ``W``); the result is
    ``(N, H', W', ...)``. The kept rows and columns are ``colout_indices(rng, H, W, p_row, p_col)``
    for the whole batch, or, with ``per_example``, ``colout_indices(k, ...)`` for example ``i``'s
    key ``k = jax.random.split(rng, N)[i]``. Called with the same ``rng`` on another array of the same
    height and width (a segmentation mask) it drops the same rows and columns.

    Example:
        >>> colout_batch(jnp.zeros((2, 8, 8, 3)), 0.25, 0.5, rng=jax.random.key(0)).shape
        (2, 6, 4, 3)
    """
    if input.ndim < 3:
        raise ValueError(f"colout_batch: input has shape {input.shape}; expected images (N, H, W) or (N, H, W, C)")
    height, width = input.shape[1], input.shape[2]

    def keep(image: jax.Array, key: jax.Array, row_axis: int) -> jax.Array:
        rows, cols = colout_indices(key, height, width, p_row, p_col)
        return jnp.take(jnp.take(image, rows, axis=row_axis), cols, axis=row_axis + 1)

    if per_example:
        return jax.vmap(lambda image, key: keep(image, key, 0))(input, jax.random.split(rng, input.shape[0]))
    return keep(input, rng, 1)


class ColOut(Algorithm):
    """Drop a random ``p_row`` of the rows and ``p_col`` of the columns of the training images.

    Runs inside the compiled step at ``BEFORE_FORWARD``: :func:`colout_batch` with a key drawn from
    the step's key (``state.step_rng``, see ``sample_key``). The images shrink from ``(H, W)`` to
    ``(kept_size(H, p_row), kept_size(W, p_col))`` every step, so the step compiles once; the model
    must accept that size (global pooling, as in ``SmallResNet``, does; a flatten into a fixed-size
    linear layer, as in ``SmallCNN``, does not). Eval images keep their full size.

    Args:
        p_row: the fraction of rows to drop, in ``[0, 1)``. Default: ``0.15``.
        p_col: the fraction of columns to drop, in ``[0, 1)``. Default: ``0.15``.
        batch: drop the same rows and columns from every image of the batch; ``False`` draws them
            for each image separately. Default: ``True``.
        resize_target: also drop them from the targets: ``'auto'`` does when the targets have the
            images' height and width (segmentation masks); ``True`` always; ``False`` never.
            Default: ``'auto'``.
        input_key: where the images are in the batch (tuple/list index or dict key). Default: ``0``.
        target_key: where the targets are in the batch. Default: ``1``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.colout import ColOut

        trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=10, rngs=nnx.Rngs(0)), 10), train_loader,
                          '10ep', optax.sgd(0.1), algorithms=[ColOut(p_row=0.15, p_col=0.15)])
        trainer.fit()
    """

    def __init__(
        self,
        p_row: float = 0.15,
        p_col: float = 0.15,
        batch: bool = True,
        resize_target: bool | str = "auto",
        input_key: int | str = 0,
        target_key: int | str = 1,
    ) -> None:
        for name, value in (("p_row", p_row), ("p_col", p_col)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                raise ValueError(f"{name}={value!r}: expected a fraction in [0, 1)")
        if not isinstance(batch, bool):
            raise ValueError(f"batch={batch!r}: expected True or False")
        if resize_target not in ("auto", True, False):
            raise ValueError(f"resize_target={resize_target!r}: expected 'auto', True or False")
        for name, key in (("input_key", input_key), ("target_key", target_key)):
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise ValueError(f"{name}={key!r}: expected an int index or a str key into the batch")
        self.p_row, self.p_col = float(p_row), float(p_col)
        self.batch = batch
        self.resize_target = resize_target
        self.input_key, self.target_key = input_key, target_key

    events = frozenset({Event.BEFORE_FORWARD})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Replace the images (and, per ``resize_target``, the targets) by their kept rows and columns."""
        images = state.batch_get_item(self.input_key)
        rng = self.sample_key(state.step_rng)
        per_example = not self.batch
        if self._resizes_target(images, state):
            targets = state.batch_get_item(self.target_key)
            state.batch_set_item(self.target_key,
                                 colout_batch(targets, self.p_row, self.p_col, rng=rng, per_example=per_example))
        state.batch_set_item(self.input_key, colout_batch(images, self.p_row, self.p_col, rng=rng,
                                                          per_example=per_example))

    def _resizes_target(self, images: jax.Array, state: State) -> bool:
        if self.resize_target is False:
            return False
        targets = state.batch_get_item(self.target_key)
        same_size = targets.ndim >= 3 and tuple(targets.shape[1:3]) == tuple(images.shape[1:3])
        if self.resize_target is True and not same_size:
            raise ValueError(f"ColOut(resize_target=True): the targets have shape {targets.shape}, not the images' "
                             f"height and width {tuple(images.shape[1:3])}")
        return same_size

    def __repr__(self) -> str:
        return (f"ColOut(p_row={self.p_row}, p_col={self.p_col}, batch={self.batch}, "
                f"resize_target={self.resize_target!r}, input_key={self.input_key!r}, "
                f"target_key={self.target_key!r})")
