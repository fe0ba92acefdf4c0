"""OptimizerMonitor: global and per-parameter L2 norms of gradients, parameters and updates, computed in the step."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from composerjax import Callback, Logger, State

__all__ = ["OptimizerMonitor", "parameter_names", "l2_norms"]


def parameter_names(tree: Any) -> list[str]:
    """Dotted names of a parameter pytree's leaves, in ``jax.tree.leaves`` order.

    Example:
        >>> parameter_names({'module': {'layers': {0: {'kernel': 1, 'bias': 2}}}})
        ['module.layers.0.bias', 'module.layers.0.kernel']
    """
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        parts = [str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key)))) for key in path]
        names.append(".".join(parts))
    return names


def l2_norms(tree: Any, kind: str, per_parameter: bool = True) -> dict[str, jax.Array]:
    """``{'l2_norm/<kind>/global': norm}`` and, with ``per_parameter``, ``'l2_norm/<kind>/<name>'`` per leaf.

    Norms are computed in float32 whatever the leaves' dtype; the global norm is that of all leaves
    together (as ``optax.global_norm``). Traceable.

    Example:
        >>> l2_norms({'w': jnp.array([3.0, 4.0]), 'b': jnp.array([12.0])}, 'grad')['l2_norm/grad/global']
        Array(13., dtype=float32)
    """
    leaves = jax.tree.leaves(tree)
    squares = [jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in leaves]
    norms = {f"l2_norm/{kind}/global": jnp.sqrt(sum(squares))}
    if per_parameter:
        for name, square in zip(parameter_names(tree), squares):
            norms[f"l2_norm/{kind}/{name}"] = jnp.sqrt(square)
    return norms


class OptimizerMonitor(Callback):
    """Log L2 norms of the gradient, the parameters and the optimizer's update, globally and per parameter.

    The norms are computed inside the compiled step, at ``AFTER_OPTIMIZER_STEP`` (after the optimizer
    update, where ``state.grads`` is the whole batch's gradient even with microbatches, as the
    optimizer applied it: after any clipping at ``AFTER_TRAIN_BATCH``), and leave through
    ``state.step_metrics``; the trainer fetches them with the loss and logs them as ``train/<name>``:

    ===========================================  ===================================================
    ``train/l2_norm/grad/global``                norm of the whole gradient (``optax.global_norm``)
    ``train/l2_norm/grad/<parameter>``           norm of each parameter's gradient
                                                 (``module.layers.0.kernel``)
    ``train/l2_norm/param/global``, ``/<p>``     the same for the parameters after the update
    ``train/l2_norm/update/global``, ``/<p>``    the update the optimizer applied (new - old
                                                 parameters); with ``log_optimizer_metrics``
    ``train/l2_norm_ratio/update_param/global``  update norm / parameter norm; with
                                                 ``log_optimizer_metrics``
    ===========================================  ===================================================

    Norms are computed only on steps that end at a multiple of ``batch_log_interval`` (a
    ``lax.cond`` skips them on the others, so the step compiles once), and at ``BATCH_END`` the
    callback removes its entries from ``state.step_metrics`` on the other batches, so they are
    neither fetched nor logged.

    Args:
        log_optimizer_metrics: also log the norm of the optimizer's update and its ratio to the
            parameter norm.
        batch_log_interval: compute and log the norms every this many batches.

    Example::

        trainer = Trainer(model, train_loader, max_duration='1ep',
                          callbacks=[OptimizerMonitor(batch_log_interval=50)], loggers=[TensorboardLogger()])
    """

    def __init__(self, log_optimizer_metrics: bool = True, batch_log_interval: int = 10) -> None:
        if not isinstance(log_optimizer_metrics, bool):
            raise ValueError(f"OptimizerMonitor(log_optimizer_metrics={log_optimizer_metrics!r}): expected True "
                             "or False")
        if (isinstance(batch_log_interval, bool) or not isinstance(batch_log_interval, int)
                or batch_log_interval < 1):
            raise ValueError(f"OptimizerMonitor(batch_log_interval={batch_log_interval!r}): expected a positive "
                             "integer (batches)")
        self.log_optimizer_metrics = log_optimizer_metrics
        self.batch_log_interval = batch_log_interval
        self._params_before_update: Any = None
        self._metric_names: tuple[str, ...] = ()

    # -- inside the compiled step ----------------------------------------------------------------
    def after_backward(self, state: State, logger: Logger) -> None:
        # The parameters the optimizer is about to update (traced; dropped at AFTER_OPTIMIZER_STEP).
        if self.log_optimizer_metrics:
            self._params_before_update = state.params

    def after_optimizer_step(self, state: State, logger: Logger) -> None:
        grads, params, before = state.grads, state.params, self._params_before_update
        self._params_before_update = None

        def norms() -> dict[str, jax.Array]:
            metrics = {**l2_norms(grads, "grad"), **l2_norms(params, "param")}
            if before is not None:
                update = jax.tree.map(lambda new, old: new.astype(jnp.float32) - old.astype(jnp.float32),
                                      params, before)
                metrics.update(l2_norms(update, "update"))
                metrics["l2_norm_ratio/update_param/global"] = (
                    metrics["l2_norm/update/global"] / metrics["l2_norm/param/global"])
            return metrics

        if self.batch_log_interval == 1:
            metrics = norms()
        else:
            names = tuple(jax.eval_shape(norms))
            skipped = lambda: {name: jnp.zeros((), jnp.float32) for name in names}
            # state.step counts the steps before this one: this step ends batch state.step + 1.
            metrics = jax.lax.cond((state.step + 1) % self.batch_log_interval == 0, norms, skipped)
        self._metric_names = tuple(metrics)
        state.step_metrics.update(metrics)

    # -- on the host -----------------------------------------------------------------------------
    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch.value % self.batch_log_interval:
            step_metrics = state.step_metrics
            for name in self._metric_names:
                step_metrics.pop(name, None)
