"""The Trainer, its checkpoints and how it stops."""

from composerjax.trainer.checkpoint import Checkpointer, CheckpointMismatchError
from composerjax.trainer.interrupt import BatchError, TrainingInterrupted
from composerjax.trainer.trainer import Trainer

__all__ = ["Trainer", "Checkpointer", "CheckpointMismatchError", "BatchError", "TrainingInterrupted"]
