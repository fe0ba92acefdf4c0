"""Activation monitor: Composer's per-layer statistics of every layer's inputs and outputs, computed in the step."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from composerjax import Callback, Logger, State, Time, TimeUnit

__all__ = ["ActivationMonitor", "activation_statistics", "layer_activations"]

log = logging.getLogger(__name__)


def activation_statistics(value: Any) -> dict[str, jax.Array]:
    """Composer's four statistics of one activation: each taken over the last axis, then averaged.

    ``l2_norm`` (the vector norm of each row), ``average`` (the mean of every element), ``kurtosis``
    (``E[(x - mean)^4] / var^2`` of each row) and ``max`` (each row's largest value), all float32
    scalars without gradient. A scalar counts as one row of one element.

    Example:
        >>> import jax.numpy as jnp
        >>> stats = activation_statistics(jnp.array([[3.0, -4.0], [1.0, 2.0]]))
        >>> {name: round(float(value), 4) for name, value in stats.items()}
        {'l2_norm': 3.618, 'average': 0.5, 'kurtosis': 1.0, 'max': 2.5}
    """
    x = jax.lax.stop_gradient(jnp.asarray(value)).astype(jnp.float32)
    if x.ndim == 0:
        x = x[None]
    diffs = x - jnp.mean(x, axis=-1, keepdims=True)
    variance = jnp.mean(diffs ** 2, axis=-1)
    return {
        "l2_norm": jnp.mean(jnp.linalg.norm(x, axis=-1)),
        "average": jnp.mean(x),
        "kurtosis": jnp.mean(jnp.mean(diffs ** 4, axis=-1) / variance ** 2),
        "max": jnp.mean(jnp.max(x, axis=-1)),
    }


def _named_arrays(name: str, suffix: str, value: Any, into: dict[str, Any]) -> None:
    # Composer's naming: a list or tuple adds `_<i>` to the module name; dicts and non-float values are skipped.
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _named_arrays(f"{name}_{index}", suffix, item, into)
    elif isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype, jnp.floating):
        into[f"{name}{suffix}"] = value


def layer_activations(name: str, args: tuple[Any, ...], output: Any) -> dict[str, Any]:
    """The arrays of one layer call under Composer's key suffixes: ``<name>_input.<i>``, ``<name>_output.<i>``.

    Each positional argument is input ``i``; an output that is a tuple or list gives output ``i`` per
    item, any other output is output 0.

    Example:
        >>> import numpy as np
        >>> sorted(layer_activations('model.fc', (np.ones(2, np.float32),), np.zeros(3, np.float32)))
        ['model.fc_input.0', 'model.fc_output.0']
    """
    arrays: dict[str, Any] = {}
    for index, value in enumerate(args):
        _named_arrays(name, f"_input.{index}", value, arrays)
    outputs = output if isinstance(output, (list, tuple)) else (output,)
    for index, value in enumerate(outputs):
        _named_arrays(name, f"_output.{index}", value, arrays)
    return arrays


class ActivationMonitor(Callback):
    """Log Composer's statistics of every layer's inputs and outputs every ``interval``, computed in the step.

    A layer is a module that owns parameters directly (``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``,
    norms, ...). While the train step is traced, the monitor records what those modules receive and
    return during the model's own forward pass (``BEFORE_FORWARD`` to ``AFTER_FORWARD``) and reduces
    each floating array to Composer's four statistics (:func:`activation_statistics`), named as
    Composer names them: ``activations/{l2_norm,average,kurtosis,max}/<module>_{input,output}.<i>``,
    with the module's dotted path (``module.hidden``). The reductions run inside a ``lax.cond`` that
    is true only on logged batches, fuse into the one compiled step and come back with the loss, so
    there is no extra device-to-host sync; they reach loggers with the trainer's ``train/`` prefix.

    Which batches: with a 'ba' interval, the batches that start when the completed count is a
    multiple of it (batches 1, 26, 51, ... for '25ba', as Composer's); with an 'ep' interval, the
    first batch of every epoch whose completed count is a multiple of it (the statistics are then
    computed at every step and dropped on the host on the other batches).

    ``only_log_wandb`` (Composer's default True): when a :class:`WandBLogger` is among the loggers,
    the statistics go to it alone, under Composer's exact names, one batch later (fetched at the next
    batch end); with no W&B logger they are logged like any step value, as Composer falls back to.

    Limits: only ``__call__`` of modules reachable as attributes of the model is seen, so layers
    created inside ``nnx.scan``/``nnx.vmap`` are not, and layers called inside a ``jax.lax.scan`` or
    ``jax.checkpoint`` within the model are skipped with a warning; a layer called several times
    reports its last call (Composer logs every call under the same names, so the last is what
    loggers keep); with gradient accumulation the values are means over microbatches.

    Args:
        interval: how often, in 'ba' or 'ep' (an int is batches). Default ``'25ba'``; below 10 batches
            a warning notes the cost, as Composer's.
        ignore_module_types: leave out layers of these module classes (subclasses included, e.g.
            ``nnx.LayerNorm``) or whose dotted path contains one of these strings (Composer's
            meaning, e.g. ``['dropout', 'ln']``).
        only_log_wandb: send the statistics only to W&B loggers when there are any.

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.activation_monitor import ActivationMonitor

        trainer = Trainer(model, loader, max_duration='1ep', callbacks=[ActivationMonitor(interval='50ba')],
                          loggers=[TensorboardLogger()])
        # TensorBoard shows train/activations/max/module.linear1_output.0, ...
    """

    def __init__(self, interval: int | str | Time = "25ba", ignore_module_types: Sequence[type | str] | None = None,
                 only_log_wandb: bool = True) -> None:
        given = interval
        try:
            interval = Time.from_input(interval, TimeUnit.BATCH)
        except (TypeError, ValueError) as error:
            raise ValueError(f"ActivationMonitor(interval={interval!r}): expected a positive time in 'ba' or 'ep' "
                             "such as '25ba', or an int (batches)") from error
        if interval.unit not in (TimeUnit.BATCH, TimeUnit.EPOCH) or interval.value < 1:
            raise ValueError(f"ActivationMonitor(interval={given!r}): expected a positive time in 'ba' or 'ep' "
                             "such as '25ba', or an int (batches)")
        if interval.unit == TimeUnit.BATCH and interval.value < 10:
            log.warning("ActivationMonitor(interval=%s): below the recommended 10ba; the statistics add work to "
                        "the steps that compute them", interval)
        ignored = tuple(ignore_module_types or ())
        for index, module_type in enumerate(ignored):
            if not (isinstance(module_type, str) or (isinstance(module_type, type)
                                                     and issubclass(module_type, nnx.Module))):
                raise ValueError(f"ignore_module_types[{index}]={module_type!r}: expected an nnx.Module subclass "
                                 "such as nnx.Dropout, or a string that ignored module paths contain")
        if not isinstance(only_log_wandb, bool):
            raise ValueError(f"ActivationMonitor(only_log_wandb={only_log_wandb!r}): expected True or False")
        self.interval = interval
        self.ignore_module_types = ignored
        self.only_log_wandb = only_log_wandb
        self._recording: _Recording | None = None
        self._warned: set[str] = set()
        self._metric_names: set[str] = set()
        self._pending: tuple[int, dict[str, Any]] | None = None

    # -- inside the compiled step ----------------------------------------------------------------
    def before_forward(self, state: State, logger: Logger) -> None:
        self._stop_recording()  # a trace that failed between the two events left one open
        layers = [(path, module) for path, module in nnx.iter_modules(state.model) if self._is_layer(path, module)]
        self._recording = _Recording(
            {id(module): _path_name(path, state.model) for path, module in layers},
            {type(module) for _, module in layers},
        )

    def after_forward(self, state: State, logger: Logger) -> None:
        recording = self._stop_recording()
        if recording is None:
            return
        arrays: dict[str, Any] = {}
        for path, (args, output) in recording.calls.items():
            arrays.update(layer_activations(path, args, output))

        def statistics() -> dict[str, jax.Array]:
            return {f"activations/{stat}/{name}": value for name, array in arrays.items()
                    for stat, value in activation_statistics(array).items()}

        if self.interval.unit == TimeUnit.BATCH and self.interval.value > 1:
            names = tuple(jax.eval_shape(statistics))
            skipped = lambda: {name: jnp.zeros((), jnp.float32) for name in names}
            metrics = jax.lax.cond(state.step % self.interval.value == 0, statistics, skipped)
        else:
            metrics = statistics()
        self._metric_names = set(metrics)
        state.step_metrics.update(metrics)
        for path in sorted(recording.inner_calls - set(recording.calls) - self._warned):
            self._warned.add(path)
            log.warning("ActivationMonitor: no statistics for %s: it runs inside a jax transform within the model "
                        "(lax.scan, checkpoint, ...), whose values cannot leave that transform", path)

    # -- on the host -----------------------------------------------------------------------------
    def batch_end(self, state: State, logger: Logger) -> None:
        self._flush_pending(logger)
        counts = state.timestamp.counts
        if self.interval.unit == TimeUnit.BATCH:
            logged = (counts.batch - 1) % self.interval.value == 0
        else:
            logged = counts.batch_in_epoch == 1 and counts.epoch % self.interval.value == 0
        step_metrics = state.step_metrics
        if not logged:
            for name in self._metric_names:
                step_metrics.pop(name, None)
            return
        if self.only_log_wandb and self._wandb_loggers(logger):
            values = {name: step_metrics.pop(name) for name in self._metric_names if name in step_metrics}
            self._pending = (counts.batch, values)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._flush_pending(logger)

    def close(self, state: State, logger: Logger) -> None:
        self._stop_recording()

    def _flush_pending(self, logger: Logger) -> None:
        if self._pending is None:
            return
        step, values = self._pending
        self._pending = None
        metrics = {name: float(value) for name, value in jax.device_get(values).items()}
        for destination in self._wandb_loggers(logger):
            destination.log_metrics(metrics, step)

    @staticmethod
    def _wandb_loggers(logger: Logger) -> list[Any]:
        from composerjax.loggers.wandb_logger import WandBLogger

        return [destination for destination in logger.destinations if isinstance(destination, WandBLogger)]

    def _is_layer(self, path: tuple[Any, ...], module: nnx.Module) -> bool:
        types = tuple(ignored for ignored in self.ignore_module_types if isinstance(ignored, type))
        if types and isinstance(module, types):
            return False
        name = ".".join(str(part) for part in path)
        if any(isinstance(ignored, str) and ignored in name for ignored in self.ignore_module_types):
            return False
        return any(isinstance(value, nnx.Param) for value in vars(module).values())

    def _stop_recording(self) -> _Recording | None:
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.stop()
        return recording


def _path_name(path: tuple[Any, ...], model: nnx.Module) -> str:
    return ".".join(str(part) for part in path) if path else type(model).__name__


# -- recording what layers return -------------------------------------------------------------------
# Python looks ``__call__`` up on the class, so recording patches the layer classes for the length of
# one traced forward pass and restores them afterwards. A patched class records only calls on the
# instances some active recording asked for, so other models of the same class are untouched.
_lock = threading.Lock()
_active: list[_Recording] = []
_patched: dict[type, tuple[Any, int]] = {}  # class -> (its own __call__ or _MISSING, recordings using it)
_MISSING = object()


class _Recording:
    """The last call (positional arguments, output) of the modules whose ids are in ``layers``, by path.

    The ids stay valid while it is active: the traced model being recorded holds those modules.
    """

    def __init__(self, layers: dict[int, str], classes: set[type]) -> None:
        self.layers = layers
        self.calls: dict[str, tuple[tuple[Any, ...], Any]] = {}
        # Calls made under an inner trace (a lax.scan or checkpoint inside the model) return values of
        # that trace, which must not escape it: they are only noted in ``inner_calls``.
        self.trace = get_opaque_trace_state(convention="nnx")
        self.inner_calls: set[str] = set()
        self.classes = classes
        with _lock:
            for cls in self.classes:
                _patch(cls)
            _active.append(self)

    def stop(self) -> None:
        with _lock:
            if self in _active:
                _active.remove(self)
                for cls in self.classes:
                    _unpatch(cls)


def _patch(cls: type) -> None:
    own, users = _patched.get(cls, (cls.__dict__.get("__call__", _MISSING), 0))
    if users == 0:
        cls.__call__ = _recording_call(cls, cls.__call__)
    _patched[cls] = (own, users + 1)


def _unpatch(cls: type) -> None:
    own, users = _patched[cls]
    if users > 1:
        _patched[cls] = (own, users - 1)
        return
    del _patched[cls]
    if own is _MISSING:
        delattr(cls, "__call__")
    else:
        cls.__call__ = own


def _recording_call(cls: type, call: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(call)
    def recording_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        output = call(self, *args, **kwargs)
        # Only the outermost class records: a subclass's patched call may reach its base's.
        if type(self) is cls:
            for recording in _active:
                path = recording.layers.get(id(self))
                if path is None:
                    continue
                if get_opaque_trace_state(convention="nnx") == recording.trace:
                    recording.calls[path] = (args, output)
                else:
                    recording.inner_calls.add(path)
        return output

    return recording_call
