"""A run's settings, declared once in the sections, and what is derived from them for recipes.

Every ``Trainer`` argument is a field of one settings section
(:mod:`composerjax.trainer.sections`), with its type hint, default, doc and check. From those
fields come the recipe schema (:class:`~composerjax.trainer.config.TrainerConfig`'s setting fields,
hence ``--set``), the run's ``hparams`` (:func:`hyperparameters`) and ``trainer.to_config()``. A
field's ``recipe`` metadata says where a recipe differs: built from its own sections (``model``
from ``model:``, ``optimizers`` from ``optimizer:`` and ``schedule:``), absent (with the reason), a
different default or pydantic constraints; :data:`RECIPE_FORMS` spells the types YAML cannot write
(a function as an import path ``'package.module:attr'``, devices by index, a ParallelismConfig as a
mapping). The tables below are read from the fields, never written by hand.

Any other argument becomes a recipe field by itself, with the Trainer's default, as long as its
type hint is made of ``bool``, ``int``, ``float``, ``str``, ``None``, ``Time`` (written as a time
string or an int), ``Literal`` and lists of those. :func:`schema_problems` is the check that the
schema follows the signature; ``tests/trainer/test_settings_schema.py`` runs it.

Example:
    >>> from composerjax.trainer.settings import recipe_arguments
    >>> settings = recipe_arguments()
    >>> settings["steps_per_call"].default, settings["handle_signals"].default
    ('auto', True)
    >>> settings["tokens_per_batch"].recipe_type  # a function, by its import path
    str | None
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import inspect
import os
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from composerjax.core.settings import REQUIRED
from composerjax.core.time import Time, TimeUnit
from composerjax.trainer.recipe_forms import (  # noqa: F401  (re-exported: part of the settings API)
    PARALLELISM_FIELDS,
    RECIPE_FORMS,
    RecipeForm,
    reference_of,
    resolve_reference,
)
from composerjax.trainer.sections import SECTIONS, TrainerSettings

__all__ = ["NOT_IN_RECIPE", "PARALLELISM_FIELDS", "RECIPE_CONSTRAINTS", "RECIPE_DEFAULTS", "RECIPE_FORMS",
           "RECIPE_SECTIONS", "REQUIRED", "RecipeArgument", "RecipeForm", "arguments_to_recipe", "as_list",
           "hyperparameters", "plain", "public_settings", "recipe_arguments", "recipe_to_arguments", "recipe_type",
           "reference_of", "resolve_reference", "schema_problems", "trainer_signature", "versions"]


def _tables() -> tuple[dict[str, tuple[str, ...]], dict[str, str], dict[str, tuple[Any, str]],
                       dict[str, dict[str, Any]]]:
    """RECIPE_SECTIONS, NOT_IN_RECIPE, RECIPE_DEFAULTS and RECIPE_CONSTRAINTS, read from the sections' fields."""
    sections, absent, defaults, constraints = {}, {}, {}, {}
    for name, (_, f) in TrainerSettings.fields().items():
        recipe = f.metadata["recipe"] or ""
        if recipe.startswith("sections:"):
            sections[name] = tuple(recipe[len("sections:"):].split(","))
        elif recipe.startswith("absent:"):
            absent[name] = recipe[len("absent:"):]
        if f.metadata["recipe_default"] is not dataclasses.MISSING:
            defaults[name] = f.metadata["recipe_default"]
        if f.metadata["constraints"]:
            constraints[name] = dict(f.metadata["constraints"])
    return sections, absent, defaults, constraints


#: Trainer arguments a recipe builds from its own sections, and which sections (from the fields' ``recipe``).
#: Trainer arguments a recipe cannot give, and why; recipe fields whose default is not the Trainer's, and why;
#: value checks beyond the type (pydantic ``Field`` arguments), reported at validation with the value.
RECIPE_SECTIONS, NOT_IN_RECIPE, RECIPE_DEFAULTS, RECIPE_CONSTRAINTS = _tables()


# -- the declaration -------------------------------------------------------------------------------
def trainer_signature(init: Callable[..., Any] | None = None) -> inspect.Signature:
    """The signature that declares the settings: the sections' (the Trainer's), or ``init``'s without ``self``.

    Example:
        >>> trainer_signature().parameters["steps_per_call"].default
        'auto'
    """
    if init is None:
        return TrainerSettings.signature()
    signature = inspect.signature(init)
    return signature.replace(parameters=[p for p in signature.parameters.values() if p.name != "self"])


def _hints(init: Callable[..., Any] | None = None) -> dict[str, Any]:
    """The arguments' type hints, each evaluated on its own in the module that declares it.

    A hint naming something its module imports only for type checking is left out; that matters
    only for an argument no table lists, and :func:`schema_problems` reports it.
    """
    base = {"Time": Time, "TimeUnit": TimeUnit, "Any": Any, "Literal": typing.Literal,
            "Callable": collections.abc.Callable, "Iterable": collections.abc.Iterable,
            "Sequence": collections.abc.Sequence}
    if init is not None:
        owners = [(name, annotation, getattr(inspect.unwrap(init), "__globals__", {}))
                  for name, annotation in getattr(init, "__annotations__", {}).items()]
    else:
        import sys

        owners = [(f.name, f.type, vars(sys.modules[kind.__module__]))
                  for kind in SECTIONS.values() for f in dataclasses.fields(kind)]
    hints = {}
    for name, annotation, namespace in owners:
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, {**base, **namespace})  # the declared annotation (PEP 563 strings)
            except Exception:  # a name imported only for type checking: no recipe type
                continue
        hints[name] = annotation
    return hints


def recipe_type(hint: Any) -> Any | None:
    """The type a recipe value of a Trainer argument hinted ``hint`` has; None if it has no YAML form.

    Example:
        >>> recipe_type(Time | str | None)
        typing.Union[str, int, NoneType]
    """
    if hint in (bool, int, float, str, type(None)):
        return hint
    if hint is Time:
        return str | int
    origin = typing.get_origin(hint)
    if origin is typing.Literal:
        return hint
    if origin in (typing.Union, types.UnionType):
        members: list[Any] = []
        for arg in typing.get_args(hint):
            translated = recipe_type(arg)
            if translated is None:
                return None
            for member in typing.get_args(translated) if typing.get_origin(translated) is typing.Union else (
                    translated,):
                if member not in members:
                    members.append(member)
        if all(member is type(None) for member in members):
            return None
        return typing.Union[tuple(members)]  # noqa: UP007 - built from a list
    if origin in (list, collections.abc.Sequence, typing.Sequence) and len(typing.get_args(hint)) == 1:
        item = recipe_type(typing.get_args(hint)[0])
        return None if item is None else list[item]
    return None


def plain(value: Any) -> Any:
    """A setting's value as YAML writes it: Time as its string, tuples as lists, paths as strings.

    Example:
        >>> plain(Time(2, TimeUnit.EPOCH)), plain(("a", 1))
        ('2ep', ['a', 1])
    """
    if isinstance(value, (Time, TimeUnit)):
        return value.to_timestring() if isinstance(value, Time) else value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (tuple, list)):
        return [plain(item) for item in value]
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return value.item()  # a numpy scalar
    return value


@dataclass(frozen=True)
class RecipeArgument:
    """One Trainer argument as a recipe field: its recipe type, default and extra checks."""

    name: str
    recipe_type: Any
    default: Any
    constraints: dict[str, Any] = field(default_factory=dict)
    form: RecipeForm | None = None


def recipe_arguments(init: Callable[..., Any] | None = None) -> dict[str, RecipeArgument]:
    """Every Trainer argument a recipe gives as a field of its own, in signature order.

    Arguments whose type has no recipe form and that no table lists are left out:
    :func:`schema_problems` reports them.

    Example:
        >>> recipe_arguments()["log_interval"]
        RecipeArgument(name='log_interval', recipe_type=<class 'int'>, default=10, constraints={'ge': 1}, form=None)
    """
    return dict(_recipe_arguments(init))


@functools.lru_cache(maxsize=8)
def _recipe_arguments(init: Callable[..., Any] | None) -> dict[str, RecipeArgument]:
    signature = trainer_signature(init)
    hints = _hints(init)
    out: dict[str, RecipeArgument] = {}
    for name, parameter in signature.parameters.items():
        if name in RECIPE_SECTIONS or name in NOT_IN_RECIPE:
            continue
        form = RECIPE_FORMS.get(name)
        kind = form.recipe_type if form is not None else recipe_type(hints.get(name, Any))
        if kind is None:
            continue
        if name in RECIPE_DEFAULTS:
            default = RECIPE_DEFAULTS[name][0]
        else:
            default = REQUIRED if parameter.default is inspect.Parameter.empty else plain(parameter.default)
        out[name] = RecipeArgument(name, kind, default, dict(RECIPE_CONSTRAINTS.get(name, {})), form)
    return out


def schema_problems(signature: inspect.Signature, fields: Mapping[str, Any]) -> list[str]:
    """How a recipe schema (``{field: default}``, :data:`REQUIRED` for none) differs from the Trainer's signature.

    Every parameter must be a recipe field with the same default (or the one :data:`RECIPE_DEFAULTS`
    gives), or be listed in :data:`RECIPE_SECTIONS` or :data:`NOT_IN_RECIPE`; every field must be
    a parameter or a recipe-only section; every table entry must name a parameter.

    Example:
        >>> import inspect
        >>> def init(self, model, train_dataloader=None, *, seed: int = 0, new_setting: int = 3): ...
        >>> print(schema_problems(inspect.signature(init), {"model": REQUIRED, "data": REQUIRED, "seed": 0})[0])
        ... # doctest: +ELLIPSIS
        new_setting: a Trainer argument (default 3) that is not a recipe field; ...
    """
    parameters = {name: p for name, p in signature.parameters.items() if name != "self"}
    problems = []
    for name, parameter in parameters.items():
        if name in NOT_IN_RECIPE:
            if name in fields:
                problems.append(f"{name}: listed in NOT_IN_RECIPE ({NOT_IN_RECIPE[name]}) but also a recipe field")
            continue
        if name in RECIPE_SECTIONS:
            missing = [section for section in RECIPE_SECTIONS[name] if section not in fields]
            if missing:
                problems.append(f"{name}: built from the recipe section(s) {missing}, which the schema lacks")
            continue
        default = REQUIRED if parameter.default is inspect.Parameter.empty else plain(parameter.default)
        expected = RECIPE_DEFAULTS[name][0] if name in RECIPE_DEFAULTS else default
        if name not in fields:
            problems.append(f"{name}: a Trainer argument (default {default!r}) that is not a recipe field; derive the "
                            f"schema from this signature (recipe_arguments), and if its type ({parameter.annotation}) "
                            "has no YAML form, add it to RECIPE_FORMS in composerjax/trainer/settings.py (or to "
                            "NOT_IN_RECIPE, with the reason)")
        elif fields[name] != expected and not (fields[name] is REQUIRED and expected is REQUIRED):
            problems.append(f"{name}: the recipe default is {fields[name]!r}, the Trainer's is {default!r}")
    sections = {section for names in RECIPE_SECTIONS.values() for section in names}
    for name in fields:
        if name not in parameters and name not in sections:
            problems.append(f"{name}: a recipe field that is no Trainer argument nor a recipe section")
    for table, names in (("RECIPE_SECTIONS", RECIPE_SECTIONS), ("RECIPE_FORMS", RECIPE_FORMS),
                         ("RECIPE_DEFAULTS", RECIPE_DEFAULTS), ("RECIPE_CONSTRAINTS", RECIPE_CONSTRAINTS),
                         ("NOT_IN_RECIPE", NOT_IN_RECIPE)):
        problems += [f"{name}: listed in {table} but not a Trainer argument" for name in names
                     if name not in parameters]
    return problems


# -- recipe <-> Trainer arguments ------------------------------------------------------------------
def recipe_to_arguments(values: Mapping[str, Any]) -> dict[str, Any]:
    """Trainer keyword arguments from a recipe's setting fields (import paths resolved, mappings built).

    Example:
        >>> recipe_to_arguments({"tokens_per_batch": "builtins:len", "steps_per_call": 4})
        {'tokens_per_batch': <built-in function len>, 'steps_per_call': 4}
    """
    settings = recipe_arguments()
    return {name: settings[name].form.build(value) if settings[name].form is not None else value
            for name, value in values.items() if name in settings}


def arguments_to_recipe(arguments: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """A recipe's setting fields from Trainer arguments; ``given`` is the recipe they came from (its spellings).

    Raises:
        ValueError: an argument with no recipe form (a lambda, jax.Device objects), naming it.

    Example:
        >>> arguments_to_recipe({"tokens_per_batch": len, "save_interval": Time(3, TimeUnit.BATCH)}, {})
        {'tokens_per_batch': 'builtins:len', 'save_interval': '3ba'}
    """
    out = {}
    for name, setting in recipe_arguments().items():
        if name not in arguments:
            continue
        value, mine = arguments[name], given.get(name)
        out[name] = setting.form.write(value, mine) if setting.form is not None else plain(value)
    return out


# -- hparams ---------------------------------------------------------------------------------------
def hyperparameters(settings: TrainerSettings, state: Any, runner: Any, destinations: Sequence[Any],
                    mesh: Any) -> dict[str, Any]:
    """The run's settings as JSON-able values: saved with every checkpoint and logged at FIT_START.

    Read from ``settings`` (what the Trainer was given) and, for what the Trainer resolves (run
    name, mesh, memory budget, microbatch size, loggers), the state, the step runner and the mesh.

    Example::

        trainer.hparams = hyperparameters(settings, state, runner, logger.destinations, mesh)   # after INIT
    """
    import jax

    run, step, evaluation, checkpoint = settings.run, settings.step, settings.evaluation, settings.checkpoint
    eval_interval = evaluation.eval_interval
    if eval_interval is None and evaluation.eval_dataloader is not None:
        eval_interval = "1ep"
    parallelism = run.parallelism
    callbacks = as_list(run.callbacks)  # not the ones the Trainer installs itself
    time_limit = settings.stopping.time_limit
    return {
        "run_name": state.run_name,
        "max_duration": None if state.max_duration is None else str(state.max_duration),
        "seed": int(run.seed),
        "precision": state.precision,
        "optimizer": _describe(state.optimizer),
        "algorithms": [{"name": type(a).__name__, "hparams": public_settings(a)} for a in state.algorithms],
        "callbacks": [{"name": type(c).__name__, "hparams": public_settings(c)} for c in callbacks],
        "loggers": [type(d).__name__ for d in destinations],
        "device_train_microbatch_size": ("auto" if step.device_train_microbatch_size == "auto"
                                         else runner.microbatch_size),
        "accumulate_train_batch_on_tokens": step.accumulate_train_batch_on_tokens,
        "device_memory_budget": runner.device_memory_budget,
        "log_interval": run.log_interval,
        "parallelism": parallelism if isinstance(parallelism, str) else repr(parallelism),
        "mesh": dict(mesh.shape),
        "devices": int(mesh.devices.size),
        "processes": jax.process_count(),
        "eval_interval": (None if eval_interval is None else getattr(eval_interval, "__name__", repr(eval_interval))
                          if callable(eval_interval) and not isinstance(eval_interval, (str, Time))
                          else str(Time.from_input(eval_interval, TimeUnit.EPOCH))),
        "save_interval": str(checkpoint.save_interval),
        "save_weights_only": checkpoint.save_weights_only,
        "time_limit": None if time_limit is None else str(time_limit),
        "skip_nonfinite_updates": state.skip_nonfinite_updates,
        "dataloader_len": state.dataloader_len,
        "versions": versions(),
    }


def as_list(items: Any) -> list[Any]:
    """A plugin argument (``algorithms``, ``callbacks``, ``loggers``) as a list: None, one plugin or a sequence."""
    if items is None:
        return []
    return list(items) if isinstance(items, (list, tuple)) else [items]


def _describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def public_settings(plugin: Any) -> dict[str, Any]:
    """A plugin's public scalar settings (its hyperparameters, as far as they are JSON values).

    Example:
        >>> from composerjax.algorithms import MixUp
        >>> public_settings(MixUp(alpha=0.3))["alpha"]
        0.3
    """
    settings = {}
    for name, value in vars(plugin).items():
        if name.startswith("_"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            settings[name] = value
        elif isinstance(value, (Time, TimeUnit)):
            settings[name] = str(value)
        elif isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float, str)) for v in value):
            settings[name] = list(value)
    return settings


def versions() -> dict[str, str]:
    """The versions of composerjax and the libraries a run depends on.

    Example:
        >>> sorted(versions())
        ['composerjax', 'flax', 'jax', 'optax', 'orbax-checkpoint']
    """
    import flax
    import jax
    import optax
    import orbax.checkpoint

    from composerjax._version import __version__

    return {"composerjax": __version__, "jax": jax.__version__, "flax": flax.__version__, "optax": optax.__version__,
            "orbax-checkpoint": getattr(orbax.checkpoint, "__version__", "unknown")}
