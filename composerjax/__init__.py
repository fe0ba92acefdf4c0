"""composerjax: Composer-style algorithm/event orchestration for JAX (Flax NNX + optax).

Example:
    >>> from composerjax import Trainer, Event, Algorithm, Callback, Time
    >>> Time.from_timestring('10ep')
    Time(10, TimeUnit.EPOCH)
"""

from composerjax.core import (
    DEFAULT_PASSES,
    Algorithm,
    AlgorithmPass,
    Callback,
    Engine,
    Event,
    Plan,
    State,
    Time,
    Timestamp,
    TimeUnit,
    Trace,
)
from composerjax.data import ArrayLoader
from composerjax.loggers import Logger, LoggerDestination
from composerjax.models import ComposerClassifier, ComposerModel
from composerjax.trainer import BatchError, CheckpointMismatchError, Trainer, TrainingInterrupted

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_PASSES",
    "Algorithm",
    "AlgorithmPass",
    "ArrayLoader",
    "BatchError",
    "Callback",
    "CheckpointMismatchError",
    "ComposerClassifier",
    "ComposerModel",
    "Engine",
    "Event",
    "Logger",
    "LoggerDestination",
    "Plan",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trace",
    "Trainer",
    "TrainingInterrupted",
]
