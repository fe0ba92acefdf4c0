"""Sharpness-Aware Minimization (Foret et al. 2021): descend with the gradient at a nearby worst-case point.

SAM looks ``rho`` along the normalised gradient, ``e = rho * g / (||g|| + eps)``, and updates the
original weights with the gradient computed at ``params + e``. The functional form is
:func:`sam_gradients`; :class:`SAM` computes it inside the compiled step at ``AFTER_BACKWARD`` with
the step's own extra pass ``state.loss_and_grad``, so each SAM step costs one more forward and
backward.

Why not ``optax.contrib.sam``: that optimizer wrapper either spends whole train steps (whole
batches) on its adversarial ascent step in its drop-in mode, which changes what a step and a batch
mean, or, in its opaque mode, needs a gradient function passed to ``optimizer.update`` as an extra
argument, which the trainer's step does not pass. The second pass inside the step is exact (the
perturbed gradient is taken on the same batch, as in the paper and in Composer) and simpler.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from composerjax import Algorithm, Event, Logger, State

__all__ = ["SAM", "sam_gradients", "sam_perturbation"]


def sam_perturbation(grads: Any, rho: float = 0.05, epsilon: float = 1e-12) -> Any:
    """Return ``e = rho * grads / (global_norm(grads) + epsilon)``: the ascent step SAM takes.

    Example:
        >>> import jax.numpy as jnp
        >>> sam_perturbation({'w': jnp.array([3.0, 4.0])}, rho=0.5, epsilon=0.0)['w']
        Array([0.3, 0.4], dtype=float32)
    """
    scale = rho / (optax.tree.norm(grads) + epsilon)
    return jax.tree.map(lambda g: g * scale.astype(g.dtype), grads)


def sam_gradients(
    grad_fn: Callable[[Any], Any], params: Any, grads: Any, rho: float = 0.05, epsilon: float = 1e-12
) -> Any:
    """Return SAM's gradient: ``grad_fn(params + e)`` with ``e`` from :func:`sam_perturbation` of ``grads``.

    Args:
        grad_fn: the gradient of the loss as a function of the parameters (same batch as ``grads``).
        params: the current parameters.
        grads: the gradient at ``params``.
        rho: the radius of the neighbourhood searched for the worst case.
        epsilon: keeps the normalisation finite when the gradient is zero.

    Example:
        >>> import jax, jax.numpy as jnp
        >>> loss = lambda p: jnp.sum(p['w'] ** 4)
        >>> params = {'w': jnp.array([1.0])}
        >>> sam_gradients(jax.grad(loss), params, jax.grad(loss)(params), rho=1.0)['w']  # 4 * 2**3
        Array([32.], dtype=float32)
    """
    perturbation = sam_perturbation(grads, rho, epsilon)
    perturbed = jax.tree.map(lambda p, e: p + e.astype(p.dtype), params, perturbation)
    return grad_fn(perturbed)


class SAM(Algorithm):
    """Replace each step's gradient by the gradient at the worst-case nearby weights (SAM).

    At ``AFTER_BACKWARD`` (traced) the gradient is recomputed at ``params + rho * g / (||g|| + eps)``
    on the same batch with ``state.loss_and_grad``; the optimizer then updates the original
    weights with it. The reported loss stays the loss at the original weights. With
    ``interval > 1`` SAM runs only on every ``interval``-th step (steps ``interval - 1``,
    ``2 * interval - 1``, ... counted from 0, as in Composer), decided on the host in ``match``, so
    the run alternates between two compiled steps, both cached.

    With ``device_train_microbatch_size``, ``AFTER_BACKWARD`` sees each microbatch, so the ascent
    direction is each microbatch's own gradient (the "m-sharpness" variant of the paper) rather
    than the whole batch's.

    Args:
        rho: the neighbourhood radius. Default: ``0.05``.
        epsilon: added to the gradient norm before dividing. Default: ``1e-12``.
        interval: run SAM every ``interval`` steps (plain steps in between). Default: ``1``.

    Example::

        from composerjax import Trainer
        from composerjax.algorithms.sam import SAM

        trainer = Trainer(model, train_loader, '10ep', optax.sgd(0.1, momentum=0.9),
                          algorithms=[SAM(rho=0.05, interval=1)])
        trainer.fit()
    """

    def __init__(self, rho: float = 0.05, epsilon: float = 1e-12, interval: int = 1) -> None:
        if isinstance(rho, bool) or not isinstance(rho, (int, float)) or not rho >= 0:
            raise ValueError(f"rho={rho!r}: expected a number >= 0")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) or not epsilon > 0:
            raise ValueError(f"epsilon={epsilon!r}: expected a positive number")
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"interval={interval!r}: expected an integer >= 1 (steps)")
        self.rho = float(rho)
        self.epsilon = float(epsilon)
        self.interval = interval

    events = frozenset({Event.AFTER_BACKWARD})

    def match(self, event: Event, state: State) -> bool:
        """Run at ``AFTER_BACKWARD`` on every ``interval``-th step (host decision, per batch)."""
        return event == Event.AFTER_BACKWARD and (state.timestamp.batch.value + 1) % self.interval == 0

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        """Replace ``state.grads`` by the gradient at the perturbed weights, on the same batch."""
        batch = state.batch

        def grad_fn(params: Any) -> Any:
            return state.loss_and_grad(params, batch)[1]

        state.grads = sam_gradients(grad_fn, state.params, state.grads, self.rho, self.epsilon)

    def __repr__(self) -> str:
        return f"SAM(rho={self.rho}, epsilon={self.epsilon}, interval={self.interval})"
