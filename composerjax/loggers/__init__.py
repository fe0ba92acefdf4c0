"""Loggers: the Logger facade and its destinations (console, progress bar, TensorBoard, JSONL, in-memory, W&B, MLflow).

``WandBLogger`` and ``MLFlowLogger`` import their tracker's package only when constructed
(``pip install 'composerjax[wandb]'`` / ``'composerjax[mlflow]'``).
"""

from composerjax.loggers.console import ConsoleLogger
from composerjax.loggers.file_logger import FileLogger
from composerjax.loggers.in_memory import InMemoryLogger
from composerjax.loggers.logger import Logger, LoggerDestination, is_process_zero
from composerjax.loggers.mlflow_logger import MLFlowLogger
from composerjax.loggers.progress_bar import ProgressBarLogger
from composerjax.loggers.tensorboard import TensorboardLogger
from composerjax.loggers.wandb_logger import WandBLogger

__all__ = [
    "Logger",
    "LoggerDestination",
    "is_process_zero",
    "ConsoleLogger",
    "FileLogger",
    "InMemoryLogger",
    "ProgressBarLogger",
    "TensorboardLogger",
    "WandBLogger",
    "MLFlowLogger",
]
