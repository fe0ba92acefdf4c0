"""Loggers: the Logger facade and its destinations (console, progress bar, TensorBoard, JSONL, in-memory)."""

from composerjax.loggers.console import ConsoleLogger
from composerjax.loggers.file_logger import FileLogger
from composerjax.loggers.in_memory import InMemoryLogger
from composerjax.loggers.logger import Logger, LoggerDestination, is_process_zero
from composerjax.loggers.progress_bar import ProgressBarLogger
from composerjax.loggers.tensorboard import TensorboardLogger

__all__ = [
    "Logger",
    "LoggerDestination",
    "is_process_zero",
    "ConsoleLogger",
    "FileLogger",
    "InMemoryLogger",
    "ProgressBarLogger",
    "TensorboardLogger",
]
