"""Typed settings sections: frozen dataclasses whose fields declare a run's options, validated once.

Each option is declared once, as a field made by :func:`setting`: its type hint, its default, the
text the Trainer's docstring shows for it, the check that refuses a bad value (naming the field, the
value and what is accepted), and how a recipe spells it. A :class:`Section` runs every field's check
when it is built (and again on :meth:`Section.replace`), then its own :meth:`Section.check` for rules
across fields. The Trainer's signature, its docstring's argument list, the recipe schema (so
``--set``), the run's ``hparams`` and ``trainer.to_config()`` are all derived from these fields
(``composerjax.trainer.sections`` and ``composerjax.trainer.settings``).

Example:
    >>> from dataclasses import dataclass
    >>> @dataclass(frozen=True)
    ... class Demo(Section):
    ...     steps: int = setting(3, doc="how many steps", check=positive_int("how many steps"))
    >>> Demo().steps, Demo(steps=5).replace(steps=7).steps
    (3, 7)
    >>> Demo(steps=0)
    Traceback (most recent call last):
    ...
    ValueError: steps=0: expected a positive integer (how many steps)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["REQUIRED", "Section", "flag", "optional_path", "positive_int", "setting", "setting_fields"]


class _Required:
    """The default of a setting that must be given."""

    def __repr__(self) -> str:
        return "REQUIRED"


#: The default of a setting (or recipe field) that has to be given.
REQUIRED: Any = _Required()

Check = Callable[[Any, str], None]


def setting(default: Any = REQUIRED, *, doc: str, check: Check | None = None, recipe: str | None = None,
            recipe_default: Any = dataclasses.MISSING, constraints: dict[str, Any] | None = None,
            positional: bool = False) -> Any:
    """Declare one option: a dataclass field carrying its doc, its check and its recipe spelling.

    Args:
        default: the Trainer's default (:data:`REQUIRED`: none; a list is copied for each section).
        doc: the option's description, shown in the Trainer's docstring (``Args:``).
        check: ``check(value, field)`` raising ``ValueError``/``TypeError`` for a bad value.
        recipe: how a recipe gives it: None (a field of its own, of the type its hint names),
            ``'sections:model,data'`` (built from those recipe sections) or ``'absent:<why>'``.
        recipe_default: the recipe field's default where it is not the Trainer's.
        constraints: pydantic ``Field`` checks on the recipe field (``{'ge': 1}``). A type YAML cannot
            write (a function, by import path) is spelled by ``composerjax.trainer.recipe_forms``.
        positional: the Trainer also takes it by position (``model``, ``train_dataloader``, ...).

    Example:
        >>> setting(10, doc="batches between logs").metadata["doc"]
        'batches between logs'
    """
    metadata = {"doc": doc, "check": check, "recipe": recipe, "recipe_default": recipe_default,
                "constraints": dict(constraints or {}), "positional": positional}
    if default is REQUIRED:
        return dataclasses.field(metadata=metadata)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def setting_fields(section: Any) -> Iterator[dataclasses.Field]:
    """The fields of a section class (or instance) that :func:`setting` declared, in order."""
    return (f for f in dataclasses.fields(section) if "doc" in f.metadata)


def default_of(field: dataclasses.Field) -> Any:
    """A field's default value (:data:`REQUIRED` for none)."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return REQUIRED


class Section:
    """A frozen dataclass of settings: each field's check runs when it is built, then :meth:`check`.

    Subclasses are ``@dataclass(frozen=True)`` with fields made by :func:`setting`.
    """

    def __post_init__(self) -> None:
        for field in setting_fields(self):
            check = field.metadata["check"]
            if check is not None:
                check(getattr(self, field.name), field.name)
        self.check()

    def check(self) -> None:
        """Rules across fields (both ``autoresume`` and ``save_weights_only``, ...); none by default."""

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``, checked again (``section.replace(log_interval=5)``)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def given(self) -> dict[str, Any]:
        """``{field: value}`` of every setting, as given."""
        return {field.name: getattr(self, field.name) for field in setting_fields(self)}


# -- checks shared by the sections ----------------------------------------------------------------
def positive_int(what: str) -> Check:
    """A check: a positive integer (``bool`` refused); ``what`` says what it counts.

    Example:
        >>> positive_int("batches")(0, "log_interval")
        Traceback (most recent call last):
        ...
        ValueError: log_interval=0: expected a positive integer (batches)
    """
    def check(value: Any, field: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{field}={value!r}: expected a positive integer ({what})")
    return check


def flag(value: Any, field: str) -> None:
    """Refuse anything but True or False.

    Example:
        >>> flag("yes", "autoresume")
        Traceback (most recent call last):
        ...
        ValueError: autoresume='yes': expected True or False
    """
    if not isinstance(value, bool):
        raise ValueError(f"{field}={value!r}: expected True or False")


def optional_path(value: Any, field: str) -> None:
    """Refuse anything but a folder path or None."""
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{field}={value!r}: expected a folder path (str) or None")
