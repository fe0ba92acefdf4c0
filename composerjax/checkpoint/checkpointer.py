"""Checkpoints with orbax: async saves into named folders, validated restores with Composer's load options.

The checks (errors, checksums, saved-vs-expected comparison) live in
:mod:`composerjax.checkpoint.checks`, Composer's load options (:class:`LoadOptions`) and the
load itself in :mod:`composerjax.checkpoint.load`, the folder's layout (name templates,
the listing by recorded clock, the ``latest`` link) and the writer's plumbing (owner lock,
writer-thread priority) in :mod:`composerjax.checkpoint.writer`; the errors,
:func:`checksums` and ``OWNER_FILE`` are importable from here too.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from composerjax.checkpoint.checks import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    SaveFolderInUseError,
    checksums,
    first_line,
)
from composerjax.checkpoint.cleanup import FailedSaves
from composerjax.checkpoint.load import MODEL_KEYS, ArrayPlan, LoadOptions, load_into
from composerjax.checkpoint.storage import storage_for
from composerjax.checkpoint.writer import (
    OWNER_FILE,
    SWITCH_INTERVAL,
    CheckpointInfo,
    OwnerLock,
    call_with_timeout,
    check_template,
    format_name,
    thread_ids,
)
from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.parallel import dist

__all__ = ["Checkpointer", "CheckpointInfo", "CheckpointMismatchError", "CheckpointSaveError", "CheckpointCorruptError",
           "LoadOptions", "SaveFolderInUseError", "OWNER_FILE", "checksums"]



class _Pending(NamedTuple):
    """The save in flight: what it writes and, once verified, where ``latest`` points."""

    name: str
    batch: int
    weights_only: bool
    rotate: bool
    latest: str | None


class Checkpointer:
    """Save ``State.state_dict()`` into named folders of ``folder`` and restore it.

    Each checkpoint is one orbax ``Composite`` in ``folder/<name>/``, the name from the
    ``filename`` template (``'ep{epoch}-ba{batch}'`` gives ``ep1-ba8``), with two items:

    * ``state``: the device arrays, saved async: ``params`` and ``rest`` (the model's other
      variables), ``opt_state``, ``algorithm_state`` (EMA/SWA averages...) and the step ``clock``;
    * ``meta`` (JSON): ``host`` (rng, timestamp, data-loader position, algorithm and callback
      ``state_dict``s) and ``hparams`` (the run's hyperparameters, for people and tools).

    orbax's ``_CHECKPOINT_METADATA`` records the clock (``composerjax`` entry), so checkpoints are
    ordered by when in training they were taken, whatever their names. A weights-only
    checkpoint's ``state`` holds ``params`` and ``rest`` only. orbax writes each checkpoint into a
    temporary folder and renames it when every item is on disk, so a half-written checkpoint is
    never listed and the previous one stays loadable whatever happens to the process writing the
    next one; once a save is verified, ``latest_filename`` is pointed at it and, beyond ``keep``,
    the oldest of the saver's checkpoints are deleted.

    ``folder`` may be an ``s3://`` or ``gs://`` URI
    (:mod:`~composerjax.checkpoint.storage`): orbax then writes into a local staging
    folder, and the save counts as done once every file and, last, the marker that makes the
    checkpoint complete are in the bucket; reading downloads a checkpoint first.

    Before anything is read, :meth:`restore` compares the saved arrays (names, shapes) with the
    run's and raises :class:`CheckpointMismatchError` listing every difference.

    Args:
        folder: where checkpoints go (one sub-folder per checkpoint): a local folder or an
            ``s3://bucket/path`` / ``gs://bucket/path`` URI.
        interval: a Time in 'ep' or 'ba' (``'1ep'``, ``'500ba'``).
        keep: how many of the saver's checkpoints to keep (None keeps all).
        weights_only: save only the model's variables (no optimizer, algorithm or host state).
        async_save: write in a background thread while training goes on.
        writer_niceness: the ``nice`` value for the threads orbax starts to write (Linux; 19 is
            the lowest priority): on a CPU backend they would otherwise take cores from the
            train steps. None leaves them alone.
        writer_idle: also put those threads in Linux's ``SCHED_IDLE`` class, so they run only
            on a core that nothing else wants (``benchmarks/checkpoint.py``). Ignored where the OS
            has no ``SCHED_IDLE``.
        writer_switch_interval: from a save's start until :meth:`wait` or :meth:`close`, the
            interpreter's GIL switch interval is lowered to this many seconds, so a low-priority
            writer thread that holds the GIL hands it back to the train loop quickly. None leaves
            the interval alone.
        owner: the run name to hold the folder's owner lock for (a saving run); None takes no lock.
        overwrite: replace a checkpoint of the same name, and checkpoints another run left at or
            after the batch saved; without it such a save raises :class:`CheckpointSaveError`.
        filename: the checkpoint names' template (:func:`~composerjax.checkpoint.writer.format_name`).
        latest_filename: the name of the link to the newest verified checkpoint (a template too);
            None makes none.

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
        filename: str = "ep{epoch}-ba{batch}",
        latest_filename: str | None = "latest",
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
        self.store = storage_for(folder, "save_folder")
        if not self.store.remote and os.path.exists(folder) and not os.path.isdir(folder):
            raise ValueError(f"save_folder={folder!r} is a file; expected a folder (it is created if missing)")
        check_template(filename, "save_filename")
        self._latest_per_process = False
        if latest_filename is not None:
            self._latest_per_process = check_template(latest_filename, "save_latest_filename", one_per_run=False)
            if latest_filename == filename:
                raise ValueError(f"save_latest_filename={latest_filename!r} is also save_filename: the link would "
                                 "take a checkpoint's name")
        if writer_switch_interval is not None and not writer_switch_interval > 0:
            raise ValueError(f"writer_switch_interval={writer_switch_interval!r}: expected a positive number of "
                             "seconds, or None")
        self.folder = self.store.folder
        self.interval = interval
        self.keep = keep
        self.weights_only = bool(weights_only)
        self.overwrite = bool(overwrite)
        self.filename, self.latest_filename = filename, latest_filename
        # The newest checkpoint this run has verified on disk (its batch and folder), and the one in flight.
        self.last_saved: int | None = None
        self.last_saved_path: str | None = None
        self.in_flight: int | None = None
        self._pending: _Pending | None = None
        # name -> (batch, weights_only) of the checkpoints this run wrote or loaded: its own, never "another run's".
        self.written: dict[str, tuple[int, bool]] = {}
        # Checkpoints restore_newest_valid() skipped as corrupt: this run replaces them when it gets there.
        self.corrupt: set[str] = set()
        #: What the last :meth:`restore` loaded (``values``, ``ignored``, ``missing``, ``unexpected``).
        self.last_load: ArrayPlan | None = None
        self._listing: dict[str, Any] = {}
        self.writer_niceness = writer_niceness
        self.writer_idle = bool(writer_idle)
        self.writer_switch_interval = writer_switch_interval
        self.writer_threads: set[int] = set()
        self._owner: OwnerLock | None = None
        self._closed = False
        # The remote save to upload once orbax has written it (name, record), and why the last upload failed.
        self._to_upload: tuple[str, dict[str, Any]] | None = None
        self._upload_error: BaseException | None = None
        self._failed = FailedSaves(self.store.staging)  # their temporary folders are removed
        if owner is not None and dist.is_process_zero():
            self._owner = OwnerLock.acquire(self.store.staging, owner)
        try:
            # No compression: trained float weights hardly compress, and zstd would take CPU from the
            # steps that run while a save is in flight (it cost about 3% of step time on a 2-core CPU).
            handler = ocp.CompositeCheckpointHandler(state=ocp.PyTreeCheckpointHandler(use_compression=False),
                                                     meta=ocp.JsonCheckpointHandler())
            # Remote: process 0 uploads in orbax's writer thread, once every process wrote its part.
            upload = {"async_options": ocp.options.AsyncOptions(post_finalization_callback=self._upload)} \
                if self.store.remote else {}
            self.writer = ocp.AsyncCheckpointer(handler, **upload) if async_save else ocp.Checkpointer(handler)
        except BaseException:
            if self._owner is not None:
                self._owner.release()
            raise

    @property
    def in_flight_name(self) -> str | None:
        """The name of the checkpoint being written, or None."""
        return self._pending.name if self._pending is not None else None

    # -- listing ---------------------------------------------------------------------------------
    def due(self, state: State, event_unit: TimeUnit) -> bool:
        """Whether a checkpoint is due now, at the checkpoint event of ``event_unit`` ('ep' or 'ba')."""
        if self.interval.unit != event_unit:
            return False
        counts = state.timestamp.counts  # plain numbers: this runs every batch
        counter = counts.epoch if event_unit == TimeUnit.EPOCH else counts.batch
        return counter > 0 and counter % int(self.interval.value) == 0

    def checkpoints(self) -> list[CheckpointInfo]:
        """The complete checkpoints in the folder, oldest first by the clock they recorded."""
        return self.store.list(self._listing)

    def steps(self) -> list[int]:
        """The batch indices of the complete checkpoints in the folder, oldest first."""
        return [info.batch for info in self.checkpoints()]

    def latest(self) -> int | None:
        """The newest complete checkpoint's batch index, or None."""
        found = self.checkpoints()
        return found[-1].batch if found else None

    def find(self, which: str | int | None = None, field: str = "load_path", any_kind: bool = True) -> CheckpointInfo:
        """Checkpoint ``which``: a name, the newest at a batch index (int), or the newest (None).

        Without ``any_kind`` the newest full checkpoint is picked: weights-only ones cannot resume a run.

        Raises:
            FileNotFoundError: no such checkpoint (the message lists those there are).
            CheckpointMismatchError: only weights-only checkpoints, and a full one is wanted.
        """
        found = self.checkpoints()
        if not found:
            raise FileNotFoundError(f"{field}={self.folder!r}: no complete checkpoint in this folder")
        if which is None:
            usable = found if any_kind else [info for info in found if not info.weights_only]
            if not usable:
                raise CheckpointMismatchError(
                    f"{field}={self.folder!r}: checkpoint {found[-1].name} holds weights only (saved with "
                    "save_weights_only=True); pass load_weights_only=True to load its weights, or point at a full "
                    "checkpoint to resume")
            return usable[-1]
        matches = [info for info in found if info.name == which or (
            isinstance(which, int) and not isinstance(which, bool) and info.batch == which)]
        if not matches:
            raise FileNotFoundError(f"{field}={self.folder!r}: no checkpoint {which}; there are "
                                    f"{[info.name for info in found]}")
        return matches[-1]

    # -- saving ----------------------------------------------------------------------------------
    def save(self, state: State, hparams: dict[str, Any] | None = None, *, name: str | None = None,
             weights_only: bool | None = None, rotate: bool = True) -> str:
        """Start an async save of ``state`` and return the checkpoint's folder.

        ``name`` is a template (this checkpointer's ``filename`` by default). A second save of the
        same name at the same batch by this run is skipped (the first one holds it). The previous
        save must have reached the disk: if it failed, this raises.

        Args:
            state: the run to save.
            hparams: the run's hyperparameters, saved in ``meta``.
            name: the checkpoint's name template.
            weights_only: save only the model's variables (this checkpointer's setting by default).
            rotate: count it towards ``keep`` (False: kept whatever the rotation).

        Raises:
            CheckpointSaveError: the previous save failed; or the name exists, or the folder holds a
                checkpoint at or after this batch that this run did not write (another run's), and
                ``overwrite`` is off; or orbax refused the save.
        """
        weights_only = self.weights_only if weights_only is None else bool(weights_only)
        name = format_name(self.filename if name is None else name, state.timestamp, state.run_name,
                           "save_filename" if name is None else "name")
        batch = int(state.timestamp.batch)
        path = self.store.path(name)
        pending = self._pending
        if (pending is not None and pending[:3] == (name, batch, weights_only)) or (
                self.written.get(name) == (batch, weights_only) and self.store.landed(name, batch, weights_only)):
            return path
        if state.train_state is None:
            raise RuntimeError("Checkpointer.save(): the device state is not built yet")
        self._finish_in_flight()
        self._make_room(name, batch, weights_only)
        train_state = state.train_state
        if weights_only:
            arrays = {key: getattr(train_state, key) for key in MODEL_KEYS}
            host = {"weights_only": True, "timestamp": state.timestamp.state_dict(), "run_name": state.run_name}
        else:
            arrays = train_state._asdict()
            host = {key: value for key, value in state.state_dict().items() if key != "train_state"}
            host["algorithm_names"] = [algorithm.name for algorithm in state.algorithms]
            host["weights_only"] = False
        # Read back on restore: a byte changed on disk is caught before it reaches the model.
        host["checksums"] = checksums(arrays)
        counts = state.timestamp.state_dict()
        record = {"name": name, "batch": batch, "epoch": int(counts.get("epoch", 0)),
                  "sample": int(counts.get("sample", 0)), "token": int(counts.get("token", 0)),
                  "weights_only": weights_only, "rotate": bool(rotate)}
        # Two items, not one per part: every orbax item costs its own files and background work.
        items = {"state": ocp.args.PyTreeSave(arrays),
                 "meta": ocp.args.JsonSave(_to_json({"host": host, "hparams": hparams or {}}))}
        if self.writer_switch_interval is not None:
            SWITCH_INTERVAL.lower(self, self.writer_switch_interval)
        threads = thread_ids()
        self._to_upload, self._upload_error = (name, record) if self.store.remote else None, None
        try:
            self.writer.save(os.path.join(self.store.staging, name), args=ocp.args.Composite(**items),
                             custom_metadata={"composerjax": record})
            if self.store.remote and not isinstance(self.writer, ocp.AsyncCheckpointer):
                if dist.is_process_zero():
                    self._upload()
                dist.barrier("composerjax-checkpoint-upload")
        except Exception as error:
            self._to_upload = None
            self._failed.discard(self.writer, name)
            raise CheckpointSaveError(f"checkpoint {name} not saved in {self.folder!r}: {first_line(error)}") \
                from None
        finally:
            self._lower_priority(thread_ids() - threads)
        latest = None
        if self.latest_filename is not None:
            latest = format_name(self.latest_filename, state.timestamp, state.run_name, "save_latest_filename")
        self._pending = _Pending(name, batch, weights_only, bool(rotate), latest)
        self.in_flight = batch
        return path

    def _upload(self) -> None:
        """Upload the remote save orbax has just written (process 0; orbax's writer thread when async).

        An error is kept for :meth:`_finish_in_flight`'s message, not raised: the other processes
        wait for this one in orbax's commit barrier, and all of them see the marker missing.
        """
        job, self._to_upload = self._to_upload, None
        if job is None:
            return
        try:
            self.store.upload_staged(*job)
        except Exception as error:  # noqa: BLE001 - reported by _finish_in_flight on the main thread
            self._upload_error = error

    def _make_room(self, name: str, batch: int, weights_only: bool) -> None:
        """Clear the way for checkpoint ``name`` at ``batch``, or raise if that would lose another run's work."""
        primary = dist.is_process_zero()
        if primary:
            self.store.prepare(name)
        found = self.checkpoints()
        stale = [info for info in found if info.name in self.corrupt and (info.batch >= batch or info.name == name)]
        for info in stale:  # corrupt ones this run resumed past: it replaces them
            if primary:
                self.store.remove(info)
            self.corrupt.discard(info.name)
        found = [info for info in found if info not in stale]
        ahead = [info.name for info in found if info.batch >= batch and info.weights_only == weights_only
                 and info.name != name and info.name not in self.written]
        if ahead and not self.overwrite:
            raise CheckpointSaveError(
                f"checkpoint {name} not saved: save_folder={self.folder!r} already holds checkpoint(s) {ahead} at or "
                f"after batch {batch}, written by another run; pass save_overwrite=True to replace them, "
                "autoresume=True to continue that run, or use a new save_folder")
        path = self.store.path(name)
        if not any(info.name == name for info in found) and not self.store.holds(name):
            return
        if not self.overwrite:
            when = f" (this run wrote it at batch {self.written[name][0]})" if name in self.written else ""
            raise CheckpointSaveError(
                f"checkpoint {name} not saved: {path!r} already exists{when}; pass save_overwrite=True to replace "
                "it, or give the checkpoint another name (save_filename, save_checkpoint(name=...))")
        if primary:
            for info in found:
                if info.batch >= batch and info.name in ahead:
                    self.store.remove(info)
            # The old one loads under its name until the replacement is verified.
            self.store.set_aside(name, any(info.name == name and info.path == path for info in found))
        self.written.pop(name, None)

    def _finish_in_flight(self, timeout_s: float | None = None) -> None:
        """Wait for the save in flight and check that it reached the disk; raise if it did not."""
        pending = self._pending
        error: BaseException | None = None
        try:
            call_with_timeout(getattr(self.writer, "wait_until_finished", lambda: None), timeout_s,
                              f"checkpoint {pending.name if pending else ''} was still being written after "
                              f"{timeout_s} s")
        except CheckpointSaveError:
            raise
        except Exception as caught:  # the writer thread's error, re-raised by orbax
            error = caught
        finally:
            SWITCH_INTERVAL.release(self)
        if pending is None:
            return
        self._pending, self.in_flight = None, None
        # orbax logs (and swallows) some writer errors: the folder is the only proof of a save (orbax
        # renames it into place once every item is written), or in a bucket the marker uploaded last.
        if error is None and self.store.landed(pending.name, pending.batch, pending.weights_only):
            self.last_saved, self.last_saved_path = pending.batch, self.store.path(pending.name)
            self.written[pending.name] = (pending.batch, pending.weights_only)
            self._after_save(pending)
            return
        reason = first_line(error) if error is not None else (
            f"its upload failed: {first_line(self._upload_error)}" if self._upload_error is not None else
            "it is not in the folder after the write finished")
        self._failed.discard(self.writer, pending.name)
        raise CheckpointSaveError(f"checkpoint {pending.name} was not saved in {self.folder!r}: {reason}") from None

    def _after_save(self, pending: _Pending) -> None:
        """A verified save: drop the copy it replaced and the oldest beyond ``keep``, point ``latest`` at it."""
        try:
            if dist.is_process_zero():
                self.store.committed(pending.name)
                rotating = [info for info in self.checkpoints() if info.rotate]
                if pending.rotate and self.keep is not None:
                    for info in rotating[:-self.keep]:
                        if info.name != pending.name:
                            self.store.remove(info)
            if pending.latest is not None and (dist.is_process_zero() or self._latest_per_process):
                self.store.point_latest(pending.latest, pending.name)
        except OSError as error:  # the checkpoint itself is on disk (in the bucket) and verified
            print(f"composerjax: checkpoint {pending.name} is saved, but updating {self.folder} failed: "
                  f"{first_line(error)}", file=sys.stderr, flush=True)

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
    def read_meta(self, which: str | int | None = None) -> dict[str, Any]:
        """The JSON item of checkpoint ``which`` (newest by default): ``{'host': ..., 'hparams': ...}``."""
        info = which if isinstance(which, CheckpointInfo) else self.find(which)
        try:
            meta = self.writer.restore(self.store.readable(info).path,
                                       args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception as error:
            raise CheckpointCorruptError(f"checkpoint {info.name} in {self.folder!r}: its 'meta' item cannot be "
                                         f"read: {first_line(error)}") from error
        if not isinstance(meta, dict) or not isinstance(meta.get("host"), dict):
            raise CheckpointCorruptError(f"checkpoint {info.name} in {self.folder!r}: its 'meta' item has no 'host' "
                                         "section; expected one written by composerjax's Trainer")
        return dict(meta)

    def read_host(self, which: str | int | None = None) -> dict[str, Any]:
        """The host state saved with checkpoint ``which``: rng, timestamp, data position, plugin states."""
        return dict(self.read_meta(which)["host"])

    def read_hparams(self, which: str | int | None = None) -> dict[str, Any]:
        """The hyperparameters saved with checkpoint ``which`` (newest by default).

        Example::

            Checkpointer("runs/x/checkpoints").read_hparams()["max_duration"]  # '10ep'
        """
        return dict(self.read_meta(which)["hparams"])

    def restore(self, state: State, which: str | int | None = None, weights_only: bool = False,
                field: str = "load_path", options: LoadOptions | None = None) -> int:
        """Load checkpoint ``which`` (the newest by default) into ``state``, on its current shardings.

        Nothing in ``state`` changes until the whole load is checked: the arrays kept (after
        ``options``' ignore keys and excluded algorithms) are compared with the run's, then read,
        then checked against the checksums saved with them.

        Args:
            state: the run to load into; its device state gives the expected names, shapes and
                the target shardings (a checkpoint saved on 4 devices loads on 1, and back).
            which: a checkpoint name, a batch index, or None for the newest (the newest full one
                unless loading weights only).
            weights_only: load only the model's variables; time, optimizer and algorithm state stay.
            field: the Trainer argument the folder came from, for error messages.
            options: Composer's load options (:class:`LoadOptions`); ``weights_only`` is theirs too.

        Returns:
            The batch index the checkpoint recorded.

        Raises:
            FileNotFoundError: no such checkpoint in the folder.
            CheckpointMismatchError: the checkpoint does not fit (every difference is listed).
            CheckpointCorruptError: the checkpoint cannot be read back as written (an item is
                missing, a file is unreadable, or a checksum differs).
        """
        options = options or LoadOptions()
        if weights_only and not options.weights_only:
            options = dataclasses.replace(options, weights_only=True)
        info = which if isinstance(which, CheckpointInfo) else self.find(which, field, any_kind=options.weights_only)
        where = f"{field}={self.folder!r}: checkpoint {info.name}"
        try:
            local = self.store.readable(info)  # a bucket's checkpoint is downloaded first
        except Exception as error:
            raise CheckpointCorruptError(f"{where} cannot be downloaded: {first_line(error)}") from error
        self.last_load = load_into(self.writer, state, local, self.read_host(local), options, where)
        if not options.weights_only:
            # The run now holds exactly what this checkpoint holds: a save of it at that batch (a finished
            # run restarted, whose fit() saves at its end again) is already done, not another run's.
            self.last_saved, self.last_saved_path = info.batch, info.path
            self.written[info.name] = (info.batch, info.weights_only)
        return info.batch

    def restore_newest_valid(self, state: State, field: str = "save_folder", weights_only: bool = False,
                             report: Any = None, options: LoadOptions | None = None) -> int:
        """Load the newest checkpoint (by recorded clock) that reads back intact, walking back past corrupt ones.

        Each checkpoint skipped is reported (``report(message)``, stderr by default) with why, and
        recorded in ``corrupt``: when this checkpointer's run reaches one of those batches again,
        its save replaces the corrupt checkpoint instead of being refused. A checkpoint that does
        not fit the run (:class:`CheckpointMismatchError`) stops the walk: the run, not the
        checkpoint, is wrong. Weights-only checkpoints are passed over unless ``weights_only``.

        Raises:
            FileNotFoundError: no checkpoint in the folder.
            CheckpointCorruptError: every checkpoint in the folder is corrupt (each reason listed).

        Example::

            Checkpointer("runs/x/checkpoints").restore_newest_valid(trainer.state)  # 1200
        """
        report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        weights_only = weights_only or (options is not None and options.weights_only)
        self.find(None, field, any_kind=weights_only)  # raises when there is nothing to load
        candidates = [info for info in self.checkpoints() if weights_only or not info.weights_only]
        reasons = []
        for info in reversed(candidates):
            try:
                return self.restore(state, info, weights_only=weights_only, field=field, options=options)
            except CheckpointCorruptError as error:
                self.corrupt.add(info.name)
                reasons.append(f"checkpoint {info.name}: {error}")
                report(f"composerjax: skipped checkpoint {info.name} in {self.folder}: {error}")
        raise CheckpointCorruptError(f"{field}={self.folder!r}: no checkpoint loads:\n  " + "\n  ".join(reasons))

    # -- lifetime --------------------------------------------------------------------------------
    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every started save is on disk (and put the GIL switch interval back).

        Raises:
            CheckpointSaveError: the save in flight failed, or is still running after ``timeout_s``.
        """
        self._finish_in_flight(timeout_s)

    def close(self, timeout_s: float | None = None) -> None:
        """Finish pending saves, release orbax's writer and the folder.

        Raises:
            CheckpointSaveError: the save in flight failed (the writer is released all the same).
        """
        if self._closed:
            return
        self._closed = True
        try:
            self.wait(timeout_s)
        finally:
            try:
                call_with_timeout(self.writer.close, timeout_s, "orbax's checkpoint writer did not close")
            except Exception:  # noqa: S110 - the save's own error (above) is the one to report
                pass
            self._failed.discard_again(self.writer)
            if self._owner is not None:
                self._owner.release()
                self._owner = None
            self.store.close()


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
