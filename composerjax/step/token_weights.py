"""Composer's ``accumulate_train_batch_on_tokens``: each microbatch weighs by the tokens its loss averages over.

With padding or masked prompts, microbatches hold different numbers of real tokens. A mean of
the microbatches' losses with equal weights then over-weighs the tokens of sparse microbatches;
weighing microbatch ``i``'s loss and gradient by ``tokens_i / tokens_of_the_batch`` (Composer's
scaling) makes the accumulated gradient the whole batch's mean over its real tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax.models.function_model import ModelFunctions

__all__ = ["microbatch_weights"]


def microbatch_weights(functions: ModelFunctions, model: nnx.Module, microbatches: Any) -> jax.Array | None:
    """Each microbatch's share of the batch's loss tokens, ``(count,)`` float32; None when the model counts none.

    ``microbatches`` is the batch stacked on a new axis 0 (one entry per microbatch). The counts
    come from the model's ``loss_token_count`` (Composer's 'loss_generating' tokens), computed on
    the device inside the step: no host sync. The shares sum to 1, or are all 0 for a batch
    without one loss token (whose loss and gradient are then 0, as the full batch's are).

    Raises:
        ValueError: ``loss_token_count`` gave something other than one count per batch.

    Example:
        >>> from composerjax.models.function_model import model_functions
        >>> from composerjax.models.composer_model import ComposerModel
        >>> class Counted(ComposerModel):
        ...     def loss_token_count(self, batch):
        ...         return jnp.sum(batch[1] != -100)
        >>> targets = jnp.array([[[1, -100], [-100, -100]], [[1, 2], [3, -100]]])  # 2 microbatches of 2 rows
        >>> microbatch_weights(model_functions(Counted(), None), Counted(), (targets, targets)).tolist()
        [0.25, 0.75]
    """
    counts = jax.vmap(lambda microbatch: functions.loss_token_count(model, microbatch))(microbatches)
    if counts is None:
        return None
    count = jax.tree.leaves(microbatches)[0].shape[0]
    if not isinstance(counts, jax.Array) or counts.shape != (count,):
        shape = getattr(counts, "shape", type(counts).__name__)
        raise ValueError(f"{type(model).__name__}.loss_token_count(batch) gave {shape} for {count} microbatches "
                         "(stacked): expected one scalar count per batch (e.g. jnp.sum(targets != -100)), or None")
    counts = counts.astype(jnp.float32)
    return counts / jnp.maximum(jnp.sum(counts), 1.0)
