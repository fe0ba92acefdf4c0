"""CheckpointSaver: the Trainer's checkpointing, as a callback on the checkpoint events."""

from __future__ import annotations

import os
import sys
from typing import Any

from composerjax.core.callback import Callback
from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp, TimeUnit
from composerjax.trainer.checkpoint import Checkpointer, CheckpointSaveError

__all__ = ["CheckpointSaver", "ABANDON_SAVE_TIMEOUT_S", "checkpoint_location", "refuse_old_checkpoints"]

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
        folder: the folder to save into (created if missing).
        save_interval: ``'1ep'``, ``'500ba'`` (an int counts epochs).
        num_checkpoints_to_keep: keep the newest N checkpoints (-1 keeps all).
        weights_only: save only the model's variables (such a checkpoint cannot resume a run).
        overwrite: replace checkpoints another run left in ``folder``.

    Example::

        trainer = Trainer(model, loader, max_duration="2ep",
                          callbacks=[CheckpointSaver("runs/x/checkpoints", save_interval="100ba")])
    """

    accepts_grouped_batches = True
    trace_actions = True
    in_checkpoints = False  # nothing to resume: the trainer's arguments configure it again

    def __init__(self, folder: str | os.PathLike[str], save_interval: Time | str | int = "1ep",
                 num_checkpoints_to_keep: int = -1, weights_only: bool = False, overwrite: bool = False) -> None:
        if not isinstance(folder, (str, os.PathLike)):
            raise ValueError(f"save_folder={folder!r}: expected a folder path (str) or None")
        if isinstance(num_checkpoints_to_keep, bool) or not isinstance(num_checkpoints_to_keep, int) or (
                num_checkpoints_to_keep < 1 and num_checkpoints_to_keep != -1):
            raise ValueError(f"save_num_checkpoints_to_keep={num_checkpoints_to_keep!r}: expected a positive "
                             "integer, or -1 to keep all")
        for flag, value in (("save_weights_only", weights_only), ("save_overwrite", overwrite)):
            if not isinstance(value, bool):
                raise ValueError(f"{flag}={value!r}: expected True or False")
        self.folder = os.fspath(folder)
        self.save_interval = _save_interval(save_interval)
        self.num_checkpoints_to_keep = num_checkpoints_to_keep
        self.weights_only = weights_only
        self.overwrite = overwrite
        self.checkpointer: Checkpointer | None = None
        self._hparams: Any = None
        self._save_after_epoch = False

    def attach_trainer(self, trainer: Any) -> None:
        """Open the folder for ``trainer``'s run (it holds the folder's owner lock from now on)."""
        keep = None if self.num_checkpoints_to_keep == -1 else self.num_checkpoints_to_keep
        self.checkpointer = Checkpointer(self.folder, self.save_interval, keep, self.weights_only,
                                         owner=trainer.state.run_name, overwrite=self.overwrite)
        self._hparams = lambda: trainer.hparams

    def save(self, state: State) -> int:
        """Start a save of ``state`` now (async); return its batch index."""
        if self.checkpointer is None:
            raise RuntimeError("CheckpointSaver.save(): not attached to a Trainer yet")
        return self.checkpointer.save(state, self._hparams())

    # -- when ----------------------------------------------------------------------------------
    def next_due(self, timestamp: Timestamp) -> int | None:
        """The next batch count a batch-interval save falls on (grouped calls stop there)."""
        if self.save_interval.unit != TimeUnit.BATCH:
            return None
        every = int(self.save_interval.value)
        return (timestamp.batch // every + 1) * every

    def _due(self, counter: int, unit: TimeUnit) -> bool:
        return self.save_interval.unit == unit and counter > 0 and counter % int(self.save_interval.value) == 0

    # -- events --------------------------------------------------------------------------------
    def batch_checkpoint(self, state: State, logger: Any) -> bool:
        if not self._due(state.timestamp.batch, TimeUnit.BATCH):
            return False
        if state.timestamp.batch_in_epoch == state.dataloader_len:
            self._save_after_epoch = True  # saved once the epoch is closed: a clean epoch boundary
            return False
        self.save(state)
        return True

    def epoch_checkpoint(self, state: State, logger: Any) -> bool:
        due = self._save_after_epoch or self._due(state.timestamp.epoch, TimeUnit.EPOCH)
        self._save_after_epoch = False
        if due:
            self.save(state)
        return due

    def fit_end(self, state: State, logger: Any) -> bool:
        """The last checkpoint of the run, on disk and verified before ``fit`` returns."""
        checkpointer = self.checkpointer
        saved = state.timestamp.batch in (checkpointer.last_saved, checkpointer.in_flight)
        self.save(state)
        checkpointer.wait()  # raises CheckpointSaveError if a save did not reach the disk
        return not saved

    def fit_error(self, state: State, logger: Any, error: BaseException) -> None:
        """``fit`` is failing: let the save in flight finish (bounded), then release the folder.

        The original error is the one the caller sees; what happened to the save is one line on
        stderr above it, so orbax's shutdown is never the first (or only) thing a user reads.
        """
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        pending = checkpointer.in_flight
        try:
            checkpointer.close(timeout_s=ABANDON_SAVE_TIMEOUT_S)
            if pending is not None:
                _print_error(f"composerjax: fit failed ({type(error).__name__}); checkpoint {pending}, in flight, was "
                             f"finished and verified in {checkpointer.folder}")
        except CheckpointSaveError as save_error:
            _print_error(f"composerjax: fit failed ({type(error).__name__}); and {save_error}")

    def close(self, state: State, logger: Any) -> None:
        if self.checkpointer is not None:
            self.checkpointer.close()


def _save_interval(value: Time | str | int) -> Time:
    if isinstance(value, bool):
        raise ValueError(f"save_interval={value!r}: expected a positive number of epochs or batches, e.g. '1ep'")
    try:
        interval = value if isinstance(value, Time) else Time.from_input(value, TimeUnit.EPOCH)
    except ValueError as error:
        raise ValueError(f"save_interval={value!r}: {error}") from error
    if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
        raise ValueError(f"save_interval={value!r}: expected a positive number of epochs or batches, e.g. "
                         "'1ep' or '500ba'")
    return interval


def _print_error(text: str) -> None:
    """One line on stderr, flushed (reports that must come before an error's traceback)."""
    print(text, file=sys.stderr, flush=True)


def refuse_old_checkpoints(checkpointer: Checkpointer) -> None:
    """A new run may not write into a folder that holds another run's checkpoints (nothing lost, nothing mixed)."""
    steps = checkpointer.steps()
    if steps:
        checkpointer.close()
        raise ValueError(
            f"save_folder={checkpointer.folder!r} already holds checkpoints {steps} from an earlier run; expected an "
            "empty or new folder. Pass autoresume=True to continue that run, save_overwrite=True to replace its "
            "checkpoints, or a new save_folder")


def checkpoint_location(path: str) -> tuple[str, int | None]:
    """``(folder, step)`` for a save_folder (newest step) or one checkpoint folder inside it."""
    path = os.path.abspath(path)
    name = os.path.basename(path)
    if name.isdigit() and os.path.exists(os.path.join(path, "_CHECKPOINT_METADATA")):
        return os.path.dirname(path), int(name)
    return path, None
