"""NoOpModel: swap the model for a one-parameter stand-in, to time the data pipeline without model cost.

Every batch is still loaded, transferred and fed to a compiled train step (forward, loss, backward,
optimizer update, traced algorithms), but the model does almost no work: what remains is the cost
of everything around the model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax import Algorithm, ComposerModel, Event, Logger, State

__all__ = ["NoOpModel", "NoOpModelClass", "noop_model_for"]


def _first_leaf(batch: Any) -> jax.Array:
    return batch[0] if isinstance(batch, (tuple, list)) else jax.tree.leaves(batch)[0]


class NoOpModelClass(ComposerModel):
    """A model with one parameter whose outputs are zeros of shape ``(batch, num_classes)``.

    ``forward`` reads only the shape of the batch's first array; ``loss`` is the mean of the outputs,
    a (zero) differentiable function of the parameter, so the whole train step still runs. Calling
    the module directly (``model(x)``) also works, for trainers driven by a ``loss_fn``.

    Example:
        >>> model = NoOpModelClass(num_classes=3)
        >>> outputs = model.forward((jnp.ones((4, 8)), jnp.zeros(4, jnp.int32)))
        >>> outputs.shape, float(model.loss(outputs, None))
        ((4, 3), 0.0)
    """

    def __init__(self, num_classes: int = 1) -> None:
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
            raise ValueError(f"num_classes={num_classes!r}: expected a positive integer")
        self.weight = nnx.Param(jnp.ones((1,), jnp.float32))
        self.num_classes = num_classes

    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.weight[...]
        return jnp.zeros((x.shape[0], self.num_classes), weight.dtype) * weight

    def forward(self, batch: Any) -> jax.Array:
        return self(_first_leaf(batch))

    def loss(self, outputs: jax.Array, batch: Any) -> jax.Array:
        return jnp.mean(outputs)


def noop_model_for(model: nnx.Module) -> NoOpModelClass:
    """Return the ``NoOpModelClass`` that stands in for ``model`` (it is not run, only inspected).

    Its outputs have ``model.num_classes`` columns when ``model`` has an integer ``num_classes``
    (``ComposerClassifier`` does), else 1. A whole model cannot be replaced in place, so this
    returns the new model rather than a count.

    Example:
        >>> from composerjax import ComposerClassifier
        >>> noop_model_for(ComposerClassifier(nnx.Linear(4, 5, rngs=nnx.Rngs(0)), 5)).num_classes
        5
    """
    num_classes = getattr(model, "num_classes", None)
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        num_classes = 1
    return NoOpModelClass(num_classes)


class NoOpModel(Algorithm):
    """Replace the model by a one-parameter ``NoOpModelClass`` at INIT, to profile everything but the model.

    Runs once at ``Event.INIT`` (host): sets ``state.model`` to ``noop_model_for(state.model)``; the
    trainer builds its steps (and the optimizer state) for whatever model is there after INIT.
    Outputs are zeros of shape ``(batch, num_classes)`` (``num_classes`` of a ``ComposerClassifier``,
    else 1), whatever the original model would have returned; the real model is never run.

    Example::

        trainer = Trainer(model, loader, '100ba', algorithms=[NoOpModel()])
        trainer.fit()  # seconds per batch now measure data loading and the step's fixed cost
    """

    events = frozenset({Event.INIT})

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        state.model = noop_model_for(state.model)
