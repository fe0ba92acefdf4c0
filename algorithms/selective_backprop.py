"""Selective backprop: backpropagate only through the examples of each batch the model finds hardest.

A scoring forward pass gives every example's loss; a fraction ``keep`` of the batch is then sampled,
high-loss examples more likely (Jiang et al., 2019), and only those go through the training forward
and backward passes. The kept count is static, so the selection compiles into the step: a run uses
at most two compiled steps, with and without selection.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from composerjax import Algorithm, Event, Logger, State
from composerjax.algorithms.interpolate import interpolate_bilinear

__all__ = [
    "per_example_loss",
    "selection_probabilities",
    "selection_indices",
    "select_using_loss",
    "should_selective_backprop",
    "downscale_for_scoring",
    "SelectiveBackprop",
]


def per_example_loss(outputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Return the ``(N,)`` cross-entropy of each example for integer labels or soft targets.

    Targets with the rank of ``outputs`` are probabilities (one-hot, smoothed, mixed), otherwise
    integer labels. Sequence outputs ``(N, T, C)`` are averaged over their positions.

    Example:
        >>> logits = jnp.array([[0.0, 0.0], [10.0, -10.0]])
        >>> [round(float(v), 4) for v in per_example_loss(logits, jnp.array([0, 0]))]
        [0.6931, 0.0]
    """
    logits = outputs.astype(jnp.float32)
    if targets.ndim == logits.ndim:
        losses = optax.softmax_cross_entropy(logits, targets.astype(jnp.float32))
    else:
        losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets.astype(jnp.int32))
    return losses.reshape(losses.shape[0], -1).mean(axis=1)


def selection_probabilities(size: int, keep: float) -> jax.Array:
    """Return the sampling weight of each loss rank (ascending) in a batch of ``size``.

    Rank ``r`` sits at percentile ``(r + 0.5) / size`` and is drawn with probability proportional
    to ``percentile ** (1 / keep - 1)``: the higher the loss, the likelier it is kept.

    Example:
        >>> [round(float(p) * 16, 4) for p in selection_probabilities(4, 0.5)]
        [1.0, 3.0, 5.0, 7.0]
    """
    percentiles = (jnp.arange(size, dtype=jnp.float32) + 0.5) / size
    weights = percentiles ** (1.0 / keep - 1.0)
    return weights / jnp.sum(weights)


def selection_indices(losses: jax.Array, keep: float, rng: jax.Array) -> jax.Array:
    """Return the indices of the ``int(keep * N)`` examples to keep, sampled by loss rank without replacement.

    Raises:
        ValueError: when ``int(keep * N)`` is 0.
    """
    size = losses.shape[0]
    count = int(keep * size)
    if count < 1:
        raise ValueError(f"keep={keep!r} of a batch of {size} keeps no example; raise keep or the batch size")
    by_loss = jnp.argsort(losses)
    ranks = jax.random.choice(rng, size, (count,), replace=False, p=selection_probabilities(size, keep))
    return by_loss[ranks]


def select_using_loss(inputs: Any, targets: Any, losses: jax.Array, keep: float, rng: jax.Array) -> tuple[Any, Any]:
    """Keep ``int(keep * N)`` examples of ``(inputs, targets)``, sampled with weights growing with their loss.

    Examples are ranked by ``losses``; rank ``r`` is drawn (without replacement, from ``rng``) with
    probability proportional to ``((r + 0.5) / N) ** (1 / keep - 1)``. ``inputs`` and ``targets`` may
    be arrays or pytrees of arrays with leading dimension ``N``.

    Example:
        >>> x, y = jnp.arange(4.0), jnp.arange(4)
        >>> x_kept, y_kept = select_using_loss(x, y, jnp.array([0.1, 3.0, 0.2, 2.0]), 0.5, jax.random.key(0))
        >>> x_kept.shape, bool((x_kept == y_kept).all())
        ((2,), True)
    """
    indices = selection_indices(losses, keep, rng)
    pick = lambda tree: jax.tree.map(lambda leaf: leaf[indices], tree)
    return pick(inputs), pick(targets)


def should_selective_backprop(progress: float, batch_in_epoch: int, start: float, end: float, interrupt: int) -> bool:
    """Whether a batch uses selective backprop: inside ``[start, end)`` of training, except every ``interrupt``-th.

    With ``interrupt=2`` selective and plain steps alternate; ``interrupt=0`` never interrupts.

    Example:
        >>> [should_selective_backprop(0.6, b, 0.5, 0.9, 2) for b in range(4)]
        [True, False, True, False]
    """
    in_window = start <= progress < end
    return in_window and (interrupt == 0 or (batch_in_epoch + 1) % interrupt != 0)


def downscale_for_scoring(images: jax.Array, scale_factor: float) -> jax.Array:
    """Shrink ``(N, H, W)`` or ``(N, H, W, C)`` images as Composer's scoring pass does, with torch's bilinear resize.

    ``F.interpolate(x, scale_factor=scale_factor, mode='bilinear', align_corners=False,
    recompute_scale_factor=False)``: sides ``floor(side * scale_factor)``, no antialiasing (see
    :func:`~composerjax.algorithms.interpolate.interpolate_bilinear`).

    Example:
        >>> downscale_for_scoring(jnp.arange(16.0).reshape(1, 4, 4), 0.5)[0].tolist()
        [[2.5, 4.5], [10.5, 12.5]]
    """
    if images.ndim not in (3, 4):
        raise ValueError(f"SelectiveBackprop(scale_factor={scale_factor}) downscales images (N, H, W) or "
                         f"(N, H, W, C); the inputs have shape {images.shape}")
    return interpolate_bilinear(images, scale_factor)


class SelectiveBackprop(Algorithm):
    """Train each selected step on the hardest ``keep`` fraction of the batch, chosen by a scoring forward pass.

    Runs at the traced ``BEFORE_FORWARD`` on the steps :func:`should_selective_backprop` picks (decided
    on the host from the progress and ``batch_in_epoch``): a forward pass with the current
    parameters and no gradient scores every example (cross-entropy against the targets, see
    :func:`per_example_loss`), :func:`select_using_loss` samples ``int(keep * N)`` of them from
    ``jax.random.fold_in(state.step_rng, SelectiveBackprop.rng_stream)``, and the whole batch (every
    array with the batch dimension) is cut to those. Sorted to run first, so other ``BEFORE_FORWARD``
    algorithms see the selected examples. With ``device_train_microbatch_size`` the selection is per
    microbatch.

    Args:
        start: the fraction of training at which selection starts.
        end: the fraction of training at which it stops (exclusive).
        keep: the fraction of each batch kept, in ``(0, 1]`` (``1`` disables the algorithm).
        scale_factor: downscale image inputs ``(N, H, W[, C])`` by this factor for the scoring pass
            only, in ``(0, 1]`` (torch's bilinear ``F.interpolate``, see :func:`downscale_for_scoring`).
        interrupt: take a plain step every ``interrupt``-th batch of the epoch inside the window
            (``0``: never).
        input_key: where the inputs are in the batch (downscaled for scoring).
        target_key: where the targets are in the batch (scored against).

    Example::

        trainer = Trainer(ComposerClassifier(SmallCNN(rngs=nnx.Rngs(0)), 10), loader, '10ep',
                          algorithms=[SelectiveBackprop(start=0.5, end=0.9, keep=0.5)])
    """

    run_first = True
    #: folded into ``state.step_rng`` for the selection's key, so no other algorithm draws the same numbers.
    rng_stream: int = 0x5E1EC7

    def __init__(
        self,
        start: float = 0.5,
        end: float = 0.9,
        keep: float = 0.5,
        scale_factor: float = 1.0,
        interrupt: int = 2,
        input_key: int | str = 0,
        target_key: int | str = 1,
    ) -> None:
        if not 0 <= start <= 1:
            raise ValueError(f"start={start!r}: expected a fraction of training in [0, 1]")
        if not start <= end <= 1:
            raise ValueError(f"end={end!r}: expected a fraction of training in [start, 1] = [{start}, 1]")
        if not 0 < keep <= 1:
            raise ValueError(f"keep={keep!r}: expected the fraction of the batch to keep, in (0, 1]")
        if not 0 < scale_factor <= 1:
            raise ValueError(f"scale_factor={scale_factor!r}: expected a downscaling factor in (0, 1]")
        if isinstance(interrupt, bool) or not isinstance(interrupt, int) or interrupt < 0:
            raise ValueError(f"interrupt={interrupt!r}: expected a non-negative integer (0 never interrupts)")
        self.start = start
        self.end = end
        self.keep = keep
        self.scale_factor = scale_factor
        self.interrupt = interrupt
        self.input_key = input_key
        self.target_key = target_key

    events = frozenset({Event.BEFORE_FORWARD})

    def match(self, event: Event, state: State) -> bool:
        if event != Event.BEFORE_FORWARD or self.keep >= 1:
            return False
        return should_selective_backprop(state.progress, state.timestamp.batch_in_epoch.value, self.start,
                                         self.end, self.interrupt)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        targets = state.batch_get_item(self.target_key)
        scoring_batch = state.batch
        if self.scale_factor < 1:
            scoring_batch = _replaced(state, self.input_key,
                                      downscale_for_scoring(state.batch_get_item(self.input_key), self.scale_factor))
        outputs = jax.lax.stop_gradient(state.forward(state.params, scoring_batch))
        losses = per_example_loss(outputs, targets)
        indices = selection_indices(losses, self.keep, jax.random.fold_in(state.step_rng, self.rng_stream))
        size = losses.shape[0]
        state.batch = jax.tree.map(lambda leaf: leaf[indices] if jnp.ndim(leaf) and leaf.shape[0] == size else leaf,
                                   state.batch)

    def __repr__(self) -> str:
        return (f"SelectiveBackprop(start={self.start}, end={self.end}, keep={self.keep}, "
                f"scale_factor={self.scale_factor}, interrupt={self.interrupt})")


def _replaced(state: State, key: int | str, value: Any) -> Any:
    """``state.batch`` with one item replaced, leaving ``state.batch`` itself as it was."""
    original = state.batch
    state.batch_set_item(key, value)
    replaced, state.batch = state.batch, original
    return replaced
