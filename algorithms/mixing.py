"""What MixUp and CutMix share: mix the inputs with a paired example, then the targets or the loss by the same weight.

:class:`BatchMixing` is their base: the flags and their checks, the events, the stash that carries
``(weight, indices, ...)`` from ``BEFORE_FORWARD`` to the loss events, and the target and loss
mixing. A subclass says only how it mixes the inputs (:meth:`BatchMixing.mix_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from composerjax import Algorithm, Event, Logger, State

__all__ = ["BatchMixing", "loss_with_targets", "mix_dense_targets", "num_classes_of"]


def mix_dense_targets(target: jax.Array, weight: jax.Array | float, indices: jax.Array, num_classes: int | None,
                      caller: str) -> jax.Array:
    """Return ``weight * y + (1 - weight) * y[indices]`` with ``y`` the dense (float32) targets.

    Integer labels are one-hot encoded to ``num_classes`` first; floating targets (one-hot or soft)
    are used as they are.

    Raises:
        ValueError: integer labels without ``num_classes`` (the message starts with ``caller``).

    Example:
        >>> mix_dense_targets(jnp.array([0, 1]), 0.75, jnp.array([1, 0]), 2, "mixup_targets").tolist()
        [[0.75, 0.25], [0.25, 0.75]]
    """
    if jnp.issubdtype(target.dtype, jnp.floating):
        dense = target.astype(jnp.float32)
    else:
        if num_classes is None:
            raise ValueError(f"{caller}: integer labels need num_classes to be one-hot encoded")
        dense = jax.nn.one_hot(target, num_classes, dtype=jnp.float32)
    return weight * dense + (1.0 - weight) * dense[indices]


def num_classes_of(outputs: object, num_classes: int | None) -> int | None:
    """The number of classes: the logits' last dimension, checked against ``num_classes`` if both exist.

    Example:
        >>> num_classes_of(jnp.zeros((2, 3)), None), num_classes_of(None, 5)
        (3, 5)
    """
    if isinstance(outputs, jax.Array):
        found = outputs.shape[-1]
        if num_classes is not None and num_classes != found:
            raise ValueError(f"num_classes={num_classes}, but the model's outputs have {found} classes "
                             f"(shape {outputs.shape})")
        return found
    return num_classes


def loss_with_targets(state: State, target_key: int | str, targets: jax.Array, algorithm: str) -> jax.Array:
    """The model's loss on ``state.outputs`` against the batch with its targets replaced by ``targets``.

    Raises:
        TypeError: the model has no ``loss(outputs, batch)`` to call again (``algorithm`` names the caller).
    """
    loss_fn = getattr(state.model, "loss", None)
    if state.outputs is None or not callable(loss_fn):
        raise TypeError(
            f"{algorithm}(interpolate_loss=True) needs a ComposerModel (such as ComposerClassifier) whose "
            "loss(outputs, batch) it can call again; with a plain module and loss_fn use interpolate_loss=False"
        )
    batch = state.batch
    state.batch_set_item(target_key, targets)
    permuted_batch, state.batch = state.batch, batch
    return jnp.asarray(loss_fn(state.outputs, permuted_batch), jnp.float32)


class BatchMixing(Algorithm):
    """Base of the algorithms that mix each example with a partner from its batch (MixUp, CutMix).

    At ``BEFORE_FORWARD`` :meth:`mix_inputs` replaces the inputs and returns ``(weight, indices, *extra)``,
    which the step's traced view carries to the loss events. Then either

    * ``interpolate_loss=False``: at ``BEFORE_LOSS`` the targets become
      ``weight * y + (1 - weight) * y[indices]`` (:meth:`mixed_targets`), or
    * ``interpolate_loss=True``: at ``BEFORE_BACKWARD`` the loss becomes
      ``weight * loss(y) + (1 - weight) * loss(y[indices])`` (:meth:`permuted_loss`).

    Args:
        interpolate_loss: interpolate the loss instead of the targets.
        input_key: where the inputs are in the batch (tuple/list index or dict key).
        target_key: where the targets are in the batch.
        num_classes: the number of classes, for one-hot encoding integer labels (None: the logits').
        **flags: the subclass's other True/False arguments, checked with ``interpolate_loss``.

    Example:
        >>> class Nothing(BatchMixing):
        ...     def mix_inputs(self, state, inputs, targets):
        ...         return inputs, (1.0, jnp.arange(inputs.shape[0]))
        >>> Nothing(interpolate_loss=True).match(Event.BEFORE_BACKWARD, None)
        True
    """

    events = frozenset({Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.BEFORE_BACKWARD})
    #: Names the algorithm in the errors of the loss interpolation.
    label: ClassVar[str] = "BatchMixing"
    #: ``(targets, weight, indices, num_classes) -> mixed targets``: the subclass's functional form of the
    #: target mixing (``staticmethod(mixup_targets)``), used at ``BEFORE_LOSS``.
    targets_function: ClassVar[Callable[..., jax.Array]]

    def __init__(self, interpolate_loss: bool = False, input_key: int | str = 0, target_key: int | str = 1,
                 num_classes: int | None = None, **flags: bool) -> None:
        for name, flag in (("interpolate_loss", interpolate_loss), *flags.items()):
            if not isinstance(flag, bool):
                raise ValueError(f"{name}={flag!r}: expected True or False")
        for name, key in (("input_key", input_key), ("target_key", target_key)):
            if isinstance(key, bool) or not isinstance(key, (int, str)):
                raise ValueError(f"{name}={key!r}: expected an int index or a str key into the batch")
        if num_classes is not None and (
            isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2
        ):
            raise ValueError(f"num_classes={num_classes!r}: expected None or an integer >= 2")
        self.interpolate_loss = interpolate_loss
        self.interpolates_loss = interpolate_loss  # read by the engine's loss-interpolation warning
        self.input_key, self.target_key = input_key, target_key
        self.num_classes = num_classes

    @property
    def _stash(self) -> str:
        # (weight, indices, *extra) live on the step's traced view from BEFORE_FORWARD to the loss
        # events; the view is dropped when the trace ends, so no tracer outlives it.
        return f"_{self.name}_mixing"

    def match(self, event: Event, state: State) -> bool:
        """Run at ``BEFORE_FORWARD``, then ``BEFORE_LOSS`` (targets) or ``BEFORE_BACKWARD`` (loss)."""
        if self.interpolate_loss:
            return event in (Event.BEFORE_FORWARD, Event.BEFORE_BACKWARD)
        return event in (Event.BEFORE_FORWARD, Event.BEFORE_LOSS)

    def mix_inputs(self, state: State, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        """``(mixed inputs, (weight, indices, *extra))`` of one (micro)batch; traced."""
        raise NotImplementedError(f"{type(self).__name__} must implement mix_inputs(state, inputs, targets)")

    def mixed_targets(self, state: State, targets: jax.Array, weight: jax.Array, indices: jax.Array,
                      *extra: Any) -> jax.Array:
        """The targets the loss sees: dense, mixed by ``weight`` (integer labels one-hot over the logits)."""
        num_classes = num_classes_of(state.outputs, self.num_classes)
        if isinstance(state.outputs, jax.Array) and targets.ndim == state.outputs.ndim:
            targets = targets.astype(jnp.float32)  # dense targets, whatever their dtype
        return type(self).targets_function(targets, weight, indices, num_classes)

    def permuted_loss(self, state: State, targets: jax.Array, indices: jax.Array, *extra: Any) -> jax.Array:
        """The model's loss against the partners' targets."""
        return loss_with_targets(state, self.target_key, targets[indices], self.label)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Mix the inputs; then the targets or the loss."""
        if event == Event.BEFORE_FORWARD:
            inputs, targets = state.batch_get_item(self.input_key), state.batch_get_item(self.target_key)
            mixed, stash = self.mix_inputs(state, inputs, targets)
            state.batch_set_item(self.input_key, mixed)
            setattr(state, self._stash, stash)
            return
        weight, indices, *extra = getattr(state, self._stash)
        targets = state.batch_get_item(self.target_key)
        if event == Event.BEFORE_LOSS:
            state.batch_set_item(self.target_key, self.mixed_targets(state, targets, weight, indices, *extra))
        elif event == Event.BEFORE_BACKWARD:
            permuted_loss = self.permuted_loss(state, targets, indices, *extra)
            state.loss = weight * state.loss + (1.0 - weight) * permuted_loss
