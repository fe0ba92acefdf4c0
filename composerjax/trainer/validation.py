"""Moved to :mod:`composerjax.core.validation`; this module keeps the old import path working."""

from composerjax.core.validation import *  # noqa: F403
from composerjax.core.validation import __all__  # noqa: F401
