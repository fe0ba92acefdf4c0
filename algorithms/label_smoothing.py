"""Label smoothing: move a fraction of each target's probability mass evenly onto every class.

The functional form is :func:`smooth_labels`; :class:`LabelSmoothing` applies it inside the compiled
train step, just before the loss, so the model's cross-entropy sees soft targets.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from composerjax import Algorithm, Event, Logger, State

__all__ = ["LabelSmoothing", "smooth_labels"]


def smooth_labels(logits: jax.Array, targets: jax.Array, smoothing: float = 0.1) -> jax.Array:
    """Return ``(1 - smoothing) * one_hot(targets) + smoothing / K`` with ``K = logits.shape[-1]``.

    Integer labels (one dimension fewer than ``logits``) are one-hot encoded over the logits' last
    dimension first; dense targets (same rank as ``logits``: one-hot or already soft) are smoothed
    as they are. The result is float32.

    Args:
        logits: the model's outputs, classes on the last axis: ``(N, K)`` or ``(N, T, K)``.
        targets: integer labels ``(N,)`` / ``(N, T)``, or dense targets of the logits' shape.
        smoothing: the fraction of mass spread uniformly, in ``[0, 1]``.

    Example:
        >>> import jax.numpy as jnp
        >>> print(smooth_labels(jnp.zeros((1, 4)), jnp.array([2]), smoothing=0.2))
        [[0.05 0.05 0.85 0.05]]
    """
    num_classes = logits.shape[-1]
    if targets.ndim == logits.ndim:
        dense = targets.astype(jnp.float32)
    else:
        dense = jax.nn.one_hot(targets, num_classes, dtype=jnp.float32)
    return dense * (1.0 - smoothing) + smoothing / num_classes


class LabelSmoothing(Algorithm):
    """Train against smoothed targets: ``(1 - smoothing) * one_hot + smoothing / num_classes``.

    Runs inside the compiled step. At ``BEFORE_LOSS`` the batch's targets are replaced by
    :func:`smooth_labels` of them (integer labels are one-hot encoded to the logits' last
    dimension), so ``ComposerClassifier``'s cross-entropy uses the soft targets. At ``AFTER_LOSS``
    the original targets are put back, so later events see the batch as it was loaded.

    Args:
        smoothing: the fraction of each target's mass spread evenly over all classes, in
            ``[0, 1]``. ``0`` leaves the targets unchanged. Default: ``0.1``.
        target_key: where the targets are in the batch (a tuple/list index or a dict key).
            Default: ``1``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.label_smoothing import LabelSmoothing

        trainer = Trainer(model, train_loader, '10ep', optax.sgd(0.1),
                          algorithms=[LabelSmoothing(smoothing=0.1)])
        trainer.fit()
    """

    def __init__(self, smoothing: float = 0.1, target_key: int | str = 1) -> None:
        if isinstance(smoothing, bool) or not isinstance(smoothing, (int, float)) or not 0.0 <= smoothing <= 1.0:
            raise ValueError(f"smoothing={smoothing!r}: expected a number in [0, 1]")
        if isinstance(target_key, bool) or not isinstance(target_key, (int, str)):
            raise ValueError(f"target_key={target_key!r}: expected an int index or a str key into the batch")
        self.smoothing = float(smoothing)
        self.target_key = target_key

    @property
    def _stash(self) -> str:
        # The original targets live on the step's traced view between BEFORE_LOSS and AFTER_LOSS:
        # the view is dropped when the trace ends, so no tracer outlives it.
        return f"_{self.name}_original_targets"

    events = frozenset({Event.BEFORE_LOSS, Event.AFTER_LOSS})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Replace the targets by smoothed ones before the loss; put the originals back after it."""
        if event == Event.BEFORE_LOSS:
            if state.outputs is None:
                raise TypeError(
                    "LabelSmoothing needs the model's logits in state.outputs (a ComposerModel such as "
                    "ComposerClassifier); a plain module trained with loss_fn has none"
                )
            targets = state.batch_get_item(self.target_key)
            setattr(state, self._stash, targets)
            state.batch_set_item(self.target_key, smooth_labels(state.outputs, targets, self.smoothing))
        elif event == Event.AFTER_LOSS:
            state.batch_set_item(self.target_key, getattr(state, self._stash))

    def __repr__(self) -> str:
        return f"LabelSmoothing(smoothing={self.smoothing}, target_key={self.target_key!r})"
