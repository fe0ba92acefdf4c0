"""The State: everything a training run knows, flowing through every event."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from composerjax.core.time import Time, Timestamp, TimeUnit
from composerjax.core.train_state import TrainState

if TYPE_CHECKING:
    from flax import nnx

__all__ = ["BatchRecord", "Checkpointable", "ResumePoint", "State", "as_max_duration", "instance_names"]


@runtime_checkable
class Checkpointable(Protocol):
    """What the State needs of its algorithms and callbacks: their host state, for checkpoints.

    :class:`~composerjax.core.algorithm.Algorithm` and :class:`~composerjax.core.callback.Callback`
    take the State in every method, so the State names them by this protocol instead of importing them.

    Example:
        >>> from composerjax.core import Algorithm, Callback
        >>> isinstance(Algorithm(), Checkpointable), isinstance(Callback(), Checkpointable)
        (True, True)
    """

    def state_dict(self) -> dict[str, Any]:
        """Host state to checkpoint."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        ...


class BatchRecord(NamedTuple):
    """One training batch on its way to the compiled step: as the loader gave it, and its device copy.

    ``state.batch`` is ``state.batch_record.host``. Assigning ``state.batch`` (a host event
    replacing the batch) makes a new record without a device copy, so a copy placed ahead of time
    (``device_prefetch``) can only ever go to the step with the batch it was made from.

    Attributes:
        host: the batch as the loader gave it (this process's share).
        device: the same batch placed on the devices with the step's batch sharding, or None (the
            step places ``host`` itself).

    Example:
        >>> state = State(model=None)
        >>> state.batch_record = BatchRecord((1, 2), "placed")
        >>> state.batch, state.batch_record.device
        ((1, 2), 'placed')
        >>> state.batch = (3, 4)  # replaced on the host: the placed copy no longer belongs to it
        >>> state.batch_record
        BatchRecord(host=(3, 4), device=None)
    """

    host: Any
    device: Any = None


_NO_BATCH = BatchRecord(None, None)

class ResumePoint(NamedTuple):
    """The checkpoint a run continues from, loaded in full: ``state.resumed_from`` from ``AFTER_LOAD`` on.

    Attributes:
        checkpoint: the checkpoint's folder (an absolute path, or its ``s3://``/``gs://`` URI).
        batch: the batches trained when it was saved; the run continues with batch ``batch + 1``.

    Example:
        >>> ResumePoint("/runs/a/checkpoints/ep0-ba40", 40).batch
        40
    """

    checkpoint: str
    batch: int


def as_max_duration(value: Time | str | int) -> Time:
    """``value`` as a training length: a Time in ep, iter, ba, sp, tok or sec (an int counts epochs).

    Raises:
        ValueError: a bad time string, a negative time, or 'dur' (a fraction of the run itself). An 'iter'
            length needs ``state.iteration_length``, checked when ``fit`` starts.

    Example:
        >>> as_max_duration('500ba')
        Time(500, TimeUnit.BATCH)
    """
    duration = Time.from_input(value, TimeUnit.EPOCH) if not isinstance(value, Time) else value
    if duration.unit is TimeUnit.DURATION:
        raise ValueError(f"max_duration='{duration}': a run cannot be measured in '{duration.unit.value}'; use ep, "
                         "iter, ba, sp, tok or sec (e.g. '10ep', '500ba', '2h')")
    if duration.value < 0:
        raise ValueError(f"max_duration='{duration}': expected a non-negative time")
    return duration


class State:
    """Everything a run knows: model, optimizer, time, data, algorithms, callbacks and device state.

    On host events the values are concrete. Inside the compiled step algorithms see a traced view of
    the same class (see ``composerjax.step``) where ``batch``, ``outputs``, ``loss``, ``grads``,
    ``model``, ``algorithm_state``, ``step``, ``progress`` and ``step_rng`` are tracers; host values
    are never overwritten with tracers.

    The trained parameters live on the device in ``train_state`` between steps and are merged back
    into ``model`` only when host code reads ``state.model``, so no step pays for a copy.

    Example:
        >>> import optax
        >>> from flax import nnx
        >>> state = State(model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1),
        ...               max_duration='10ba')
        >>> state.max_duration
        Time(10, TimeUnit.BATCH)
    """

    def __init__(
        self,
        model: nnx.Module,
        optimizer: Any = None,
        max_duration: Time | str | None = None,
        rng: jax.Array | None = None,
        algorithms: Sequence[Checkpointable] = (),
        callbacks: Sequence[Checkpointable] = (),
        dataloader: Any = None,
        dataloader_len: int | None = None,
        precision: str = "fp32",
        run_name: str = "run",
        mesh: jax.sharding.Mesh | None = None,
    ) -> None:
        self._model = model
        self._model_stale = False
        self._model_changed = False
        self.optimizer = optimizer
        self.max_duration = max_duration
        self.rng = rng if rng is not None else jax.random.key(0)
        self.algorithms: list[Any] = list(algorithms)  # Algorithm instances
        self.callbacks: list[Any] = list(callbacks)  # Callback instances
        self.dataloader = dataloader
        self.dataloader_len = dataloader_len
        self.precision = precision
        self.run_name = run_name
        #: The run folder for files (traces, profiles, logs): ``runs/<run_name>`` unless given.
        self.run_dir = f"runs/{run_name}"
        self.mesh = mesh
        self.timestamp = Timestamp()
        #: The clock before the last batch or epoch end moved it (None before the first batch), as
        #: Composer's; interval rules compare the two to see which multiples were crossed.
        self.previous_timestamp: Timestamp | None = None
        self._iteration_length: Time | None = None
        #: The evaluators of ``Trainer(eval_dataloader=...)`` (Composer's ``state.evaluators``).
        self.evaluators: list[Any] = []
        #: Which loader the current batches come from, as Composer's: ``'train'``, or the evaluator's
        #: label (``'eval'`` by default) between ``EVAL_START`` and ``EVAL_END``.
        self.dataloader_label = "train"
        #: The current batch and its device copy (``state.batch`` is its ``host``); see :class:`BatchRecord`.
        self.batch_record: BatchRecord = _NO_BATCH
        self.outputs: Any = None
        self.loss: Any = None
        self.grads: Any = None
        self._algorithm_state: dict[str, Any] = {}
        self.step_metrics: dict[str, Any] = {}
        self.metrics: dict[str, Any] = {}
        self.train_state: TrainState | None = None
        self.compile_count = 0
        # Set by Trainer(skip_nonfinite_updates=True) or NaNMonitor(policy='skip') before the step compiles.
        self.skip_nonfinite_updates = False
        #: One record (``composerjax.step.summary.CompiledStep``) per compiled step variant.
        self.compiled_steps: list[Any] = []
        #: The run summary logged at the first FIT_START (parameters, FLOPs per step, ...).
        self.run_summary: dict[str, Any] = {}
        self._sync_model: Callable[[], None] | None = None
        #: While the fit loop prefetches batches, the train loader's position after the last batch the
        #: loop took (the loader itself is ahead); None otherwise. Checkpoints record this.
        self.dataloader_position: Callable[[], Any] | None = None
        #: The checkpoint this run continues from (autoresume, or a full ``load_path`` load), set before
        #: ``AFTER_LOAD``; None for a run that starts at batch 0 or loaded weights only. Plugins that
        #: keep files across processes use it to drop what they wrote after that batch.
        self.resumed_from: ResumePoint | None = None

    # -- the model, kept in sync with the device state lazily ------------------------------------
    @property
    def model(self) -> nnx.Module:
        """The NNX module; reading it on the host first merges the latest trained values into it.

        Reading changes nothing the next step uses. To change the model on a host event, edit it
        and call :meth:`update_model` (or assign ``state.model = new_module``).
        """
        self.sync_model()
        return self._model

    @model.setter
    def model(self, value: nnx.Module) -> None:
        self.update_model(value)

    def update_model(self, model: nnx.Module | None = None) -> None:
        """Make the next step (or eval) start from ``state.model`` as the host code left it.

        The one way host code writes the model: after editing the module's variables in place (or
        with ``model``, a replacement module), the trainer re-splits it into the device state before
        the next compiled call, re-planning the step if its graph changed. Reading ``state.model``
        never does this.

        Example:
            >>> import optax
            >>> from flax import nnx
            >>> state = State(model=nnx.Linear(2, 1, rngs=nnx.Rngs(0)), optimizer=optax.sgd(0.1))
            >>> state.model.bias[...] = state.model.bias[...] + 1.0
            >>> state.model_changed
            False
            >>> state.update_model()
            >>> state.model_changed
            True
        """
        if model is not None:
            self._model = model
            self._model_stale = False
        else:
            self.sync_model()  # the edits were made to a module that holds the newest values
        self._model_changed = True

    @property
    def batch(self) -> Any:
        """The current batch as the loader gave it (host arrays); assigning it drops the device copy."""
        return self.batch_record.host

    @batch.setter
    def batch(self, batch: Any) -> None:
        self.batch_record = BatchRecord(batch, None)

    @property
    def model_changed(self) -> bool:
        """Whether host code wrote the model (:meth:`update_model`) since the device state was built."""
        return self._model_changed

    def model_taken(self) -> None:
        """The step runner took the host model into the device state (called by the runner only)."""
        self._model_changed = False

    # -- the host module and the device state, for the step runner -----------------------------
    @property
    def host_model(self) -> nnx.Module:
        """The module object as the host holds it, without merging the trained values first.

        For what does not depend on the values (the graph, a batch's expected shape); read
        ``state.model`` for the trained module.
        """
        return self._model

    @property
    def model_stale(self) -> bool:
        """Whether the device state moved on since the host module last took its values."""
        return self._model_stale

    def mark_model_stale(self, stale: bool = True) -> None:
        """The device state moved on (a step ran, weights were loaded): reading ``state.model`` merges first.

        ``stale=False``: the host module has just taken the device values.
        """
        self._model_stale = stale

    def bind_model_sync(self, merge: Callable[[], None]) -> None:
        """How the device values are merged into the host module (the step runner's ``sync_model``)."""
        self._sync_model = merge

    def sync_model(self) -> None:
        """Merge the trained values into the host module now, if it is behind the device state.

        Example: ``state.sync_model()`` at fit end gives the caller's own module the trained values.
        """
        if self._model_stale and self._sync_model is not None:
            self._sync_model()

    # -- device values, read and replaced from host events ---------------------------------------
    @property
    def params(self) -> Any:
        """The current parameters (device arrays, a nested dict like ``nnx.to_pure_dict``).

        Setting it on a host event replaces the parameters the next step (or eval) uses, keeping
        their shardings: e.g. swap in averaged weights before eval and back after it.
        """
        if self.train_state is None:
            raise RuntimeError("state.params: the device state is not built yet (it is built after INIT)")
        return self.train_state.params

    @params.setter
    def params(self, value: Any) -> None:
        if self.train_state is None:
            raise RuntimeError("state.params: the device state is not built yet (it is built after INIT)")
        current = self.train_state.params
        if jax.tree.structure(value) != jax.tree.structure(current):
            raise ValueError("state.params: the new parameters do not have the structure of the current ones")
        self.train_state = self.train_state._replace(params=_place_like(value, current, copy=True))
        self._model_stale = True

    @property
    def algorithm_state(self) -> dict[str, Any]:
        """Each algorithm's device state by name (``Algorithm.init_state``); latest values between steps."""
        if self.train_state is not None:
            return self.train_state.algorithm_state
        return self._algorithm_state

    @algorithm_state.setter
    def algorithm_state(self, value: dict[str, Any]) -> None:
        if self.train_state is not None:
            placed = _place_like(value, self.train_state.algorithm_state, copy=True)
            self.train_state = self.train_state._replace(algorithm_state=placed)
        else:
            self._algorithm_state = value

    @property
    def eval_metrics(self) -> dict[str, dict[str, Any]]:
        """Composer's name for :attr:`metrics`: ``{evaluator label: {metric name: value}}``, the same dict.

        Each evaluation (during ``fit`` or ``trainer.eval()``) sets its label's entry. Composer holds
        torchmetrics objects there and its code calls ``.compute()`` on them; here the entries are
        the computed values already. Empty until the first evaluation.

        Example:
            >>> state = State(model=None)
            >>> state.metrics["eval"] = {"MulticlassAccuracy": 0.75}
            >>> state.eval_metrics["eval"]["MulticlassAccuracy"], state.eval_metrics is state.metrics
            (0.75, True)
        """
        return self.metrics

    # -- time ------------------------------------------------------------------------------------
    @property
    def max_duration(self) -> Time | None:
        """How long to train, as a Time (set from a Time or a string like ``'10ep'``)."""
        return self._max_duration

    @max_duration.setter
    def max_duration(self, value: Time | str | None) -> None:
        if value is None:
            self._max_duration = None
            return
        self._max_duration = as_max_duration(value)

    @property
    def step(self) -> int:
        """The number of optimizer steps taken so far (a traced scalar inside the step)."""
        return self.timestamp.counts.batch

    @property
    def iteration_length(self) -> Time | None:
        """Epochs per iteration (Composer's): ITERATION_END/ITERATION_CHECKPOINT fire after that many epochs.

        None (the default): one iteration spans the whole run, ITERATION_START fires once and
        ``'iter'`` durations are refused. Set it (``'2ep'`` or an int) from a callback or before ``fit``.

        Example:
            >>> state = State(model=None)
            >>> state.iteration_length = "2ep"
            >>> state.iteration_length
            Time(2, TimeUnit.EPOCH)
        """
        return self._iteration_length

    @iteration_length.setter
    def iteration_length(self, value: Time | str | int | None) -> None:
        if value is None:
            self._iteration_length = None
            return
        length = Time.from_input(value, TimeUnit.EPOCH)
        if length.unit != TimeUnit.EPOCH or length.value < 1:
            raise ValueError(f"state.iteration_length={value!r}: expected a positive number of epochs ('2ep' or 2); "
                             "token-length iterations are not supported")
        self._iteration_length = length

    def get_elapsed_duration(self) -> float | None:
        """The fraction of ``max_duration`` elapsed, counted in its unit (None without a max_duration).

        Example:
            >>> state = State(model=None, max_duration="4ba")
            >>> state.get_elapsed_duration()
            0.0
        """
        if self.max_duration is None:
            return None
        return self.timestamp.get_progress(self.max_duration)

    @property
    def progress(self) -> float:
        """The fraction of ``max_duration`` elapsed (a traced scalar inside the step)."""
        duration = self.max_duration
        if duration is None:
            return 0.0
        if duration.unit == TimeUnit.EPOCH and self.dataloader_len:
            # Per batch, matching the traced progress (steps / steps in max_duration).
            return self.timestamp.counts.batch / (duration.value * self.dataloader_len)
        return self.timestamp.get_progress(duration)

    def batches_in_duration(self) -> int | None:
        """The number of batches ``max_duration`` spans, where it is known in advance (else None).

        Known for 'ba' durations, 'ep' durations with a sized dataloader, and 'sp' durations with a
        dataloader that has a fixed ``global_batch_size``.
        """
        duration = self.max_duration
        if duration is None:
            return None
        if duration.unit == TimeUnit.BATCH:
            return int(duration.value)
        if duration.unit == TimeUnit.EPOCH and self.dataloader_len:
            return int(duration.value * self.dataloader_len)
        if duration.unit == TimeUnit.SAMPLE and hasattr(self.dataloader, "global_batch_size"):
            return int(-(-duration.value // self.dataloader.global_batch_size))
        return None

    def stop_training(self) -> None:
        """End training after the current batch: ``max_duration`` becomes the batches done so far.

        As in Composer, the new ``max_duration`` is in batches (``'13ba'``), so a stop in the middle
        of an epoch is recorded exactly, in the run's hyperparameters and checkpoints alike.

        Example:
            >>> state = State(model=None, max_duration='3ep')
            >>> state.timestamp = state.timestamp.to_next_batch().to_next_batch()
            >>> state.stop_training()
            >>> state.max_duration
            Time(2, TimeUnit.BATCH)
        """
        self.max_duration = self.timestamp.batch

    # -- batch access, as in Composer ------------------------------------------------------------
    def batch_get_item(self, key: int | str | Callable[[Any], Any]) -> Any:
        """Return an item of the batch: a tuple/list index, a dict key, or ``fn(batch)``.

        Example:
            >>> state = State(model=None)
            >>> state.batch = (1, 2)
            >>> state.batch_get_item(1)
            2
        """
        if callable(key):
            return key(self.batch)
        try:
            return self.batch[key]
        except (KeyError, IndexError, TypeError) as error:
            raise KeyError(
                f"batch_get_item({key!r}): the batch is a {type(self.batch).__name__}; use an int index "
                "for tuples/lists or a key for dicts"
            ) from error

    def batch_set_item(self, key: int | str, value: Any) -> None:
        """Replace an item of the batch (a new tuple is built for tuples).

        Example:
            >>> state = State(model=None)
            >>> state.batch = (1, 2)
            >>> state.batch_set_item(0, 5)
            >>> state.batch
            (5, 2)
        """
        batch = self.batch
        if isinstance(batch, tuple):
            items = list(batch)
            items[key] = value
            self.batch = type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
        elif isinstance(batch, (list, dict)):
            batch = type(batch)(batch)
            batch[key] = value
            self.batch = batch
        else:
            raise TypeError(
                f"batch_set_item({key!r}): cannot set an item of a {type(batch).__name__} batch; "
                "batches must be tuples, lists or dicts"
            )

    # -- checkpointing ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: device state, time, rng, data position, plugins."""
        if self.train_state is None:
            raise RuntimeError("state_dict(): the device state is not built yet; call Trainer.fit first")
        dataloader_state = None
        if self.dataloader_position is not None:  # batches prefetched ahead: the position after the last one taken
            dataloader_state = self.dataloader_position()
        elif hasattr(self.dataloader, "state_dict"):
            dataloader_state = self.dataloader.state_dict()
        return {
            "train_state": self.train_state._asdict(),
            "rng": jax.random.key_data(self.rng),
            "timestamp": self.timestamp.state_dict(),
            "dataloader": dataloader_state,
            "algorithms": [a.state_dict() for a in self.algorithms],
            "callbacks": [c.state_dict() for c in self._checkpointed_callbacks()],
            "callback_names": instance_names(self._checkpointed_callbacks()),
            "run_name": self.run_name,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned (device arrays keep their current shardings)."""
        train_state = state_dict["train_state"]
        if not isinstance(train_state, TrainState):
            train_state = TrainState.from_dict(dict(train_state))
        self._check_structure(train_state)
        self.train_state = _place_like(train_state, self.train_state)
        self._model_stale = True
        self.rng = jax.random.wrap_key_data(np.asarray(state_dict["rng"]))
        self.timestamp = Timestamp.from_state_dict(state_dict["timestamp"])
        if state_dict.get("dataloader") is not None and hasattr(self.dataloader, "load_state_dict"):
            self.dataloader.load_state_dict(state_dict["dataloader"])
        saved = state_dict.get("algorithms", [])
        if len(saved) != len(self.algorithms):
            raise ValueError(f"load_state_dict: algorithms has {len(saved)} saved entries but the run has "
                             f"{len(self.algorithms)}")
        for plugin, plugin_state in zip(self.algorithms, saved):
            plugin.load_state_dict(plugin_state)
        # Callbacks may come and go between runs (a profiler added on restart): match them by class.
        saved = state_dict.get("callbacks", [])
        names = state_dict.get("callback_names")
        callbacks = self._checkpointed_callbacks()
        if names is None:
            if len(saved) != len(callbacks):
                raise ValueError(f"load_state_dict: callbacks has {len(saved)} saved entries but the run has "
                                 f"{len(callbacks)}")
            names = instance_names(callbacks)
        by_name = dict(zip(names, saved))
        for name, callback in zip(instance_names(callbacks), callbacks):
            if name in by_name:
                callback.load_state_dict(by_name[name])
        self.run_name = state_dict.get("run_name", self.run_name)

    def _checkpointed_callbacks(self) -> list[Checkpointable]:
        """The callbacks whose state checkpoints carry (the trainer's built-ins keep none)."""
        return [c for c in self.callbacks if getattr(c, "in_checkpoints", True)]

    def _check_structure(self, train_state: Any) -> None:
        if self.train_state is None:
            raise RuntimeError("load_state_dict(): build the device state first (Trainer does this at INIT)")
        expected = jax.tree.structure(self.train_state)
        got = jax.tree.structure(train_state)
        if expected != got:
            raise ValueError(f"load_state_dict: train_state structure does not match the model/optimizer.\n"
                             f"expected: {expected}\ngot: {got}")
        for path_a, a, b in zip(jax.tree_util.tree_flatten_with_path(self.train_state)[0],
                                jax.tree.leaves(self.train_state), jax.tree.leaves(train_state)):
            if np.shape(a) != np.shape(b):
                raise ValueError(f"load_state_dict: train_state{jax.tree_util.keystr(path_a[0])} has shape "
                                 f"{np.shape(b)}, expected {np.shape(a)}")


def instance_names(plugins: list[Any]) -> list[str]:
    """``['SpeedMonitor', 'LRMonitor', 'SpeedMonitor#1']``: class names, numbered from the second instance.

    The names algorithm state, saved callback state and ``composerjax explain`` use.

    Example:
        >>> instance_names([1, "a", 2])
        ['int', 'str', 'int#1']
    """
    seen: dict[str, int] = {}
    names = []
    for plugin in plugins:
        name = type(plugin).__name__
        names.append(f"{name}#{seen[name]}" if name in seen else name)
        seen[name] = seen.get(name, 0) + 1
    return names


def _place_like(values: Any, like: Any, copy: bool = False) -> Any:
    """Put host or device ``values`` on the devices and shardings of ``like``.

    With ``copy`` every leaf gets its own buffer: the step donates the train state, and two
    entries sharing one buffer (params set from an algorithm's own state) cannot both be donated.
    """

    def place(value: Any, reference: Any) -> Any:
        if not isinstance(reference, jax.Array):
            return value
        if copy and isinstance(value, jax.Array):
            value = jnp.array(value, copy=True)
        return jax.device_put(value, reference.sharding)

    return jax.tree.map(place, values, like)
