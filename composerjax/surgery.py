"""Moved to :mod:`composerjax.models.surgery`; this module keeps the old import path working.

Example:
    >>> from composerjax.surgery import replace_modules
    >>> from composerjax.models import surgery
    >>> replace_modules is surgery.replace_modules
    True
"""

from composerjax.models.surgery import ModuleFactory, count_modules, replace_modules

__all__ = ["ModuleFactory", "count_modules", "replace_modules"]
