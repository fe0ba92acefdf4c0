"""Moved to :mod:`composerjax.checkpoint.saver`; this module keeps the old import path working."""

from composerjax.checkpoint.saver import *  # noqa: F403
from composerjax.checkpoint.saver import __all__  # noqa: F401
