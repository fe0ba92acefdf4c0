"""How the step calls a model: a ComposerModel's methods, or a plain module with a loss function."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from clu import metrics as clu_metrics
from flax import nnx

from composerjax.metrics import Metric, mean_metrics, select_metrics
from composerjax.models.composer_model import ComposerModel, MetricSums

__all__ = ["BatchError", "ModelFunctions", "model_functions"]


class BatchError(ValueError):
    """A batch from the train data loader has the wrong structure, shape or type."""


class ModelFunctions:
    """The calls a step makes on a model, whatever kind of model it is, and a host check of its batches.

    ``loss`` returns ``(loss, metrics)``: metrics is a dict of arrays that joins
    ``state.step_metrics``.
    """

    def check_batch(self, model: nnx.Module, batch: Any, source: str = "train_dataloader",
                    index: int | str | None = None) -> None:
        """Refuse, on the host, a batch the step would use silently wrong; the default checks nothing.

        The trainer calls it on every train and eval batch before the batch goes to the device.

        Args:
            model: the host model (only its settings are read, never its arrays).
            batch: the batch as the data loader gave it.
            source: which loader it came from, for the message.
            index: which batch it is (or a range, for batches stacked into one call).

        Raises:
            BatchError: what is wrong with the batch, prefixed with ``source`` and ``index``.
        """

    def forward(self, model: nnx.Module, batch: Any) -> Any:
        raise NotImplementedError

    def loss(self, model: nnx.Module, outputs: Any, batch: Any, rng: jax.Array, step: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        raise NotImplementedError

    def loss_token_count(self, model: nnx.Module, batch: Any) -> jax.Array | None:
        """The tokens the loss of ``batch`` averages over (traced), or None: the loss is a mean over samples."""
        return None

    def eval_forward(self, model: nnx.Module, batch: Any) -> Any:
        """The outputs the eval metrics read (None for a model without a forward of its own)."""
        raise NotImplementedError

    def metric_states(self, model: nnx.Module, batch: Any, outputs: Any, metric_names: Any = None
                      ) -> dict[str, Metric]:
        """``{name: state}`` of one batch for the eval metrics ``metric_names`` selects (regexes; None: all)."""
        raise NotImplementedError

    def predict(self, model: nnx.Module, batch: Any) -> Any:
        raise NotImplementedError

    def train_metric_values(self, model: nnx.Module, batch: Any, outputs: Any) -> dict[str, jax.Array]:
        """``{'metrics/train/<name>': value}`` of one train batch (none unless the model asks for train metrics)."""
        return {}


class _ComposerModelFunctions(ModelFunctions):
    def check_batch(self, model: ComposerModel, batch: Any, source: str = "train_dataloader",
                    index: int | str | None = None) -> None:
        try:
            model.check_batch(batch)
        except ValueError as error:
            where = source if index is None else f"{source} batch {index}"
            raise BatchError(f"{where}: {error}") from None

    def forward(self, model: ComposerModel, batch: Any) -> Any:
        return model.forward(batch)

    def loss(self, model: ComposerModel, outputs: Any, batch: Any, rng: jax.Array, step: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return model.loss(outputs, batch), {}

    def loss_token_count(self, model: ComposerModel, batch: Any) -> jax.Array | None:
        return model.loss_token_count(batch)

    def eval_forward(self, model: ComposerModel, batch: Any) -> Any:
        return model.eval_forward(batch)

    def metric_states(self, model: ComposerModel, batch: Any, outputs: Any, metric_names: Any = None
                      ) -> dict[str, Metric]:
        metrics = model.get_metrics(is_train=False)
        if not metrics:  # a model of the older kind: its (sum, count) pairs, averaged
            return select_metrics(mean_metrics(model.metrics(outputs, batch)), metric_names)
        states = {}
        for name, metric in select_metrics(metrics, metric_names).items():
            state = model.update_metric(batch, outputs, metric)
            if not isinstance(state, clu_metrics.Metric):
                raise TypeError(f"{type(model).__name__}.update_metric(batch, outputs, metric) returned "
                                f"{type(state).__name__} for {name!r}: return the updated metric "
                                "(metric.update(outputs, targets)); metrics are values here, not updated in place")
            states[name] = state
        return states

    def predict(self, model: ComposerModel, batch: Any) -> Any:
        return model.eval_forward(batch)

    def train_metric_values(self, model: ComposerModel, batch: Any, outputs: Any) -> dict[str, jax.Array]:
        # Composer: train metrics are the model's get_metrics(is_train=True), off unless it returns some.
        return {f"metrics/train/{name}": model.update_metric(batch, outputs, metric).compute()
                for name, metric in model.get_metrics(is_train=True).items()}


class _LossFunctionModel(ModelFunctions):
    """A plain ``nnx.Module`` trained with ``loss_fn(model, batch[, rng, step])``.

    In the train step ``step`` is the traced step count; at eval it is ``None`` and ``rng`` a fixed key.
    """

    def __init__(self, loss_fn: Callable[..., Any]) -> None:
        self.loss_fn = loss_fn
        try:
            parameters = inspect.signature(loss_fn).parameters
        except (TypeError, ValueError):
            parameters = {}
        positional = [p for p in parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(positional) not in (2, 4):
            raise ValueError(
                f"loss_fn={getattr(loss_fn, '__name__', loss_fn)!r} takes {len(positional)} positional "
                "arguments; expected fn(model, batch) or fn(model, batch, rng, step)"
            )
        self.takes_rng_and_step = len(positional) == 4

    def _call(self, model: nnx.Module, batch: Any, rng: jax.Array | None, step: jax.Array | None
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
        result = self.loss_fn(model, batch, rng, step) if self.takes_rng_and_step else self.loss_fn(model, batch)
        if isinstance(result, tuple):
            if len(result) != 2 or not isinstance(result[1], dict):
                raise ValueError("loss_fn must return a scalar loss or a (loss, metrics: dict) pair")
            return result[0], result[1]
        return result, {}

    def forward(self, model: nnx.Module, batch: Any) -> Any:
        # The loss function does the forward pass itself; there are no separate outputs.
        return None

    def loss(self, model: nnx.Module, outputs: Any, batch: Any, rng: jax.Array, step: jax.Array
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
        return self._call(model, batch, rng, step)

    def eval_forward(self, model: nnx.Module, batch: Any) -> Any:
        return None

    def metric_states(self, model: nnx.Module, batch: Any, outputs: Any, metric_names: Any = None
                      ) -> dict[str, Metric]:
        # At eval no optimizer step is taken: step is None (as state.step is for algorithms there), so a
        # loss_fn can branch on it; the rng is one fixed key, so evaluations are repeatable.
        try:
            loss, extra = self._call(model, batch, jax.random.key(0), None)
        except TypeError as error:
            if not self.takes_rng_and_step or "NoneType" not in str(error):
                raise
            raise TypeError(f"loss_fn={getattr(self.loss_fn, '__name__', self.loss_fn)!r} failed at eval, where it "
                            f"is called with step=None (no optimizer step is taken): {error}. Branch on "
                            "`step is None` for the eval loss") from error
        count = jnp.asarray(jax.tree.leaves(batch)[0].shape[0], jnp.float32)
        sums: MetricSums = {"loss": (loss * count, count)}
        for name, value in extra.items():
            sums[name] = (jnp.mean(value) * count, count)
        return select_metrics(mean_metrics(sums), metric_names)

    def predict(self, model: nnx.Module, batch: Any) -> Any:
        inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
        return model(inputs)


def model_functions(model: nnx.Module, loss_fn: Callable[..., Any] | None) -> ModelFunctions:
    """Pick how the step calls ``model``: its ComposerModel methods, or ``loss_fn``.

    Raises:
        TypeError: for a plain module without ``loss_fn``.
    """
    if loss_fn is not None:
        return _LossFunctionModel(loss_fn)
    if isinstance(model, ComposerModel):
        return _ComposerModelFunctions()
    raise TypeError(
        f"model is a {type(model).__name__}, not a ComposerModel: pass loss_fn=fn with fn(model, batch) or "
        "fn(model, batch, rng, step) returning a loss or (loss, metrics), or wrap it in ComposerClassifier"
    )
