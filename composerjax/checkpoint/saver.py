"""CheckpointSaver: the Trainer's checkpointing, as a callback on the checkpoint events; and the Trainer's loading.

:func:`load_at_start` does what ``Trainer(load_path=..., autoresume=..., load_*=...)`` asks after
INIT; :func:`save_now` is ``Trainer.save_checkpoint``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

from composerjax.checkpoint.checkpointer import Checkpointer, CheckpointSaveError
from composerjax.checkpoint.load import LoadOptions
from composerjax.checkpoint.settings import (
    DEFAULT_FILENAME,
    DEFAULT_LATEST,
    DEFAULT_SAVE_INTERVAL,
    KEEP_ALL,
    CheckpointSettings,
    check_keep,
    save_interval_of,
)
from composerjax.checkpoint.storage import is_remote, storage_for
from composerjax.checkpoint.writer import check_template, format_name, read_info, resolve_pointer
from composerjax.console import print_error
from composerjax.core.callback import Callback
from composerjax.core.state import ResumePoint, State
from composerjax.core.time import Time, Timestamp, TimeUnit
from composerjax.core.timestamp import UNIT_FIELDS
from composerjax.parallel import dist

__all__ = ["CheckpointSaver", "ABANDON_SAVE_TIMEOUT_S", "DEFAULT_FILENAME", "DEFAULT_LATEST", "checkpoint_location",
           "load_at_start", "refuse_old_checkpoints", "resumed", "save_now"]


#: When ``fit`` fails, how long it waits for a checkpoint in flight to reach the disk before giving up.
ABANDON_SAVE_TIMEOUT_S = 120.0


class CheckpointSaver(Callback):
    """Save checkpoints (orbax, async) every ``save_interval`` and at the end of ``fit``.

    The Trainer installs one from its ``save_folder``/``save_*`` arguments; pass your own in
    ``callbacks`` instead (and no ``save_folder``) to configure it yourself. It saves at
    ``BATCH_CHECKPOINT`` for batch intervals (a save that falls on an epoch's last batch waits for
    ``EPOCH_CHECKPOINT``, so checkpoints sit on clean epoch boundaries), at ``EPOCH_CHECKPOINT`` for
    epoch intervals, and at ``FIT_END`` (the end of training, a time limit or a signal always leaves
    a checkpoint), where it also waits until the save is on disk and verified. Each save is a trace
    (``CheckpointSaver/BATCH_CHECKPOINT`` ...) with the time ``save()`` took to return.

    Args:
        folder: the folder to save into (created if missing), or an ``s3://bucket/path`` /
            ``gs://bucket/path`` URI (staged locally, uploaded whole; see ``docs/checkpointing.md``).
        save_interval: ``'1ep'``, ``'500ba'`` (an int counts epochs).
        num_checkpoints_to_keep: keep the newest N of the saver's checkpoints (-1 keeps all);
            ``Trainer.save_checkpoint`` ones are kept.
        weights_only: save only the model's variables (such a checkpoint cannot resume a run).
        overwrite: replace a checkpoint of the same name, and checkpoints another run left in
            ``folder`` at or after the batch saved; without it such a save raises.
        filename: each checkpoint's folder name, a template with ``{epoch}``, ``{batch}``,
            ``{sample}``, ``{token}``, ``{run_name}``, ``{rank}`` ... (``ep1-ba8``).
        latest_filename: a symlink in ``folder`` to the newest verified checkpoint (a small file
            naming it where symlinks are not possible); None makes none.
        remote_file_name: the name (a template with slashes allowed) a verified local checkpoint is
            handed to loggers that keep files under (``WandBLogger(log_artifacts=True)``,
            ``MLFlowLogger``), as Composer's; None hands nothing. A checkpoint saved to a bucket is
            not handed on.
        latest_remote_file_name: with ``remote_file_name``, also hand loggers Composer's pointer, a
            ``<name>.symlink`` file holding the newest checkpoint's remote name; None skips it.
        ignore_keys: Composer leaves these state-dict paths out of the saved file; only None is
            accepted here (leave them out when loading instead, with ``load_ignore_keys``).
        num_concurrent_uploads: accepted for Composer's signature (a positive integer); remote
            saves upload one checkpoint at a time in the writer's background thread.
        upload_timeout_in_seconds: accepted for Composer's signature (a positive integer); a
            remote upload is bounded by the save's own wait instead.

    Example::

        trainer = Trainer(model, loader, max_duration="2ep",
                          callbacks=[CheckpointSaver("runs/x/checkpoints", save_interval="100ba")])
    """

    accepts_grouped_batches = True
    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self, folder: str | os.PathLike[str] = "{run_name}/checkpoints", filename: str = DEFAULT_FILENAME,
                 remote_file_name: str | None = "{run_name}/checkpoints/" + DEFAULT_FILENAME,
                 latest_filename: str | None = DEFAULT_LATEST,
                 latest_remote_file_name: str | None = "{run_name}/checkpoints/" + DEFAULT_LATEST,
                 save_interval: Time | str | int = DEFAULT_SAVE_INTERVAL, *, overwrite: bool = False,
                 num_checkpoints_to_keep: int = KEEP_ALL,
                 weights_only: bool = False, ignore_keys: Any = None, num_concurrent_uploads: int = 1,
                 upload_timeout_in_seconds: int = 3600) -> None:
        if not isinstance(folder, (str, os.PathLike)):
            raise ValueError(f"save_folder={folder!r}: expected a folder path (str) or None")
        check_keep(num_checkpoints_to_keep)
        for flag, value in (("save_weights_only", weights_only), ("save_overwrite", overwrite)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r}: expected True or False")
        if ignore_keys is not None:
            raise ValueError(f"CheckpointSaver(ignore_keys={ignore_keys!r}): leaving parts out of a saved checkpoint "
                             "is not supported; save everything and leave them out when loading "
                             "(Trainer(load_ignore_keys=...)), or pass None")
        for name, value in (("num_concurrent_uploads", num_concurrent_uploads),
                            ("upload_timeout_in_seconds", upload_timeout_in_seconds)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"CheckpointSaver({name}={value!r}): expected a positive integer")
        self.folder = os.fspath(folder)
        storage_for(self.folder, "save_folder")  # an unsupported URI scheme fails here, not at the first save
        self.save_interval = save_interval_of(save_interval)
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = weights_only
        self.overwrite = overwrite
        self.filename, self.latest_filename = filename, latest_filename
        self.remote_file_name, self.latest_remote_file_name = remote_file_name, latest_remote_file_name
        self.num_concurrent_uploads, self.upload_timeout_in_seconds = num_concurrent_uploads, upload_timeout_in_seconds
        check_template(filename, "save_filename")
        if latest_filename is not None:
            check_template(latest_filename, "save_latest_filename", one_per_run=False)
        for name, template in (("remote_file_name", remote_file_name),
                               ("latest_remote_file_name", latest_remote_file_name)):
            if template is not None:
                check_template(template, name, one_per_run=False, path=True)
        self.checkpointer: Checkpointer | None = None
        self._hparams: Any = None
        self._save_after_epoch = False
        self._handed_over: str | None = None
        self._saved_at: dict[str, Timestamp] = {}  # each save's clock, for its remote name

    def open(self, timestamp: Timestamp, run_name: str, hparams: Callable[[], dict[str, Any]]) -> None:
        """Open the folder for the run ``run_name`` (it holds the folder's owner lock from now on).

        ``hparams`` gives the run's settings, saved with every checkpoint.
        """
        keep = None if self.num_checkpoints_to_keep == -1 else self.num_checkpoints_to_keep
        if "{" in self.folder:  # Composer's '{run_name}/checkpoints'
            self.folder = format_name(self.folder, timestamp, run_name, "save_folder", path=True)
        self.checkpointer = Checkpointer(self.folder, self.save_interval, keep, self.weights_only,
                                         owner=run_name, overwrite=self.overwrite,
                                         filename=self.filename, latest_filename=self.latest_filename)
        self._hparams = hparams

    @classmethod
    def from_settings(cls, settings: CheckpointSettings) -> CheckpointSaver:
        """The saver ``Trainer(save_folder=..., save_*=...)`` asks for, from its checkpoint section.

        Example::

            CheckpointSaver.from_settings(CheckpointSettings(save_folder="runs/x/checkpoints", save_interval="100ba"))
        """
        return cls(settings.save_folder or "{run_name}/checkpoints", filename=settings.save_filename,
                   latest_filename=settings.save_latest_filename, save_interval=settings.save_interval,
                   num_checkpoints_to_keep=settings.save_num_checkpoints_to_keep,
                   weights_only=settings.save_weights_only, overwrite=settings.save_overwrite)

    def save(self, state: State) -> str:
        """Start a save of ``state`` now (async); return the checkpoint's folder."""
        if self.checkpointer is None:
            raise RuntimeError("CheckpointSaver.save(): not opened by a Trainer yet")
        path = self.checkpointer.save(state, self._hparams())
        recent = [(p, t) for p, t in self._saved_at.items() if p != path][-3:]
        self._saved_at = dict([*recent, (path, state.timestamp)])
        return path

    # -- when ----------------------------------------------------------------------------------
    def next_due(self, timestamp: Timestamp) -> int | None:
        """The next batch count a batch-interval save falls on (grouped calls stop there)."""
        if self.save_interval.unit != TimeUnit.BATCH:
            return None
        every = int(self.save_interval.value)
        return (int(timestamp.batch) // every + 1) * every

    def _due(self, counter: Any, unit: TimeUnit) -> bool:
        counter = int(counter)
        return self.save_interval.unit == unit and counter > 0 and counter % int(self.save_interval.value) == 0

    # -- events --------------------------------------------------------------------------------
    def batch_checkpoint(self, state: State, logger: Any) -> bool:
        if not self._due(state.timestamp.batch, TimeUnit.BATCH):
            return False
        if int(state.timestamp.batch_in_epoch) == state.dataloader_len:
            self._save_after_epoch = True  # saved once the epoch is closed: a clean epoch boundary
            return False
        self.save(state)
        self._hand_to_loggers(state, logger)
        return True

    def epoch_checkpoint(self, state: State, logger: Any) -> bool:
        due = self._save_after_epoch or self._due(state.timestamp.epoch, TimeUnit.EPOCH)
        self._save_after_epoch = False
        if due:
            self.save(state)
            self._hand_to_loggers(state, logger)
        return due

    def fit_end(self, state: State, logger: Any) -> bool:
        """The last checkpoint of the run, on disk and verified before ``fit`` returns."""
        checkpointer = self.checkpointer
        before = (checkpointer.last_saved_path, checkpointer.in_flight_name)
        path = self.save(state)
        self._hand_to_loggers(state, logger)  # the save before, verified as this one started
        checkpointer.wait()  # raises CheckpointSaveError if a save did not reach the disk
        self._hand_to_loggers(state, logger)
        return path != before[0] and os.path.basename(path) != before[1]

    def _hand_to_loggers(self, state: State, logger: Any) -> None:
        """Give the newest verified local checkpoint to loggers that keep files (W&B, MLflow), once.

        A save is verified when the next one starts (or at ``fit_end``), so a checkpoint reaches them
        one save later than the disk; one in a bucket (``s3://``) is already remote and is not handed on.
        """
        path = self.checkpointer.last_saved_path if self.checkpointer is not None else None
        if (path is None or path == self._handed_over or is_remote(path) or self.remote_file_name is None
                or not any(d.can_upload_files() for d in getattr(logger, "destinations", ()))):
            return
        self._handed_over = path
        timestamp = self._saved_at.get(path, state.timestamp)
        remote_name = format_name(self.remote_file_name, timestamp, state.run_name, "remote_file_name", path=True)
        # Loggers read the checkpoint's clock from the state (W&B aliases 'ep1-ba4', metadata): the
        # state they see is the one saved, as when Composer uploads right after its save.
        now, state.timestamp = state.timestamp, timestamp
        try:
            logger.upload_file(remote_name, path)
            if self.latest_remote_file_name is not None:
                # Composer's pointer: a small '<latest>.symlink' file holding the checkpoint's remote name.
                latest = format_name(self.latest_remote_file_name, timestamp, state.run_name,
                                     "latest_remote_file_name", path=True)
                with tempfile.TemporaryDirectory() as folder:
                    pointer = os.path.join(folder, f"{os.path.basename(latest)}.symlink")
                    with open(pointer, "w", encoding="utf-8") as file:
                        file.write(remote_name)
                    logger.upload_file(f"{latest}.symlink", pointer, overwrite=True)
        finally:
            state.timestamp = now

    def fit_error(self, state: State, logger: Any, error: BaseException) -> None:
        """``fit`` is failing: let the save in flight finish (bounded), then release the folder.

        The original error is the one the caller sees; what happened to the save is one line on
        stderr above it, so orbax's shutdown is never the first (or only) thing a user reads.
        """
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        pending = checkpointer.in_flight_name
        try:
            checkpointer.close(timeout_s=ABANDON_SAVE_TIMEOUT_S)
            if pending is not None:
                print_error(f"composerjax: fit failed ({type(error).__name__}); checkpoint {pending}, in flight, was "
                             f"finished and verified in {checkpointer.folder}")
        except CheckpointSaveError as save_error:
            print_error(f"composerjax: fit failed ({type(error).__name__}); and {save_error}")

    def close(self, state: State, logger: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def refuse_old_checkpoints(checkpointer: Checkpointer) -> None:
    """A new run may not write into a folder that holds another run's checkpoints (nothing lost, nothing mixed)."""
    names = [info.name for info in checkpointer.checkpoints()]
    if names:
        checkpointer.close()
        raise ValueError(
            f"save_folder={checkpointer.folder!r} already holds checkpoints {names} from an earlier run; expected an "
            "empty or new folder. Pass autoresume=True to continue that run, save_overwrite=True to replace its "
            "checkpoints, or a new save_folder")


def checkpoint_location(path: str) -> tuple[str, str | None]:
    """``(folder, name)`` for a save folder (name None: its newest) or one checkpoint in it (or its ``latest`` link).

    A ``s3://``/``gs://`` URI is looked up in its bucket the same way (``latest`` is an object there).

    Example:
        >>> import tempfile
        >>> folder = tempfile.mkdtemp()
        >>> checkpoint_location(folder) == (folder, None)
        True
    """
    if is_remote(path):
        return storage_for(path, "load_path").locate()
    path = os.path.abspath(resolve_pointer(os.path.abspath(path)))
    if os.path.isfile(path):
        raise FileNotFoundError(f"load_path={path!r} is a file; expected a save_folder, one checkpoint folder inside "
                                "it, or its latest link")
    if any(os.path.exists(os.path.join(path, item)) for item in ("_CHECKPOINT_METADATA", "meta", "state")):
        return os.path.dirname(path), read_info(path).name
    return path, None


def load_at_start(settings: CheckpointSettings, checkpointer: Checkpointer | None, state: State,
                  report: Callable[[str], None] | None = None) -> int | None:
    """Load what the checkpoint section asks for, after INIT; return the batch loaded (None: nothing loaded).

    With ``autoresume`` and a checkpoint in ``save_folder`` (``checkpointer``'s folder): the newest
    one (by recorded clock) that reads back intact, in full; the ``load_*`` options then do not
    apply, except ``load_strict_model_weights`` (as in Composer). Else ``load_path`` (a save folder:
    its newest checkpoint; or one checkpoint's folder, or a ``latest`` link; local or
    ``s3://``/``gs://``) with ``load_weights_only``, ``load_strict_model_weights``,
    ``load_ignore_keys`` and ``load_exclude_algorithms``.

    Raises:
        FileNotFoundError, CheckpointMismatchError, CheckpointCorruptError: see ``Checkpointer.restore``.

    Example::

        self.resumed_from = load_at_start(settings.checkpoint, self.checkpointer, state, report=print_error)
    """
    strict = settings.load_strict_model_weights
    if settings.autoresume and checkpointer is not None and checkpointer.checkpoints():
        batch = checkpointer.restore_newest_valid(state, "save_folder", report=report,
                                                  options=LoadOptions(strict_model_weights=strict))
        return resumed(state, checkpointer, batch, "autoresume")
    if settings.load_path is None:
        return None
    options = LoadOptions(weights_only=settings.load_weights_only, strict_model_weights=strict,
                          ignore_keys=settings.load_ignore_keys, exclude_algorithms=settings.load_exclude_algorithms)
    folder, name = checkpoint_location(os.fspath(settings.load_path))
    loader = Checkpointer(folder, async_save=False)
    try:
        if name is None:
            batch = loader.restore_newest_valid(state, "load_path", report=report, options=options)
        else:
            batch = loader.restore(state, name, field="load_path", options=options)
        return batch if options.weights_only else resumed(state, loader, batch, "load_path")
    finally:
        loader.close()


def resumed(state: State, checkpointer: Checkpointer, batch: int, how: str) -> int:
    """Record and say that the run continues from the checkpoint ``checkpointer`` just loaded in full; ``batch``.

    Sets ``state.resumed_from`` (plugins cut their files back to ``batch`` at ``AFTER_LOAD``) and
    prints, on process 0, ``"<how>: resumed from <checkpoint> at batch <batch>"``, and when the
    checkpoint already reaches ``max_duration``, a line saying that ``fit()`` has nothing left to
    train and why (``max_duration`` is the whole run's length, not batches added to the checkpoint's).

    Example::

        resumed(trainer.state, trainer.checkpointer, 40, "autoresume")  # autoresume: resumed from ... at batch 40
    """
    # restore() leaves the loaded checkpoint's folder in last_saved_path (named as in the save folder).
    name = os.path.basename(os.path.normpath(checkpointer.last_saved_path))
    checkpoint = f"{checkpointer.folder.rstrip('/')}/{name}" if is_remote(checkpointer.folder) else os.path.join(
        checkpointer.folder, name)
    state.resumed_from = ResumePoint(checkpoint, batch)
    if not dist.is_process_zero():
        return batch
    shown = checkpoint
    if not is_remote(checkpoint) and not os.path.relpath(checkpoint).startswith(os.pardir):
        shown = os.path.relpath(checkpoint)
    print(f"{how}: resumed from {shown} at batch {batch}", flush=True)
    duration = state.max_duration
    if duration is not None:
        reached = getattr(state.timestamp.counts, UNIT_FIELDS[duration.unit])
        if reached >= duration.value:
            print(f"{how}: max_duration={duration} is already reached ({reached}{duration.unit.value} at this "
                  f"checkpoint), so fit() trains no batch: max_duration is the length of the whole run, counted "
                  f"from its first batch, not more training after the checkpoint; set it above {reached}"
                  f"{duration.unit.value} to train more", flush=True)
    return batch


def save_now(checkpointer: Checkpointer | None, state: State, hparams: dict[str, Any],
             name: str = DEFAULT_FILENAME, weights_only: bool = False) -> str:
    """``Trainer.save_checkpoint``: save now into ``save_folder``, wait until it is on disk and verified; its folder.

    ``name`` is a template like ``save_filename``. A checkpoint of that name already there is
    replaced only with ``save_overwrite=True`` (one this run just wrote at this batch is returned
    as it is). It does not count towards ``save_num_checkpoints_to_keep``.

    Raises:
        ValueError: the Trainer has no ``save_folder``.
        CheckpointSaveError: the save was refused or failed (also a failed earlier async save).

    Example::

        path = save_now(trainer.checkpointer, trainer.state, trainer.hparams, "final")  # 'runs/x/checkpoints/final'
    """
    if checkpointer is None:
        raise ValueError("save_checkpoint(): Trainer(save_folder=None); pass a save_folder to save")
    path = checkpointer.save(state, hparams, name=name, weights_only=weights_only, rotate=False)
    checkpointer.wait()
    return path
