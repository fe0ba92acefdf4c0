"""The Trainer, its checkpoints and how it stops."""

from composerjax.checkpoint.checkpointer import Checkpointer, CheckpointMismatchError
from composerjax.trainer.interrupt import BatchError, TrainingInterrupted
from composerjax.trainer.sections import TrainerSettings
from composerjax.trainer.trainer import Trainer, build_trainer

__all__ = ["Trainer", "TrainerSettings", "build_trainer",
           "Checkpointer", "CheckpointMismatchError", "BatchError", "TrainingInterrupted", "TrainerConfig",
           "ConfigError", "load_config"]


def __getattr__(name: str) -> object:
    """``TrainerConfig``, ``ConfigError`` and ``load_config`` from ``composerjax.trainer.config``, on first use."""
    if name in ("TrainerConfig", "ConfigError", "load_config"):
        from composerjax.trainer import config

        return getattr(config, name)
    raise AttributeError(f"module 'composerjax.trainer' has no attribute {name!r}")
