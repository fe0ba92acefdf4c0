"""MixUp: train on convex combinations of pairs of examples and of their targets.

The functional forms are :func:`mixup_sample` (draw the mixing coefficient and the pairing),
:func:`mixup_batch` (mix the inputs) and :func:`mixup_targets` (mix the targets); :class:`MixUp`
applies them inside the compiled train step with the step's random key.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from composerjax import State
from composerjax.algorithms.mixing import BatchMixing, mix_dense_targets

__all__ = ["MixUp", "mixup_batch", "mixup_sample", "mixup_targets"]


@functools.partial(jax.jit, static_argnames=("batch_size", "alpha"))
def mixup_sample(rng: jax.Array, batch_size: int, alpha: float = 0.2) -> tuple[jax.Array, jax.Array]:
    """Draw ``(mixing, indices)``: the weight of the original examples and the partner of each one.

    ``mixing = max(z, 1 - z)`` with ``z ~ Beta(alpha, alpha)``, so the original example always has
    the larger weight (``alpha = 0`` gives ``mixing = 1``: no mixing); ``indices`` is a random
    permutation of ``range(batch_size)``. Traceable: ``batch_size`` and ``alpha`` are static.

    Args:
        rng: a JAX random key.
        batch_size: the number of examples in the batch.
        alpha: the Beta distribution's concentration, ``>= 0``.

    Returns:
        ``mixing`` (float32 scalar in ``[0.5, 1]``) and ``indices`` (int32, ``(batch_size,)``).

    Example:
        >>> mixing, indices = mixup_sample(jax.random.key(0), batch_size=4, alpha=0.2)
        >>> bool(0.5 <= mixing <= 1.0), sorted(indices.tolist())
        (True, [0, 1, 2, 3])
    """
    beta_key, permutation_key = jax.random.split(rng)
    if alpha == 0:
        mixing = jnp.ones((), jnp.float32)
    else:
        z = jax.random.beta(beta_key, alpha, alpha, dtype=jnp.float32)
        mixing = jnp.maximum(z, 1.0 - z)
    indices = jax.random.permutation(permutation_key, batch_size).astype(jnp.int32)
    return mixing, indices


def mixup_batch(
    input: jax.Array, target: jax.Array, mixing: jax.Array | float, indices: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Return ``(mixing * input + (1 - mixing) * input[indices], target[indices])``.

    The mixed input keeps a floating ``input``'s dtype; integer inputs (e.g. uint8 images) come back
    as float32 rather than truncated, as Composer's do (as float); the permuted targets are what the mixed-in examples
    were labelled, for interpolating targets (:func:`mixup_targets`) or losses.

    Args:
        input: a batch of inputs, examples on the first axis.
        target: the batch's targets, examples on the first axis.
        mixing: the weight of the original examples.
        indices: the partner of each example (a permutation of the batch).

    Example:
        >>> import jax.numpy as jnp
        >>> mixed, permuted = mixup_batch(jnp.array([[0.0], [4.0]]), jnp.array([0, 1]), 0.75, jnp.array([1, 0]))
        >>> mixed.tolist(), permuted.tolist()
        ([[1.0], [3.0]], [1, 0])
    """
    mixed = mixing * input + (1.0 - mixing) * input[indices]
    dtype = input.dtype if jnp.issubdtype(input.dtype, jnp.floating) else jnp.float32
    return mixed.astype(dtype), target[indices]


def mixup_targets(
    target: jax.Array, mixing: jax.Array | float, indices: jax.Array, num_classes: int | None = None
) -> jax.Array:
    """Return ``mixing * y + (1 - mixing) * y[indices]`` with ``y`` the dense (float32) targets.

    Integer labels are one-hot encoded to ``num_classes`` first; floating targets (one-hot or soft)
    are used as they are.

    Raises:
        ValueError: integer labels without ``num_classes``.

    Example:
        >>> import jax.numpy as jnp
        >>> mixup_targets(jnp.array([0, 1]), 0.75, jnp.array([1, 0]), num_classes=2).tolist()
        [[0.75, 0.25], [0.25, 0.75]]
    """
    return mix_dense_targets(target, mixing, indices, num_classes, "mixup_targets")


class MixUp(BatchMixing):
    """Train on convex combinations of each example with a randomly paired one from the same batch.

    Runs inside the compiled step. At ``BEFORE_FORWARD`` it draws ``(mixing, indices)`` with
    :func:`mixup_sample` from the step's key (``state.step_rng``: new every step, reproducible from
    the trainer's seed) and replaces the inputs with ``mixing * x + (1 - mixing) * x[indices]``.
    Then either

    * ``interpolate_loss=False``: at ``BEFORE_LOSS`` the targets become
      ``mixing * y + (1 - mixing) * y[indices]`` (integer labels are one-hot encoded over the
      logits' last dimension, or ``num_classes``), or
    * ``interpolate_loss=True``: at ``BEFORE_BACKWARD`` the loss becomes
      ``mixing * loss(y) + (1 - mixing) * loss(y[indices])`` with the model's own ``loss`` (a
      ComposerModel's), leaving the targets as they are. Exact for losses linear in the targets,
      such as cross-entropy.

    The same ``mixing`` is used for the whole batch. With ``device_train_microbatch_size`` it runs
    per microbatch (each has its own ``state.step_rng``): partners come from the same microbatch.

    Args:
        alpha: concentration of the symmetric Beta distribution ``mixing`` is drawn from, ``>= 0``.
            Small values mix little; ``alpha = 1`` draws ``mixing`` uniformly; ``0`` disables
            mixing. Default: ``0.2``.
        interpolate_loss: interpolate the loss instead of the targets. Default: ``False``.
        input_key: where the inputs are in the batch (tuple/list index or dict key). Default: ``0``.
        target_key: where the targets are in the batch. Default: ``1``.
        num_classes: the number of classes, for one-hot encoding integer labels. ``None`` takes it
            from the model's logits (``state.outputs.shape[-1]``); set it when the model has no
            separate outputs (a plain module trained with ``loss_fn`` that accepts soft targets).
            Default: ``None``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.mixup import MixUp

        trainer = Trainer(ComposerClassifier(net, num_classes=10), train_loader, '10ep', optax.sgd(0.1),
                          algorithms=[MixUp(alpha=0.2)])
        trainer.fit()
    """

    label = "MixUp"
    targets_function = staticmethod(mixup_targets)

    def __init__(
        self,
        alpha: float = 0.2,
        interpolate_loss: bool = False,
        input_key: int | str = 0,
        target_key: int | str = 1,
        num_classes: int | None = None,
    ) -> None:
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha >= 0:
            raise ValueError(f"alpha={alpha!r}: expected a number >= 0 (the Beta distribution's concentration)")
        super().__init__(interpolate_loss, input_key, target_key, num_classes)
        self.alpha = float(alpha)

    def mix_inputs(self, state: State, inputs: jax.Array, targets: jax.Array) -> tuple[jax.Array, tuple[Any, ...]]:
        """``mixing * x + (1 - mixing) * x[indices]``, with ``(mixing, indices)`` drawn from the step's key."""
        _refuse_token_ids(inputs, targets)
        mixing, indices = mixup_sample(self.sample_key(state.step_rng), inputs.shape[0], self.alpha)
        mixed, _ = mixup_batch(inputs, targets, mixing, indices)
        return mixed, (mixing, indices)

    def __repr__(self) -> str:
        return (f"MixUp(alpha={self.alpha}, interpolate_loss={self.interpolate_loss}, input_key={self.input_key!r}, "
                f"target_key={self.target_key!r}, num_classes={self.num_classes!r})")


def _refuse_token_ids(inputs: jax.Array, targets: jax.Array) -> None:
    """Raise on ``(N, T)`` integer inputs with a target per position: token ids, which cannot be interpolated."""
    if jnp.issubdtype(inputs.dtype, jnp.integer) and inputs.ndim == 2 and targets.shape == inputs.shape:
        raise ValueError(
            f"MixUp: the inputs are integer sequences ({inputs.dtype} of shape {tuple(inputs.shape)}) with a target "
            "per position, i.e. token ids, which cannot be interpolated (a language model looks them up in an "
            "embedding). MixUp is for images and float features: remove it from a language-model run")

