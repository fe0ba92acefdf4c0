"""Moved to :mod:`composerjax.checkpoint.checkpointer`; this module keeps the old import path working."""

from composerjax.checkpoint.checkpointer import *  # noqa: F403
from composerjax.checkpoint.checkpointer import __all__  # noqa: F401
