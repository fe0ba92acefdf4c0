"""Checkpoints on orbax's CheckpointManager: async saves at an interval, validated restore, autoresume."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.parallel.sharding import path_of

__all__ = ["Checkpointer", "CheckpointMismatchError", "CheckpointSaveError", "CheckpointCorruptError",
           "SaveFolderInUseError"]

# The file in a save folder that the writing run holds an exclusive lock on (flock: the kernel
# releases it when the process dies, SIGKILL included), with the owner's pid, host and run name.
OWNER_FILE = ".composerjax-owner"

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


class CheckpointSaveError(RuntimeError):
    """A checkpoint was refused or failed to reach the disk: the save did not happen."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint on disk cannot be read back as it was written (missing item, unreadable file, bad checksum)."""


class SaveFolderInUseError(RuntimeError):
    """Another live run holds the save folder."""


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
        owner: str | None = None,
        overwrite: bool = False,
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
        self.overwrite = bool(overwrite)
        # The newest checkpoint this run has verified on disk, and the one whose write is in flight.
        self.last_saved: int | None = None
        self.in_flight: int | None = None
        # Checkpoints restore_newest_valid() skipped as corrupt: this run replaces them when it gets there.
        self.corrupt: set[int] = set()
        self.writer_niceness = writer_niceness
        self.writer_idle = bool(writer_idle)
        if writer_switch_interval is not None and not writer_switch_interval > 0:
            raise ValueError(f"writer_switch_interval={writer_switch_interval!r}: expected a positive number of "
                             "seconds, or None")
        self.writer_switch_interval = writer_switch_interval
        self.writer_threads: set[int] = set()
        self._owner: _OwnerLock | None = None
        self._closed = False
        if owner is not None and jax.process_index() == 0:
            self._owner = _OwnerLock.acquire(self.folder, owner)
        try:
            self.manager = ocp.CheckpointManager(
                self.folder,
                options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save),
                # Handlers named up front: a manager that has not saved yet can still read metadata.
                item_handlers={"state": ocp.PyTreeCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()},
            )
        except BaseException:
            if self._owner is not None:
                self._owner.release()
            raise

    # -- saving ----------------------------------------------------------------------------------
    def due(self, state: State, event_unit: TimeUnit) -> bool:
        """Whether a checkpoint is due now, at the checkpoint event of ``event_unit`` ('ep' or 'ba')."""
        if self.interval.unit != event_unit:
            return False
        counter = state.timestamp.epoch if event_unit == TimeUnit.EPOCH else state.timestamp.batch
        return counter > 0 and counter % int(self.interval.value) == 0

    def steps(self) -> list[int]:
        """The batch indices of the complete checkpoints in the folder, oldest first."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, state: State, hparams: dict[str, Any] | None = None) -> int:
        """Start an async save of ``state`` at its batch index and return that index.

        A second save of the same batch index by this checkpointer is skipped (the first one holds
        it). The previous save must have reached the disk: if it failed, this raises.

        Raises:
            CheckpointSaveError: the previous save failed, or the folder already holds a checkpoint at
                or after this batch that this run did not write (another run's; pass
                ``overwrite=True`` to replace those), or orbax refused the save.
        """
        step = state.timestamp.batch
        if step in (self.last_saved, self.in_flight):
            return step
        if state.train_state is None:
            raise RuntimeError("Checkpointer.save(): the device state is not built yet")
        self._finish_in_flight()
        # The manager's own list (no folder scan per save: the owner lock keeps other writers out).
        for old in sorted(s for s in self.manager.all_steps() if s >= step and s in self.corrupt):
            self.manager.delete(old)
            self.corrupt.discard(old)
        existing = sorted(s for s in self.manager.all_steps() if s >= step)
        if existing:
            if not self.overwrite:
                raise CheckpointSaveError(
                    f"checkpoint {step} not saved: save_folder={self.folder!r} already holds checkpoint(s) "
                    f"{existing} at or after batch {step}, written by another run; pass save_overwrite=True to "
                    "replace them, autoresume=True to continue that run, or use a new save_folder")
            for old in existing:
                self.manager.delete(old)
        train_state = state.train_state
        if self.weights_only:
            arrays = {key: train_state[key] for key in _MODEL_KEYS}
            host = {"weights_only": True, "timestamp": state.timestamp.state_dict(), "run_name": state.run_name}
        else:
            arrays = train_state
            host = {key: value for key, value in state.state_dict().items() if key != "train_state"}
            host["weights_only"] = False
        # Read back on restore: a byte changed on disk is caught before it reaches the model.
        host["checksums"] = checksums(arrays)
        # Two items, not one per part: every orbax item costs its own files and background work.
        items = {"state": ocp.args.PyTreeSave(arrays),
                 "meta": ocp.args.JsonSave(_to_json({"host": host, "hparams": hparams or {}}))}
        if self.writer_switch_interval is not None:
            _SWITCH_INTERVAL.lower(self, self.writer_switch_interval)
        threads = _threads()
        try:
            started = self.manager.save(step, args=ocp.args.Composite(**items))
        except Exception as error:
            raise CheckpointSaveError(f"checkpoint {step} not saved in {self.folder!r}: {_first_line(error)}") \
                from None
        finally:
            self._lower_priority(_threads() - threads)
        if not started:
            raise CheckpointSaveError(
                f"checkpoint {step} not saved: orbax refused it (the folder {self.folder!r} has checkpoint "
                f"{self.manager.latest_step()}; a save must be newer than every checkpoint there)")
        self.in_flight = step
        return step

    def _finish_in_flight(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight and check that it reached the disk; raise if it did not."""
        step = self.in_flight
        error: BaseException | None = None
        try:
            _call_with_timeout(self.manager.wait_until_finished, timeout_s,
                               f"checkpoint {step} was still being written after {timeout_s} s")
        except CheckpointSaveError:
            raise
        except Exception as caught:  # the writer thread's error, re-raised by orbax
            error = caught
        finally:
            _SWITCH_INTERVAL.release(self)
        if step is None:
            return
        self.in_flight = None
        # orbax logs (and swallows) some writer errors: the folder is the only proof of a save (orbax
        # renames it into place once every item is written).
        if error is None and os.path.isdir(os.path.join(self.folder, str(step))):
            self.last_saved = step
            return
        reason = _first_line(error) if error is not None else "it is not in the folder after the write finished"
        raise CheckpointSaveError(f"checkpoint {step} was not saved in {self.folder!r}: {reason}") from None

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
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as error:
            raise CheckpointCorruptError(f"checkpoint {step} in {self.folder!r}: its 'meta' item cannot be read: "
                                         f"{_first_line(error)}") from error
        if not isinstance(meta, dict) or not isinstance(meta.get("host"), dict):
            raise CheckpointCorruptError(f"checkpoint {step} in {self.folder!r}: its 'meta' item has no 'host' "
                                         "section; expected one written by composerjax's Trainer")
        return dict(meta)

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

        The arrays read back are checked against the checksums saved with them before anything
        in ``state`` changes.

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
            CheckpointCorruptError: the checkpoint cannot be read back as written (an item is
                missing, a file is unreadable, or a checksum differs); nothing in ``state`` has changed.
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
        try:
            metadata = self.manager.item_metadata(step).get("state")
        except Exception as error:
            raise CheckpointCorruptError(f"{field}={self.folder!r}: checkpoint {step}'s arrays cannot be listed: "
                                         f"{_first_line(error)}") from error
        if metadata is None:
            present = sorted(name for name in os.listdir(os.path.join(self.folder, str(step)))
                             if not name.startswith("_"))
            raise CheckpointCorruptError(
                f"{field}={self.folder!r}: checkpoint {step} is incomplete: its 'state' item (the arrays) is missing; "
                f"the folder holds {present}")
        problems = _compare(metadata, target)
        if problems:
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            shown = "\n  ".join(problems[:20]) + more
            raise CheckpointMismatchError(
                f"{field}={self.folder!r}: checkpoint {step} does not fit this run's model, optimizer or algorithms "
                f"(saved vs expected):\n  {shown}")
        abstract = jax.tree.map(_abstract, target)
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
                item=abstract, restore_args=ocp.checkpoint_utils.construct_restore_args(abstract),
                partial_restore=weights_only)))["state"]
        except Exception as error:
            structure = _structure_problem(metadata, target)
            if structure:
                raise CheckpointMismatchError(
                    f"{field}={self.folder!r}: checkpoint {step} does not fit this run: {structure}") from error
            raise CheckpointCorruptError(f"{field}={self.folder!r}: checkpoint {step}'s arrays cannot be read: "
                                         f"{_first_line(error)}") from error
        saved_sums = host.get("checksums")
        if saved_sums is not None:
            read_sums = checksums(restored)
            bad = [name for name, value in read_sums.items() if name in saved_sums and saved_sums[name] != value]
            if bad:
                raise CheckpointCorruptError(
                    f"{field}={self.folder!r}: checkpoint {step} is corrupt: {len(bad)} array(s) read back differ "
                    f"from what was written (checksum): {', '.join(bad[:5])}")
        if weights_only:
            state.train_state = {**current, **_place(restored, target)}
            state._model_stale = True
            return step
        host = {key: value for key, value in host.items() if key not in ("weights_only", "checksums")}
        host["rng"] = np.asarray(host["rng"], np.uint32)
        state.load_state_dict({**host, "train_state": restored})
        # The run now holds exactly what checkpoint `step` holds: a save at that batch (a finished run
        # restarted, whose fit() saves at its end again) is already done, not another run's checkpoint.
        self.last_saved = step
        return step

    def restore_newest_valid(self, state: State, field: str = "save_folder", weights_only: bool = False,
                             report: Any = None) -> int:
        """Load the newest checkpoint that reads back intact, walking back past corrupt ones.

        Each checkpoint skipped is reported (``report(message)``, ``print`` by default) with why,
        and recorded in ``corrupt``: when this checkpointer's run reaches one of those batches again,
        its save replaces the corrupt checkpoint instead of being refused.
        A checkpoint that does not fit the run (:class:`CheckpointMismatchError`) stops the walk:
        the run, not the checkpoint, is wrong.

        Raises:
            FileNotFoundError: no checkpoint in the folder.
            CheckpointCorruptError: every checkpoint in the folder is corrupt (each reason listed).

        Example::

            Checkpointer("runs/x/checkpoints").restore_newest_valid(trainer.state)  # 1200
        """
        report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        steps = self.steps()
        if not steps:
            raise FileNotFoundError(f"{field}={self.folder!r}: no complete checkpoint in this folder")
        reasons = []
        for step in reversed(steps):
            try:
                return self.restore(state, step, weights_only=weights_only, field=field)
            except CheckpointCorruptError as error:
                self.corrupt.add(step)
                reasons.append(f"checkpoint {step}: {error}")
                report(f"composerjax: skipped checkpoint {step} in {self.folder}: {error}")
        raise CheckpointCorruptError(f"{field}={self.folder!r}: no checkpoint loads:\n  " + "\n  ".join(reasons))

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
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every started save is on disk (and put the GIL switch interval back).

        Raises:
            CheckpointSaveError: the save in flight failed, or is still running after ``timeout_s``.
        """
        self._finish_in_flight(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish pending saves, release the manager and the folder.

        Raises:
            CheckpointSaveError: the save in flight failed (the manager is released all the same).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout_s)
        finally:
            try:
                _call_with_timeout(self.manager.close, timeout_s, "the checkpoint manager did not close")
            except Exception:  # noqa: S110 - the save's own error (above) is the one to report
                pass
            if self._owner is not None:
                self._owner.release()
                self._owner = None


class _OrbaxTracebacks(logging.Filter):
    """Keep orbax's error log lines but drop their tracebacks (the cause is in our own error's message).

    A failed write makes orbax log the same chained traceback from several threads: hundreds of
    lines that bury the one error a user needs, which :class:`CheckpointSaveError` states.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and "orbax" in record.pathname:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()} ({_first_line(error) if error else 'error'})"
            record.args, record.exc_info, record.exc_text = None, None, None
        return True


def _quiet_orbax_thread_errors(previous: Any) -> Any:
    """A ``threading.excepthook`` printing one line for an orbax writer thread's error, the rest as before."""

    def hook(args: Any) -> None:
        frames = []
        tb = args.exc_traceback
        while tb is not None:
            frames.append(tb.tb_frame.f_code.co_filename)
            tb = tb.tb_next
        if any("orbax" in name for name in frames):
            print(f"composerjax: checkpoint writer thread {args.thread.name if args.thread else '?'} failed: "
                  f"{_first_line(args.exc_value)}", file=sys.stderr, flush=True)
            return
        previous(args)

    hook.composerjax = True  # type: ignore[attr-defined]
    return hook


logging.getLogger("absl").addFilter(_OrbaxTracebacks())
if not getattr(threading.excepthook, "composerjax", False):
    threading.excepthook = _quiet_orbax_thread_errors(threading.excepthook)


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


def _first_line(error: BaseException) -> str:
    """``'ValueError: the message'`` on one line (tensorstore and orbax errors run to many)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:500]


def _call_with_timeout(function: Any, timeout_s: float | None, message: str) -> None:
    """``function()``, giving up after ``timeout_s`` seconds (None waits for ever) with CheckpointSaveError."""
    if timeout_s is None:
        function()
        return
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            function()
            outcome.append(None)
        except BaseException as error:  # handed back to the caller
            outcome.append(error)

    worker = threading.Thread(target=run, name="composerjax-checkpoint-wait", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not outcome:
        raise CheckpointSaveError(message)
    if outcome[0] is not None:
        raise outcome[0]


# -- checksums -------------------------------------------------------------------------------------
def _as_words(leaf: jax.Array) -> jax.Array:
    """The bits of ``leaf`` as a flat uint32 vector (any dtype: 8, 16, 32 or 64 bits, keys, bools)."""
    if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        leaf = jax.random.key_data(leaf)
    if jax.numpy.iscomplexobj(leaf):
        leaf = jax.numpy.stack([leaf.real, leaf.imag])
    if leaf.dtype == bool:
        return leaf.astype(np.uint32).ravel()
    size = np.dtype(leaf.dtype).itemsize
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}[size]
    return jax.lax.bitcast_convert_type(leaf, unsigned).astype(np.uint32).ravel()


def _leaf_checksum(leaf: jax.Array) -> jax.Array:
    # Odd position weights: a change to any bit of any word moves the sum (mod 2**32), and a swap of
    # two words does too. Integer sums are exact in any order, so every sharding gives the same value.
    words = _as_words(leaf)
    weights = jax.numpy.arange(words.size, dtype=np.uint32) * np.uint32(2) + np.uint32(1)
    return jax.numpy.sum(words * weights, dtype=np.uint32)


_checksum_tree = jax.jit(lambda tree: jax.tree.map(_leaf_checksum, tree))


def checksums(tree: Any) -> dict[str, int]:
    """``{'params.layers.0.kernel': 123456789, ...}``: a position-weighted uint32 sum of each array's bits.

    Computed on the devices (one compiled call), so a sharded array is summed where it lives; the
    result is the same whatever the sharding or the number of processes.

    Example:
        >>> checksums({"w": jax.numpy.zeros(3)})
        {'w': 0}
    """
    is_array = lambda x: isinstance(x, jax.Array)  # noqa: E731
    arrays = jax.tree.map(lambda x: x if is_array(x) else None, tree, is_leaf=is_array)
    sums = _checksum_tree(arrays)
    named = {}
    for path, value in jax.tree_util.tree_flatten_with_path(sums)[0]:
        named[path_of(path, ".")] = int(np.asarray(value.addressable_data(0)))
    return named


def _structure_problem(metadata: Any, target: Any) -> str:
    """How the saved tree's structure differs from the run's (e.g. adam's state against adamw's), or ''."""
    saved = getattr(metadata, "tree", metadata)
    problems = []
    for group in target:
        if not isinstance(saved, dict) or group not in saved:
            continue
        try:
            saved_def = jax.tree.structure(saved[group], is_leaf=lambda x: hasattr(x, "shape"))
            want_def = jax.tree.structure(target[group])
        except Exception:  # noqa: S112 - metadata of an unknown shape: no structural verdict
            continue
        if saved_def.num_leaves != want_def.num_leaves or _node_kinds(saved[group]) != _node_kinds(target[group]):
            problems.append(f"{_GROUP_NAMES.get(group, group)} is laid out differently (saved "
                            f"{_outline(saved[group])}, this run {_outline(target[group])}); a different optimizer "
                            "or optimizer chain?")
    return "; ".join(problems)


def _node_kinds(tree: Any) -> int:
    return len(jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or hasattr(x, "shape"))[0])


def _outline(tree: Any, depth: int = 2) -> str:
    """A short picture of a tree's top levels: ``(ScaleByAdamState, EmptyState)``."""
    if depth == 0:
        return "..."
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return "(" + ", ".join(_outline(item, depth - 1) for item in tree) + ")"
    if isinstance(tree, dict):
        return "{" + ", ".join(f"{k}: {_outline(v, depth - 1)}" for k, v in list(tree.items())[:6]) + "}"
    return type(tree).__name__


# -- the save folder's owner ---------------------------------------------------------------------------
class _OwnerLock:
    """An exclusive ``flock`` on ``folder/.composerjax-owner``, held while a run writes checkpoints there.

    The kernel drops the lock when the owning process dies (SIGKILL included), so a crashed run
    never blocks the next. Within one process the lock is shared: a second Trainer on the same
    folder (a resume in a notebook) takes it over.
    """

    _held: dict[str, list[Any]] = {}  # folder -> [fd, holders]
    _guard = threading.Lock()

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @classmethod
    def acquire(cls, folder: str, run_name: str) -> _OwnerLock:
        with cls._guard:
            if folder in cls._held:
                cls._held[folder][1] += 1
                return cls(folder)
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, OWNER_FILE)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                try:
                    owner = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
                finally:
                    os.close(fd)
                raise SaveFolderInUseError(
                    f"save_folder={folder!r} is in use by another live run ({owner or 'owner unknown'}); two runs "
                    "writing one folder would replace each other's checkpoints: give this run its own save_folder, "
                    "or stop the other run first") from error
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "run_name": run_name,
                                 "since": time.strftime("%Y-%m-%d %H:%M:%S")})
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record.encode(), 0)
            except OSError as error:
                os.close(fd)
                raise CheckpointSaveError(f"save_folder={folder!r} cannot be written: {error}") from error
            cls._held[folder] = [fd, 1]
            return cls(folder)

    def release(self) -> None:
        with self._guard:
            entry = self._held.get(self.folder)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._held[self.folder]
                os.close(entry[0])  # closing the last descriptor drops the flock
