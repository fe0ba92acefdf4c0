"""Loggers: the Logger facade and its destinations."""

from composerjax.loggers.destinations import ConsoleLogger, FileLogger, InMemoryLogger, ProgressBarLogger
from composerjax.loggers.logger import Logger, LoggerDestination

__all__ = ["Logger", "LoggerDestination", "ConsoleLogger", "FileLogger", "InMemoryLogger", "ProgressBarLogger"]
