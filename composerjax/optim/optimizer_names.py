"""The name an optimizer is logged under (``lr-<name>/group0``): given, or read from ``optax.inject_hyperparams``.

Composer logs ``lr-<optimizer class>/group<i>``. An optax optimizer is a pair of functions with no
class, so its name is, in order: the name given with :func:`name_optimizer` (composerjax's
``DecoupledAdamW``/``DecoupledSGDW`` and recipe-built optimizers name themselves, and
:func:`~composerjax.optim.with_schedule` keeps the name of what it wraps); the factory's function
name for ``optax.inject_hyperparams(factory)(...)`` (``adam``); else ``optimizer``.

Example:
    >>> import optax
    >>> optimizer_name(optax.inject_hyperparams(optax.adam)(learning_rate=0.1))
    'adam'
    >>> optimizer_name(name_optimizer(optax.sgd(0.1), 'sgd')), optimizer_name(optax.sgd(0.1))
    ('sgd', 'optimizer')
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["name_optimizer", "optimizer_name"]

_ATTRIBUTE = "composerjax_name"
Optimizer = TypeVar("Optimizer")


def name_optimizer(optimizer: Optimizer, name: str) -> Optimizer:
    """Give ``optimizer`` (an optax ``GradientTransformation``) the name its learning rate is logged under."""
    try:
        setattr(optimizer, _ATTRIBUTE, name)
    except AttributeError:  # a transformation type without instance attributes: fall back to the default rule
        pass
    return optimizer


def optimizer_name(optimizer: Any) -> str:
    """The name ``optimizer`` is logged under: given, its ``inject_hyperparams`` factory's, or ``'optimizer'``."""
    given = getattr(optimizer, _ATTRIBUTE, None)
    if isinstance(given, str):
        return given
    factory = _closure_value(getattr(optimizer, "init", None), "inner_factory")
    name = getattr(factory, "__name__", None)
    return name if isinstance(name, str) else "optimizer"


def _closure_value(function: Any, variable: str) -> Any:
    """The value ``function`` closes over under ``variable`` (how inject_hyperparams keeps its factory), or None."""
    code, closure = getattr(function, "__code__", None), getattr(function, "__closure__", None)
    if code is None or closure is None or variable not in code.co_freevars:
        return None
    try:
        return closure[code.co_freevars.index(variable)].cell_contents
    except (IndexError, ValueError):
        return None
