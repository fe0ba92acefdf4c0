"""The destinations, under the module name the trainer imports them from; prefer ``composerjax.loggers``."""

from composerjax.loggers.console import ConsoleLogger
from composerjax.loggers.file_logger import FileLogger
from composerjax.loggers.in_memory import InMemoryLogger
from composerjax.loggers.progress_bar import ProgressBarLogger
from composerjax.loggers.tensorboard import TensorboardLogger

__all__ = ["ConsoleLogger", "FileLogger", "InMemoryLogger", "ProgressBarLogger", "TensorboardLogger"]
