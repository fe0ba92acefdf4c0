"""Checkpoints: orbax folders written atomically, verified, loaded back and cleaned up.

A layer of its own between the compiled step (``composerjax.step``) and the trainer: the
:class:`~composerjax.checkpoint.saver.CheckpointSaver` callback saves on the events and loads at
start; :class:`~composerjax.checkpoint.checkpointer.Checkpointer` writes and reads one folder.
"""

from composerjax.checkpoint.checkpointer import (
    CheckpointCorruptError,
    Checkpointer,
    CheckpointMismatchError,
    CheckpointSaveError,
    SaveFolderInUseError,
)
from composerjax.checkpoint.saver import CheckpointSaver

__all__ = ["CheckpointCorruptError", "CheckpointMismatchError", "CheckpointSaveError", "CheckpointSaver",
           "Checkpointer", "SaveFolderInUseError"]
