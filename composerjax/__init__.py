"""composerjax: Composer-style algorithm/event orchestration for JAX (Flax NNX + optax).

Example:
    >>> from composerjax import Trainer, Event, Algorithm, Callback, Time
    >>> Time.from_timestring('10ep')
    Time(10, TimeUnit.EPOCH)
"""

# XLA reads XLA_FLAGS when JAX's backend starts: the GPU options go in first (a no-op off GPU;
# COMPOSERJAX_XLA_GPU_FLAGS=0 leaves them out, composerjax.xla_flags.remove_gpu_xla_flags() takes them back).
from composerjax.xla_flags import apply_gpu_xla_flags, gpu_platform_requested

if gpu_platform_requested():  # decided without starting JAX's backend
    apply_gpu_xla_flags()

# Started by `composerjax launch` (or with its variables set): jax.distributed must start before
# anything touches JAX's backend, so before the rest of composerjax is imported.
from composerjax import dist

if dist.launched():
    dist.initialize()

from composerjax._version import __version__ as __version__  # one home, read by the lower layers too
from composerjax.core import (
    DEFAULT_PASSES,
    Algorithm,
    AlgorithmPass,
    Callback,
    Engine,
    Evaluator,
    Event,
    Plan,
    State,
    Time,
    Timestamp,
    TimeUnit,
    Trace,
    ensure_time,
)
from composerjax.data import ArrayLoader
from composerjax.loggers import Logger, LoggerDestination
from composerjax.models import ComposerClassifier, ComposerModel
from composerjax.parallel import ParallelismConfig
from composerjax.step.compile_cache import switch_on_at_import
from composerjax.trainer import BatchError, CheckpointMismatchError, Trainer, TrainingInterrupted

# JAX's persistent compilation cache, on before the model is built (its initialisation compiles too);
# COMPOSERJAX_COMPILATION_CACHE=0 leaves it off, Trainer(compilation_cache=...) picks another folder.
switch_on_at_import()

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
    "Evaluator",
    "Event",
    "Logger",
    "LoggerDestination",
    "ParallelismConfig",
    "Plan",
    "State",
    "Time",
    "TimeUnit",
    "Timestamp",
    "Trace",
    "Trainer",
    "TrainerConfig",
    "TrainingInterrupted",
    "dist",
    "ensure_time",
    "load_config",
]

def __getattr__(name: str) -> object:
    """``composerjax.TrainerConfig`` and ``composerjax.load_config``, imported on first use (pydantic)."""
    if name in ("TrainerConfig", "load_config"):
        from composerjax import trainer  # it imports its config module lazily too

        return getattr(trainer, name)
    raise AttributeError(f"module 'composerjax' has no attribute {name!r}")
