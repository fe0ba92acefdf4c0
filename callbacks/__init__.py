"""Callbacks, written only against composerjax's public API.

Example::

    from composerjax.callbacks import SpeedMonitor, OptimizerMonitor, EarlyStopper
    trainer = Trainer(model, loader, "10ep", callbacks=[SpeedMonitor(), OptimizerMonitor(), EarlyStopper()])
"""

from composerjax.callbacks.activation_monitor import ActivationMonitor, activation_statistics
from composerjax.callbacks.early_stopper import EarlyStopper
from composerjax.callbacks.image_visualizer import ImageVisualizer
from composerjax.callbacks.lr_monitor import LRMonitor
from composerjax.callbacks.memory_monitor import MemoryMonitor
from composerjax.callbacks.nan_monitor import NaNMonitor, NonFiniteLossError
from composerjax.callbacks.optimizer_monitor import OptimizerMonitor
from composerjax.callbacks.profiler import Profiler
from composerjax.callbacks.runtime_estimator import RuntimeEstimator
from composerjax.callbacks.speed_monitor import SpeedMonitor
from composerjax.callbacks.system_metrics_monitor import SystemMetricsMonitor
from composerjax.callbacks.threshold_stopper import ThresholdStopper
from composerjax.callbacks.trace_recorder import TraceRecorder

# The Trainer's own built-ins (installed from its arguments; pass an instance to configure one yourself).
from composerjax.checkpoint.saver import CheckpointSaver
from composerjax.trainer.eval_runner import EvalRunner
from composerjax.trainer.stopping import SignalHandler, TimeLimit

__all__ = [
    "ActivationMonitor",
    "CheckpointSaver",
    "EvalRunner",
    "EarlyStopper",
    "ImageVisualizer",
    "LRMonitor",
    "MemoryMonitor",
    "NaNMonitor",
    "NonFiniteLossError",
    "OptimizerMonitor",
    "Profiler",
    "RuntimeEstimator",
    "SignalHandler",
    "SpeedMonitor",
    "SystemMetricsMonitor",
    "ThresholdStopper",
    "TimeLimit",
    "TraceRecorder",
    "activation_statistics",
]
