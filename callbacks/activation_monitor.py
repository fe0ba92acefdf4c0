"""Activation monitor: per-layer statistics of the outputs of every layer, computed inside the train step."""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import get_opaque_trace_state

from composerjax import Callback, Logger, State

__all__ = ["ActivationMonitor", "activation_statistics"]

log = logging.getLogger(__name__)


def activation_statistics(activations: Sequence[Any]) -> dict[str, jax.Array]:
    """Return ``mean``, ``max_abs`` and ``l2_norm`` over every floating element of ``activations``.

    ``activations`` is a list of arrays or pytrees (one per call of a layer); all their floating leaves
    count as one set of numbers. The statistics are float32 scalars and carry no gradient.

    Example:
        >>> import jax.numpy as jnp
        >>> stats = activation_statistics([jnp.array([3.0, -4.0]), jnp.array([[0.0]])])
        >>> {name: round(float(value), 4) for name, value in stats.items()}
        {'mean': -0.3333, 'max_abs': 4.0, 'l2_norm': 5.0}
    """
    leaves = [jax.lax.stop_gradient(leaf).astype(jnp.float32) for leaf in jax.tree.leaves(list(activations))
              if jnp.issubdtype(jnp.result_type(leaf), jnp.inexact)]
    if not leaves:
        raise ValueError("activation_statistics: no floating-point arrays among the activations")
    count = sum(leaf.size for leaf in leaves)
    total = sum(jnp.sum(leaf) for leaf in leaves)
    squares = sum(jnp.sum(jnp.square(leaf)) for leaf in leaves)
    max_abs = functools.reduce(jnp.maximum, [jnp.max(jnp.abs(leaf)) for leaf in leaves])
    return {"mean": total / count, "max_abs": max_abs, "l2_norm": jnp.sqrt(squares)}


class ActivationMonitor(Callback):
    """Report the mean, largest magnitude and L2 norm of every layer's output at every train step.

    A layer is a module that owns parameters directly (``nnx.Linear``, ``nnx.Conv``, ``nnx.Embed``,
    norms, ...). At ``BEFORE_FORWARD`` (inside the compiled step, while it is traced) the monitor
    starts recording what those modules' ``__call__`` returns during the model's own forward pass; at
    ``AFTER_FORWARD`` it reduces each output to three scalars and puts them in ``state.step_metrics``
    as ``activations/<module path>/{mean,max_abs,l2_norm}``. The model runs once, the reductions fuse
    into the step, and the values come back with every step's loss: loggers get them as
    ``train/activations/...`` for every batch, fetched with the loss every ``log_interval`` batches,
    with no extra device-to-host sync.

    The statistics are computed at every step (a few reductions over activations the step holds
    anyway): the step's outputs are fixed when it compiles, so there is no per-batch interval.

    Limits: only ``__call__`` of modules reachable as attributes of the model is seen, so layers
    created inside ``nnx.scan``/``nnx.vmap`` are not, and layers called inside a ``jax.lax.scan`` or
    ``jax.checkpoint`` within the model are skipped with a warning; a layer called several times is
    summarised over all its calls; with gradient accumulation the values are means over
    microbatches (so ``max_abs`` is the mean of the microbatch maxima).

    Args:
        ignore_module_types: module classes to leave out (subclasses included), e.g.
            ``(nnx.LayerNorm,)``.

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.activation_monitor import ActivationMonitor

        trainer = Trainer(model, loader, max_duration='1ep', callbacks=[ActivationMonitor()],
                          loggers=[TensorBoardLogger()])
        # TensorBoard shows train/activations/module/linear1/max_abs, ...
    """

    def __init__(self, ignore_module_types: Sequence[type] | None = None) -> None:
        ignored = tuple(ignore_module_types or ())
        for index, module_type in enumerate(ignored):
            if not (isinstance(module_type, type) and issubclass(module_type, nnx.Module)):
                raise ValueError(f"ignore_module_types[{index}]={module_type!r}: expected an nnx.Module subclass "
                                 "such as nnx.Dropout")
        self.ignore_module_types = ignored
        self._recording: _Recording | None = None
        self._warned: set[str] = set()

    def before_forward(self, state: State, logger: Logger) -> None:
        self._stop_recording()  # a trace that failed between the two events left one open
        layers = [(path, module) for path, module in nnx.iter_modules(state.model) if self._is_layer(module)]
        self._recording = _Recording(
            {id(module): _path_name(path, state.model) for path, module in layers},
            {type(module) for _, module in layers},
        )

    def after_forward(self, state: State, logger: Logger) -> None:
        recording = self._stop_recording()
        if recording is None:
            return
        for path, outputs in recording.outputs.items():
            for name, value in activation_statistics(outputs).items():
                state.step_metrics[f"activations/{path}/{name}"] = value
        for path in sorted(recording.inner_calls - set(recording.outputs) - self._warned):
            self._warned.add(path)
            log.warning("ActivationMonitor: no statistics for %s: it runs inside a jax transform within the model "
                        "(lax.scan, checkpoint, ...), whose values cannot leave that transform", path)

    def close(self, state: State, logger: Logger) -> None:
        self._stop_recording()

    def _is_layer(self, module: nnx.Module) -> bool:
        if isinstance(module, self.ignore_module_types):
            return False
        return any(isinstance(value, nnx.Param) for value in vars(module).values())

    def _stop_recording(self) -> _Recording | None:
        recording, self._recording = self._recording, None
        if recording is not None:
            recording.stop()
        return recording


def _path_name(path: tuple[Any, ...], model: nnx.Module) -> str:
    return "/".join(str(part) for part in path) if path else type(model).__name__


# -- recording what layers return -------------------------------------------------------------------
# Python looks ``__call__`` up on the class, so recording patches the layer classes for the length of
# one traced forward pass and restores them afterwards. A patched class records only calls on the
# instances some active recording asked for, so other models of the same class are untouched.
_lock = threading.Lock()
_active: list[_Recording] = []
_patched: dict[type, tuple[Any, int]] = {}  # class -> (its own __call__ or _MISSING, recordings using it)
_MISSING = object()


class _Recording:
    """The outputs of the modules whose ids are in ``layers``, by path, while it is active.

    The ids stay valid while it is active: the traced model being recorded holds those modules.
    """

    def __init__(self, layers: dict[int, str], classes: set[type]) -> None:
        self.layers = layers
        self.outputs: dict[str, list[Any]] = {}
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
                    recording.outputs.setdefault(path, []).append(output)
                else:
                    recording.inner_calls.add(path)
        return output

    return recording_call
