"""Checkpoints on orbax's CheckpointManager: async saves at an interval, validated restore, autoresume."""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.parallel.sharding import path_of

__all__ = ["Checkpointer", "CheckpointMismatchError"]

# The train state's parts that make up the model's weights (all a weights-only checkpoint holds).
_MODEL_KEYS = ("params", "rest")
# What each train-state group is called in error messages.
_GROUP_NAMES = {
    "params": "model parameters",
    "rest": "model state (batch statistics, rng counters)",
    "opt_state": "optimizer state",
    "algorithm_state": "algorithm state",
    "clock": "step clock",
}


class CheckpointMismatchError(ValueError):
    """A checkpoint does not fit the model, optimizer or algorithms of the run that loads it."""


class Checkpointer:
    """Save ``State.state_dict()`` every ``interval`` into ``folder`` and restore it.

    Each checkpoint is one orbax ``Composite`` in ``folder/<batch index>/`` with two items:

    * ``state``: the device arrays, saved async: ``params`` and ``rest`` (the model's other
      variables), ``opt_state``, ``algorithm_state`` (EMA/SWA averages...) and the step ``clock``;
    * ``meta`` (JSON): ``host`` (rng, timestamp, data-loader position, algorithm and callback
      ``state_dict``s) and ``hparams`` (the run's hyperparameters, for people and tools).

    A weights-only checkpoint's ``state`` holds ``params`` and ``rest`` only.
    orbax writes each checkpoint into a temporary folder and renames it when every item is on
    disk, so a half-written checkpoint is never listed and the previous one stays loadable whatever
    happens to the process writing the next one.

    Before anything is read, :meth:`restore` compares the saved arrays (names, shapes) with the
    run's and raises :class:`CheckpointMismatchError` listing every difference.

    Args:
        folder: where checkpoints go (one sub-folder per saved batch index).
        interval: a Time in 'ep' or 'ba' (``'1ep'``, ``'500ba'``).
        keep: how many checkpoints to keep (None keeps all).
        weights_only: save only the model's variables (no optimizer, algorithm or host state).
        async_save: write in a background thread while training goes on.
        writer_niceness: the ``nice`` value for the threads orbax starts to write (Linux; 19 is
            the lowest priority): on a CPU backend they would otherwise take cores from the
            train steps. None leaves them alone.
        writer_idle: also put those threads in Linux's ``SCHED_IDLE`` class, so they run only
            on a core that nothing else wants (``benchmarks/checkpoint.py``: a smaller step-time
            cost while a save is in flight than ``nice 19`` alone, whose threads still get a slice).
            Threads they start inherit the class. Ignored where the OS has no ``SCHED_IDLE``.
        writer_switch_interval: from a save's start until :meth:`wait` or :meth:`close`, the
            interpreter's GIL switch interval (``sys.setswitchinterval``, Python's default is
            5 ms) is lowered to this many seconds, so a low-priority writer thread that holds
            the GIL hands it back to the train loop quickly instead of stalling it. None leaves
            the interval alone.

    Example:
        >>> import tempfile
        >>> checkpointer = Checkpointer(tempfile.mkdtemp(), interval="2ba", keep=3)
        >>> checkpointer.latest() is None
        True
        >>> checkpointer.close()
    """

    def __init__(
        self,
        folder: str,
        interval: Time | str = "1ep",
        keep: int | None = None,
        weights_only: bool = False,
        async_save: bool = True,
        writer_niceness: int | None = 19,
        writer_idle: bool = True,
        writer_switch_interval: float | None = 0.0005,
    ) -> None:
        if not isinstance(interval, Time):
            try:
                interval = Time.from_input(interval, TimeUnit.EPOCH)
            except ValueError as error:
                raise ValueError(f"save_interval={interval!r}: {error}") from error
        if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
            raise ValueError(f"save_interval={interval}: expected a positive number of epochs or batches, e.g. "
                             "'1ep' or '500ba'")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"save_num_checkpoints_to_keep={keep!r}: expected a positive integer, or -1 for all")
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"save_folder={folder!r} is a file; expected a folder (it is created if missing)")
        self.folder = os.path.abspath(folder)
        self.interval = interval
        self.weights_only = bool(weights_only)
        self.last_saved: int | None = None
        self.writer_niceness = writer_niceness
        self.writer_idle = bool(writer_idle)
        if writer_switch_interval is not None and not writer_switch_interval > 0:
            raise ValueError(f"writer_switch_interval={writer_switch_interval!r}: expected a positive number of "
                             "seconds, or None")
        self.writer_switch_interval = writer_switch_interval
        self.writer_threads: set[int] = set()
        self.manager = ocp.CheckpointManager(
            self.folder,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save),
            # Handlers named up front: a manager that has not saved yet can still read metadata.
            item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
        )

    # -- saving ----------------------------------------------------------------------------------
    def due(self, state: State, event_unit: TimeUnit) -> bool:
        """Whether a checkpoint is due now, at the checkpoint event of ``event_unit`` ('ep' or 'ba')."""
        if self.interval.unit != event_unit:
            return False
        counter = state.timestamp.epoch if event_unit == TimeUnit.EPOCH else state.timestamp.batch
        return counter > 0 and counter % int(self.interval.value) == 0

    def save(self, state: State, hparams: dict[str, Any] | None = None) -> int:
        """Start an async save of ``state`` at its batch index and return that index.

        A second save at the same batch index is skipped (the first one already holds it).
        """
        step = state.timestamp.batch
        if step == self.last_saved or step in self.manager.all_steps():
            return step
        if state.train_state is None:
            raise RuntimeError("Checkpointer.save(): the device state is not built yet")
        train_state = state.train_state
        if self.weights_only:
            arrays = {key: train_state[key] for key in _MODEL_KEYS}
            host = {"weights_only": True, "timestamp": state.timestamp.state_dict(), "run_name": state.run_name}
        else:
            arrays = train_state
            host = {key: value for key, value in state.state_dict().items() if key != "train_state"}
            host["weights_only"] = False
        # Two items, not one per part: every orbax item costs its own files and background work.
        items = {"state": ocp.args.PyTreeSave(arrays),
                 "meta": ocp.args.JsonSave(_to_json({"host": host, "hparams": hparams or {}}))}
        if self.writer_switch_interval is not None:
            _SWITCH_INTERVAL.lower(self, self.writer_switch_interval)
        threads = _threads()
        self.manager.save(step, args=ocp.args.Composite(**items))
        self._lower_priority(_threads() - threads)
        self.last_saved = step
        return step

    def _lower_priority(self, threads: set[int]) -> None:
        """Give the threads orbax started for writing the lowest CPU priority (Linux only).

        On a CPU backend the writer and XLA's compute threads share the cores; at the lowest
        priority (``nice 19`` and ``SCHED_IDLE``) the writer runs in the gaps instead of stretching
        the train steps.
        """
        idle = getattr(os, "SCHED_IDLE", None) if self.writer_idle else None
        if self.writer_niceness is None and idle is None:
            return
        for tid in threads:
            try:
                if self.writer_niceness is not None:
                    os.setpriority(os.PRIO_PROCESS, tid, self.writer_niceness)
                if idle is not None:
                    os.sched_setscheduler(tid, idle, os.sched_param(0))
                self.writer_threads.add(tid)
            except (OSError, AttributeError):  # the thread has ended, or no such call here
                pass

    # -- reading ---------------------------------------------------------------------------------
    def latest(self) -> int | None:
        """The newest complete checkpoint's batch index, or None."""
        self.manager.reload()
        return self.manager.latest_step()

    def read_meta(self, step: int | None = None) -> dict[str, Any]:
        """The JSON item of checkpoint ``step`` (newest by default): ``{'host': ..., 'hparams': ...}``."""
        step = self._step(step)
        return dict(self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"])

    def read_host(self, step: int | None = None) -> dict[str, Any]:
        """The host state saved with checkpoint ``step``: rng, timestamp, data position, plugin states."""
        return dict(self.read_meta(step)["host"])

    def read_hparams(self, step: int | None = None) -> dict[str, Any]:
        """The hyperparameters saved with checkpoint ``step`` (newest by default).

        Example::

            Checkpointer("runs/x/checkpoints").read_hparams()["max_duration"]  # '10ep'
        """
        return dict(self.read_meta(step)["hparams"])

    def restore(self, state: State, step: int | None = None, weights_only: bool = False,
                field: str = "load_path") -> int:
        """Load checkpoint ``step`` (the newest by default) into ``state``, on its current shardings.

        Args:
            state: the run to load into; its device state gives the expected names, shapes and
                the target shardings (a checkpoint saved on 4 devices loads on 1, and back).
            step: which checkpoint; the newest by default.
            weights_only: load only the model's variables; time, optimizer and algorithm state stay.
            field: the Trainer argument the folder came from, for error messages.

        Raises:
            FileNotFoundError: no checkpoint in the folder.
            CheckpointMismatchError: the checkpoint does not fit (every difference is listed);
                nothing in ``state`` has changed.
        """
        step = self._step(step, field)
        host = self.read_host(step)
        saved_weights_only = bool(host.get("weights_only", False))
        if saved_weights_only and not weights_only:
            raise CheckpointMismatchError(
                f"{field}={self.folder!r}: checkpoint {step} holds weights only (saved with save_weights_only=True); "
                "pass load_weights_only=True to load its weights, or point at a full checkpoint to resume")
        current = state.train_state
        target = {key: current[key] for key in _MODEL_KEYS} if weights_only else current
        metadata = self.manager.item_metadata(step).get("state")
        if metadata is None:
            raise CheckpointMismatchError(
                f"{field}={self.folder!r}: checkpoint {step} has no 'state' item; expected a checkpoint written "
                "by composerjax's Trainer(save_folder=...)")
        problems = _compare(metadata, target)
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            shown = "\n  ".join(problems[:20]) + more
            raise CheckpointMismatchError(
                f"{field}={self.folder!r}: checkpoint {step} does not fit this run's model, optimizer or algorithms "
                f"(saved vs expected):\n  {shown}")
        abstract = jax.tree.map(_abstract, target)
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
            partial_restore=weights_only)))["state"]
        if weights_only:
            state.train_state = {**current, **_place(restored, target)}
            state._model_stale = True
            return step
        host = {key: value for key, value in host.items() if key != "weights_only"}
        host["rng"] = np.asarray(host["rng"], np.uint32)
        state.load_state_dict({**host, "train_state": restored})
        return step

    def _step(self, step: int | None, field: str = "load_path") -> int:
        if step is None:
            step = self.latest()
            if step is None:
                raise FileNotFoundError(f"{field}={self.folder!r}: no complete checkpoint in this folder")
        elif step not in self.manager.all_steps():
            raise FileNotFoundError(f"{field}={self.folder!r}: no checkpoint {step}; there are "
                                    f"{sorted(self.manager.all_steps())}")
        return step

    # -- lifetime --------------------------------------------------------------------------------
    def wait(self) -> None:
        """Block until every started save is on disk (and put the GIL switch interval back)."""
        self.manager.wait_until_finished()
        _SWITCH_INTERVAL.release(self)

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self.wait()
        self.manager.close()

class _SwitchInterval:
    """The GIL switch interval, lowered while any checkpointer's save may be in flight.

    Several checkpointers (two trainers in one process) share the one interpreter setting: the
    first to save records the interval it found, the last one done puts it back. Lowering again
    while holding it, or releasing without holding it, changes nothing.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[int, float] = {}
        self._original: float | None = None

    def lower(self, holder: object, seconds: float) -> None:
        with self._lock:
            if not self._holders:
                self._original = sys.getswitchinterval()
            self._holders[id(holder)] = seconds
            sys.setswitchinterval(min(self._holders.values()))

    def release(self, holder: object) -> None:
        with self._lock:
            if self._holders.pop(id(holder), None) is None:
                return
            if self._holders:
                sys.setswitchinterval(min(self._holders.values()))
            elif self._original is not None:
                sys.setswitchinterval(self._original)
                self._original = None


_SWITCH_INTERVAL = _SwitchInterval()


def _threads() -> set[int]:
    """This process's thread ids (empty where /proc is missing)."""
    try:
        return set(map(int, os.listdir("/proc/self/task")))
    except OSError:
        return set()


def _abstract(value: Any) -> Any:
    return ocp.utils.to_shape_dtype_struct(value) if isinstance(value, jax.Array) else value


def _place(values: Any, like: Any) -> Any:
    return jax.tree.map(lambda v, r: jax.device_put(v, r.sharding) if isinstance(r, jax.Array) else v, values, like)


def _arrays_by_name(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{'params.layers.0.kernel': (shape, dtype)}`` for every array leaf, names as orbax writes them."""
    is_meta = lambda x: hasattr(x, "shape") and hasattr(x, "dtype")  # noqa: E731
    named = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_meta)[0]:
        if is_meta(leaf):
            named[path_of(path, ".")] = (tuple(leaf.shape), str(np.dtype(leaf.dtype)))
    return named


def _compare(metadata: Any, target: Any) -> list[str]:
    """Every difference between the saved arrays and the run's (``target``'s groups only): missing, extra, shapes."""
    expected = _arrays_by_name(target)
    groups = set(target)
    saved = {name: value for name, value in _arrays_by_name(getattr(metadata, "tree", metadata)).items()
             if name.split(".")[0] in groups}
    problems = []
    for group in dict.fromkeys(name.split(".")[0] for name in (*saved, *expected)):
        label = _GROUP_NAMES.get(group, group)
        saved_g = {n: v for n, v in saved.items() if n.split(".")[0] == group}
        expected_g = {n: v for n, v in expected.items() if n.split(".")[0] == group}
        missing = [n for n in expected_g if n not in saved_g]
        extra = [n for n in saved_g if n not in expected_g]
        if missing or extra:
            problems.append(
                f"{label}: the checkpoint has {len(saved_g)} arrays, this run has {len(expected_g)}"
                + (f"; missing from the checkpoint: {', '.join(missing[:5])}" if missing else "")
                + (f"; not in this run: {', '.join(extra[:5])}" if extra else ""))
        for name in expected_g:
            if name in saved_g and saved_g[name][0] != expected_g[name][0]:
                problems.append(f"{label}: {name} saved with shape {saved_g[name][0]}, this run expects "
                                f"{expected_g[name][0]}")
    return problems


def _to_json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    if isinstance(value, (Time, TimeUnit)):
        return str(value)
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    raise TypeError(f"checkpoint: a {type(value).__name__} in a state_dict is not JSON-serialisable")
