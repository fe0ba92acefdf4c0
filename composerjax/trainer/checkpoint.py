"""Checkpoints on orbax's CheckpointManager: async saves at an interval, validated restore, autoresume.

The checks (errors, checksums, saved-vs-expected comparison) live in
:mod:`composerjax.trainer.checkpoint_checks`, the writer's plumbing (the save folder's owner lock,
writer-thread priority) in :mod:`composerjax.trainer.checkpoint_writer`; the errors,
:func:`~composerjax.trainer.checkpoint_checks.checksums` and ``OWNER_FILE`` are importable from here too.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.parallel import dist
from composerjax.trainer.checkpoint_checks import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    SaveFolderInUseError,
    checksums,
    compare_arrays,
    first_line,
    structure_problem,
)
from composerjax.trainer.checkpoint_writer import (
    OWNER_FILE,
    SWITCH_INTERVAL,
    OwnerLock,
    call_with_timeout,
    thread_ids,
)

__all__ = ["Checkpointer", "CheckpointMismatchError", "CheckpointSaveError", "CheckpointCorruptError",
           "SaveFolderInUseError", "OWNER_FILE", "checksums"]

# The train state's parts that make up the model's weights (all a weights-only checkpoint holds).
_MODEL_KEYS = ("params", "rest")


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
        self._owner: OwnerLock | None = None
        self._closed = False
        if owner is not None and dist.is_process_zero():
            self._owner = OwnerLock.acquire(self.folder, owner)
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
            arrays = {key: getattr(train_state, key) for key in _MODEL_KEYS}
            host = {"weights_only": True, "timestamp": state.timestamp.state_dict(), "run_name": state.run_name}
        else:
            arrays = train_state._asdict()
            host = {key: value for key, value in state.state_dict().items() if key != "train_state"}
            host["weights_only"] = False
        # Read back on restore: a byte changed on disk is caught before it reaches the model.
        host["checksums"] = checksums(arrays)
        # Two items, not one per part: every orbax item costs its own files and background work.
        items = {"state": ocp.args.PyTreeSave(arrays),
                 "meta": ocp.args.JsonSave(_to_json({"host": host, "hparams": hparams or {}}))}
        if self.writer_switch_interval is not None:
            SWITCH_INTERVAL.lower(self, self.writer_switch_interval)
        threads = thread_ids()
        try:
            started = self.manager.save(step, args=ocp.args.Composite(**items))
        except Exception as error:
            raise CheckpointSaveError(f"checkpoint {step} not saved in {self.folder!r}: {first_line(error)}") \
                from None
        finally:
            self._lower_priority(thread_ids() - threads)
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
            call_with_timeout(self.manager.wait_until_finished, timeout_s,
                               f"checkpoint {step} was still being written after {timeout_s} s")
        except CheckpointSaveError:
            raise
        except Exception as caught:  # the writer thread's error, re-raised by orbax
            error = caught
        finally:
            SWITCH_INTERVAL.release(self)
        if step is None:
            return
        self.in_flight = None
        # orbax logs (and swallows) some writer errors: the folder is the only proof of a save (orbax
        # renames it into place once every item is written).
        if error is None and os.path.isdir(os.path.join(self.folder, str(step))):
            self.last_saved = step
            return
        reason = first_line(error) if error is not None else "it is not in the folder after the write finished"
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
                                         f"{first_line(error)}") from error
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
        target = {key: getattr(current, key) for key in _MODEL_KEYS} if weights_only else current._asdict()
        try:
            metadata = self.manager.item_metadata(step).get("state")
        except Exception as error:
            raise CheckpointCorruptError(f"{field}={self.folder!r}: checkpoint {step}'s arrays cannot be listed: "
                                         f"{first_line(error)}") from error
        if metadata is None:
            present = sorted(name for name in os.listdir(os.path.join(self.folder, str(step)))
                             if not name.startswith("_"))
            raise CheckpointCorruptError(
                f"{field}={self.folder!r}: checkpoint {step} is incomplete: its 'state' item (the arrays) is missing; "
                f"the folder holds {present}")
        problems = compare_arrays(metadata, target)
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
            structure = structure_problem(metadata, target)
            if structure:
                raise CheckpointMismatchError(
                    f"{field}={self.folder!r}: checkpoint {step} does not fit this run: {structure}") from error
            raise CheckpointCorruptError(f"{field}={self.folder!r}: checkpoint {step}'s arrays cannot be read: "
                                         f"{first_line(error)}") from error
        saved_sums = host.get("checksums")
        if saved_sums is not None:
            read_sums = checksums(restored)
            bad = [name for name, value in read_sums.items() if name in saved_sums and saved_sums[name] != value]
            if bad:
                raise CheckpointCorruptError(
                    f"{field}={self.folder!r}: checkpoint {step} is corrupt: {len(bad)} array(s) read back differ "
                    f"from what was written (checksum): {', '.join(bad[:5])}")
        if weights_only:
            state.train_state = current._replace(**_place(restored, target))
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
                call_with_timeout(self.manager.close, timeout_s, "the checkpoint manager did not close")
            except Exception:  # noqa: S110 - the save's own error (above) is the one to report
                pass
            if self._owner is not None:
                self._owner.release()
                self._owner = None


def _abstract(value: Any) -> Any:
    return ocp.utils.to_shape_dtype_struct(value) if isinstance(value, jax.Array) else value


def _place(values: Any, like: Any) -> Any:
    return jax.tree.map(lambda v, r: jax.device_put(v, r.sharding) if isinstance(r, jax.Array) else v, values, like)


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
