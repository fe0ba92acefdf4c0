"""Declarative training: a pydantic TrainerConfig (YAML, JSON or a dict) that names everything by registry name.

A recipe names the model, the data, the optimizer and its schedule, the algorithms, callbacks and
loggers, each with its hyperparameters, plus any ``Trainer`` argument::

    model: {name: digits_cnn, num_classes: 10}
    data: {name: digits, batch_size: 32}
    optimizer: {name: adam, lr: 3.0e-3}
    schedule: {name: cosine, warmup: 10%}
    max_duration: 4ep
    algorithms:
      - label_smoothing: {smoothing: 0.1}
      - ema: {half_life: 30ba}
    callbacks: [speed_monitor]

Components are written as a bare name (``ema``), a one-key mapping (``{mixup: {alpha: 0.2}}``) or a
mapping with ``name`` (``{name: mixup, alpha: 0.2}``); anything not registered is reachable as
``package.module:attr``. Every component's hyperparameters are checked against its own typed
``__init__`` (see :func:`composerjax.registry.hparams_model`), and :class:`ConfigError` lists every
problem at once with its field path (``algorithms[2].mixup.alpha``).

The Trainer settings (every field but the sections) are derived from the settings
sections (:mod:`composerjax.trainer.sections`) by :mod:`composerjax.trainer.settings`; reading
files, ``--set`` overrides and the checks beyond field types are in :mod:`composerjax.trainer.recipe`.
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import typing
import weakref
from collections.abc import Sequence
from typing import Annotated, Any

import optax
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit
from composerjax.trainer import recipe, settings
from composerjax.trainer.recipe import OPTIMIZERS, ConfigError
from composerjax.trainer.sections import TrainerSettings

__all__ = [
    "ComponentSpec",
    "ConfigError",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainerConfig",
    "as_config_error",
    "load_config",
    "recipe_arguments_of",
    "to_config",
    "OPTIMIZERS",
    "SCHEDULES",
]

SCHEDULES = ("constant", "cosine", "linear")


class ComponentSpec(BaseModel):
    """One registered component and its hyperparameters: ``{name: mixup, alpha: 0.2}``."""

    model_config = ConfigDict(extra="allow", frozen=False)
    name: str

    @property
    def hparams(self) -> dict[str, Any]:
        """The hyperparameters (every field but ``name``)."""
        return dict(self.model_extra or {})

    def to_dict(self) -> dict[str, Any]:
        """``{'name': ..., **hparams}``."""
        return {"name": self.name, **self.hparams}


class OptimizerConfig(BaseModel):
    """An optax optimizer by name; ``lr`` is the peak learning rate (the schedule scales it).

    Other fields go to the optax function (``weight_decay``, ``b1``, ``momentum``, ``nesterov``...).
    """

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    name: str = "adam"
    lr: float = Field(1e-3, gt=0)

    @property
    def hparams(self) -> dict[str, Any]:
        return dict(self.model_extra or {})


class ScheduleConfig(BaseModel):
    """A learning-rate schedule in Time units: warmup then constant, cosine or linear decay.

    ``warmup`` and ``decay_end`` are Time strings (``'1ep'``, ``'500ba'``, ``'10%'`` of the run);
    ``final_lr_fraction`` is where the decay ends, as a fraction of ``lr``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    name: str = "constant"
    warmup: str | int = "0ba"
    final_lr_fraction: float = Field(0.0, ge=0, le=1)


_SECTIONS: dict[str, Any] = {
    "model": (ComponentSpec, ...),
    "data": (ComponentSpec, ...),
    "optimizer": (OptimizerConfig, Field(default_factory=OptimizerConfig)),
    "schedule": (ScheduleConfig | None, None),
    "algorithms": (list[ComponentSpec], Field(default_factory=list)),
    "callbacks": (list[ComponentSpec], Field(default_factory=list)),
    "loggers": (list[ComponentSpec], Field(default_factory=list)),
}


def _schema() -> type[BaseModel]:
    """The recipe's fields, in the order of the Trainer's arguments: each setting from its declaration, each
    argument a recipe builds from sections (``model``, ``optimizers``, ...) as those sections."""
    arguments = settings.recipe_arguments()
    fields: dict[str, Any] = {}
    for name in settings.trainer_signature().parameters:
        for section in settings.RECIPE_SECTIONS.get(name, ()):
            fields.setdefault(section, _SECTIONS[section])
        if name in arguments:
            argument = arguments[name]
            default = ... if argument.default is settings.REQUIRED else argument.default
            fields[name] = (*_constrained(argument.recipe_type, argument.constraints, default),)
    for section, spec in _SECTIONS.items():
        fields.setdefault(section, spec)
    return pydantic.create_model("TrainerSettings", __config__=ConfigDict(extra="forbid"), __module__=__name__,
                                 __doc__="The recipe's fields, derived from Trainer.__init__.", **fields)


def _constrained(kind: Any, constraints: dict[str, Any], default: Any) -> tuple[Any, Any]:
    """A field's type and ``Field``; a union's number members carry the constraints (``'auto'`` keeps no ``ge``)."""
    members = typing.get_args(kind) if typing.get_origin(kind) is typing.Union else ()
    if not constraints or not members:
        return kind, Field(default, **constraints)
    numbers = (int, float)
    members = tuple(Annotated[member, Field(**constraints)] if member in numbers else member for member in members)
    return typing.Union[members], Field(default)  # noqa: UP007 - built from a tuple


class TrainerConfig(_schema()):
    """Everything a training run needs, by name: validated, serialisable, and buildable into a Trainer.

    The fields are the recipe sections (``model``, ``data``, ``optimizer``, ``schedule``,
    ``algorithms``, ``callbacks``, ``loggers``) and every ``Trainer`` argument with its default,
    derived from ``Trainer.__init__`` (:mod:`composerjax.trainer.settings`): adding an argument to
    the Trainer adds it here.

    Example:
        >>> config = TrainerConfig.from_dict({"model": {"name": "digits_cnn"}, "data": {"name": "digits"},
        ...                                   "max_duration": "1ep", "algorithms": [{"mixup": {"alpha": 0.2}}],
        ...                                   "steps_per_call": 4})
        >>> config.algorithms[0].name, config.algorithms[0].hparams, config.steps_per_call
        ('mixup', {'alpha': 0.2}, 4)
    """

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = None) -> TrainerConfig:
        """Validate a dict; raise :class:`ConfigError` listing every problem (components included)."""
        if not isinstance(values, dict):
            raise ConfigError([f"(top level): expected a mapping of settings, got {type(values).__name__}"], source)
        values = recipe.normalise(values)
        problems: list[str] = []
        try:
            config = cls.model_validate(values)
        except pydantic.ValidationError as error:
            problems += _pydantic_problems(error.errors())
            config = None
        problems += recipe.check_components(values)
        problems += recipe.check_times(values)
        refused = {problem.split(":", 1)[0].split("=", 1)[0].split(".", 1)[0].split("[", 1)[0] for problem in problems}
        problems += recipe.check_settings(values, skip=refused)
        if problems:
            raise ConfigError(problems, source)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> TrainerConfig:
        """Read a YAML or JSON recipe, apply ``key.path=value`` overrides, validate."""
        return load_config(path, overrides)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :meth:`from_dict` accepts (components as ``{name: ..., **hparams}``), in field order."""
        out = self.model_dump(mode="json", exclude=set(_SECTIONS))
        sections: dict[str, Any] = {
            "model": self.model.to_dict(), "data": self.data.to_dict(),
            "optimizer": {"name": self.optimizer.name, "lr": self.optimizer.lr, **self.optimizer.hparams},
            "schedule": None if self.schedule is None else self.schedule.model_dump(mode="json"),
            **{field: [spec.to_dict() for spec in getattr(self, field)]
               for field in ("algorithms", "callbacks", "loggers")}}
        return {name: sections[name] if name in sections else out[name] for name in type(self).model_fields}

    def arguments(self) -> dict[str, Any]:
        """The Trainer arguments this recipe sets directly (every field but the sections), as written."""
        return {name: getattr(self, name) for name in type(self).model_fields if name not in _SECTIONS}

    def to_yaml(self) -> str:
        """The recipe as YAML."""
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# -- reading ---------------------------------------------------------------------------------------
def load_config(source: str | os.PathLike[str] | dict[str, Any], overrides: Sequence[str] = ()) -> TrainerConfig:
    """A TrainerConfig from a YAML/JSON file or a dict, with ``key.path=value`` overrides applied.

    Overrides use dots for mappings and ``[i]`` or ``.i`` for list items; values are parsed as YAML
    (``--set optimizer.lr=0.01 --set algorithms[0].mixup.alpha=0.4 --set max_duration=2ep``).

    Raises:
        ConfigError: listing every problem with its field path.
    """
    name = None
    if isinstance(source, dict):
        values = copy.deepcopy(source)
    else:
        name = os.fspath(source)
        values = recipe.read_recipe(name)
        if not isinstance(values, dict):
            got = "nothing (the file is empty)" if values is None else f"a {type(values).__name__}"
            raise ConfigError([f"(top level): expected a mapping of settings (model:, data:, max_duration:, ...), "
                               f"got {got}"], name)
    if isinstance(values, dict):
        values = recipe.normalise(values)  # components as {name: ..., **hparams}, so override paths have one shape
    problems = []
    for override in overrides:
        # Each on a copy: a bad one leaves nothing half-set, and the rest still apply, so every problem of
        # the overrides and of the recipe they give is listed at once.
        trial = copy.deepcopy(values) if isinstance(values, dict) else values
        try:
            recipe.apply_override(trial, override)
        except ValueError as error:
            problems.append(str(error))
        else:
            values = trial
    if not problems:
        return TrainerConfig.from_dict(values, name)
    try:
        TrainerConfig.from_dict(values, name)
    except ConfigError as error:
        problems += error.problems
    raise ConfigError(problems, name)


def _pydantic_problems(errors: list[Any]) -> list[str]:
    """One line per bad value: a setting's union members (``eval_interval.str``, ``.int``) merged into one."""
    grouped: dict[tuple[Any, ...], list[Any]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        if loc and loc[0] not in _SECTIONS:  # a setting: names after it are union members, not keys
            loc = (loc[0], *[part for part in loc[1:] if isinstance(part, int)])
        grouped.setdefault(loc, []).append(error)
    problems = []
    for loc, group in grouped.items():
        wanted = list(dict.fromkeys(error["msg"].removeprefix("Input should be ") for error in group))
        message = group[0]["msg"] if len(wanted) == 1 else "Input should be " + " or ".join(wanted)
        problems.append(_pydantic_problem({**group[0], "loc": loc, "msg": message}))
    return problems


def _pydantic_problem(error: dict[str, Any]) -> str:
    loc = recipe.loc(error["loc"])
    value = error.get("input")
    shown = f" (got {value!r})"
    if isinstance(value, dict) and len(shown) > 80:  # a whole component: its fields have their own problems
        shown = ""
    hint = ""
    if error.get("type") == "extra_forbidden":  # an unknown setting, at the top level or in a section
        from composerjax.registry import did_you_mean
        from composerjax.trainer.composer_arguments import INSTEAD

        known = _fields_at(error["loc"][:-1])
        name = str(error["loc"][-1])
        if len(error["loc"]) == 1 and name in INSTEAD:  # Composer's Trainer argument: say what to use here
            hint = f"; {name} is Composer's argument; here use {INSTEAD[name].replace('`', '')}"
        elif known:
            hint = did_you_mean(name, known)
    return f"{loc or '(top level)'}: {error['msg']}{shown}{hint}"


def _fields_at(loc: Sequence[Any]) -> list[str]:
    """The field names of the recipe's model at ``loc`` (``()``: the top level; ``('schedule',)``); [] if unknown."""
    model: Any = TrainerConfig
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        members = typing.get_args(field.annotation) if field is not None else ()
        model = next((member for member in (field.annotation if field else None, *members)
                      if isinstance(member, type) and issubclass(member, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


# -- building --------------------------------------------------------------------------------------
def learning_rate(config: TrainerConfig, steps_per_epoch: int | None) -> Any:
    """The optimizer's learning rate: a float, or an optax schedule over optimizer steps."""
    lr = config.optimizer.lr
    schedule = config.schedule
    if schedule is None or (schedule.name == "constant" and _steps(schedule.warmup, config, steps_per_epoch) == 0):
        return lr
    total = _steps(config.max_duration, config, steps_per_epoch, "max_duration")
    warmup = _steps(schedule.warmup, config, steps_per_epoch, "schedule.warmup")
    if warmup > total:
        raise ConfigError([f"schedule.warmup: {schedule.warmup!r} is {warmup} steps, longer than max_duration "
                           f"({total} steps)"])
    end = lr * schedule.final_lr_fraction
    decay = max(total - warmup, 1)
    if schedule.name == "cosine":
        after = optax.cosine_decay_schedule(lr, decay, alpha=schedule.final_lr_fraction)
    elif schedule.name == "linear":
        after = optax.linear_schedule(lr, end, decay)
    elif schedule.name == "constant":
        after = optax.constant_schedule(lr)
    else:
        raise ConfigError([f"schedule.name: unknown schedule {schedule.name!r}; accepted: {', '.join(SCHEDULES)}"])
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, lr, warmup), after], [warmup])


def _steps(value: str | int, config: TrainerConfig, steps_per_epoch: int | None, field: str = "") -> int:
    """A Time string in optimizer steps (batches): '1ep', '500ba', '10%' of max_duration."""
    time = Time.from_input(value, TimeUnit.EPOCH)
    if time.unit == TimeUnit.BATCH:
        return int(time.value)
    if time.unit == TimeUnit.EPOCH:
        if steps_per_epoch is None:
            raise ConfigError([f"{field}: {value!r} is in epochs, but the data loader has no length"])
        return int(time.value) * steps_per_epoch
    if time.unit == TimeUnit.DURATION:
        return int(round(time.value * _steps(config.max_duration, config, steps_per_epoch, "max_duration")))
    raise ConfigError([f"{field}: {value!r}: expected epochs, batches or a percentage of the run for a schedule"])


def build_optimizer(config: TrainerConfig, steps_per_epoch: int | None) -> optax.GradientTransformation:
    """The optax transform the config names, with its schedule and its hyperparameters in its state.

    It is built with ``optax.inject_hyperparams``, so the learning rate (the schedule's value at
    each step) and every float hyperparameter live in the optimizer state, where ``LRMonitor``
    reads them (logged as ``lr-<optimizer name>/group0``, e.g. ``lr-adamw/group0``). Arguments that
    are not floats (``nesterov``, ``min_dim_size_to_factor``, ``mask``...) stay fixed Python values.

    Example:
        >>> config = TrainerConfig.from_dict({"model": {"name": "mlp", "sizes": [64, 10]}, "data": {"name": "digits"},
        ...                                   "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
        ...                                   "max_duration": "1ep"})
        >>> optimizer = build_optimizer(config, steps_per_epoch=10)
        >>> import jax.numpy as jnp
        >>> round(float(optimizer.init(jnp.zeros(2)).hyperparams["learning_rate"]), 6)
        0.1
    """
    from composerjax.optim import name_optimizer

    factory = getattr(optax, config.optimizer.name)
    rate = learning_rate(config, steps_per_epoch)
    arguments = inspect.signature(factory).bind(learning_rate=rate, **config.optimizer.hparams)
    arguments.apply_defaults()
    # inject_hyperparams turns numbers into arrays; an int or a flag the optax function branches on must stay put.
    fixed = [name for name, value in arguments.arguments.items()
             if name != "learning_rate" and not isinstance(value, float)]
    optimizer = optax.inject_hyperparams(factory, static_args=fixed)(learning_rate=rate, **config.optimizer.hparams)
    return name_optimizer(optimizer, config.optimizer.name)


def instantiate(kind: str, spec: ComponentSpec, path: str | None = None) -> Any:
    """Build one component; a ValueError or OverflowError its factory raises is a ConfigError at ``path``.

    Validation checks each hyperparameter's type; the factory's own range checks (``num_classes=1``,
    ``batch_size=0``, a seed too large for JAX) run only here, so they are reported like any other
    recipe problem.
    """
    from composerjax import registry

    factory = registry.resolve(kind, spec.name)
    hparams = registry.hparams_model(factory).model_validate(spec.hparams)
    label = path or {"models": "model", "data": "data"}.get(kind, kind)
    try:
        made = factory(**{key: getattr(hparams, key) for key in spec.hparams})
    except (ValueError, OverflowError) as error:
        text = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
        named = [key for key in spec.hparams if re.search(rf"\b{re.escape(key)}\b", str(error))]
        if named:
            where = f"{label}.{named[0]}"
        elif isinstance(error, OverflowError):  # 'Python int too large': name the big numbers
            big = [key for key, value in spec.hparams.items()
                   if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 2**31]
            where = f"{label}.{big[0]}" if len(big) == 1 else label
            if len(big) == 1:
                text = f"{spec.hparams[big[0]]!r} is too large ({text})"
        else:
            where = label
        raise ConfigError([f"{where}: {text}"]) from None
    if kind in ("algorithms", "callbacks", "loggers"):
        _remember_spec(made, spec.to_dict())  # what the recipe said, for to_config (attributes may hold derived values)
    return made


#: The recipe spec each component built from a config came from, by object id (the object held weakly).
_SPECS: dict[int, tuple[weakref.ref[Any], dict[str, Any]]] = {}


def _remember_spec(obj: Any, spec: dict[str, Any]) -> None:
    """Keep ``obj``'s recipe spec beside it (not on it: nothing is attached to a plugin from outside)."""
    key = id(obj)
    try:
        ref = weakref.ref(obj, lambda _: _SPECS.pop(key, None))
    except TypeError:  # not weak-referenceable: to_config reads its attributes instead
        return
    _SPECS[key] = (ref, spec)


def _spec_of(obj: Any) -> dict[str, Any] | None:
    """The recipe spec ``obj`` was built from, if it was built from a config."""
    found = _SPECS.get(id(obj))
    return dict(found[1]) if found is not None and found[0]() is obj else None


def recipe_arguments_of(config: TrainerConfig | dict[str, Any], *, keep_files: bool = True,
                        **overrides: Any) -> dict[str, Any]:
    """The Trainer's keyword arguments a config describes: its components built, its settings, then ``overrides``.

    With ``keep_files=False`` (``composerjax explain``) data factories are not given the run folder,
    so nothing is written there (a tokenizer is trained in memory only). ``Trainer.from_config``
    (and :func:`~composerjax.trainer.trainer.build_trainer`) builds the Trainer from them.

    Example::

        arguments = recipe_arguments_of(load_config("examples/digits_speedup.yaml"))
        arguments["max_duration"], type(arguments["model"]).__name__
    """
    if not isinstance(config, TrainerConfig):
        config = TrainerConfig.from_dict(config)
    arguments = settings.recipe_to_arguments(config.arguments())  # import paths resolved (validated already)
    arguments.update(overrides)
    model = instantiate("models", config.model)
    splits = instantiate("data", _with_run_dir(config.data, arguments) if keep_files else config.data)
    train, evaluation = (splits.train, splits.eval) if hasattr(splits, "train") else (splits, None)
    _check_language_data(model, train)
    try:
        steps_per_epoch = len(train)
    except TypeError:
        steps_per_epoch = None
    _check_run_length(config, arguments, steps_per_epoch, train)
    optimizer = build_optimizer(config, steps_per_epoch)
    components = {field: [instantiate(field, spec, f"{field}[{index}]") for index, spec in enumerate(specs)]
                  for field, specs in (("algorithms", config.algorithms), ("callbacks", config.callbacks),
                                       ("loggers", config.loggers)) if field not in overrides}
    return {"model": model, "train_dataloader": train, "optimizers": optimizer, "eval_dataloader": evaluation,
            **components, **arguments}


def as_config_error(error: Exception) -> Exception:
    """A Trainer check's error as a recipe problem: ``ConfigError`` when it names a recipe field, else itself.

    The Trainer's argument checks say ``'field=value: ...'`` or ``'field: ...'``: for a recipe field
    that is a recipe problem (exit status 2 on the command line), not a failure.
    """
    if isinstance(error, ConfigError) or not _names_a_setting(str(error)):
        return error
    return ConfigError([str(error)])


def _with_run_dir(spec: ComponentSpec, arguments: dict[str, Any]) -> ComponentSpec:
    """A data factory that takes ``run_dir`` (to keep its tokenizer beside the run) gets the run folder.

    The folder is the Trainer's: ``run_dir``, else ``runs/<run_name>``; a run without a name is
    given its timestamped name here, so the Trainer and the data agree on it.
    """
    import time

    from composerjax import registry

    if "run_dir" in spec.hparams:
        return spec
    factory = registry.resolve("data", spec.name)
    try:
        takes_run_dir = "run_dir" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_run_dir = False
    if not takes_run_dir:
        return spec
    if not arguments.get("run_dir"):
        if not arguments.get("run_name"):
            arguments["run_name"] = time.strftime("run-%Y%m%d-%H%M%S")
        arguments["run_dir"] = os.path.join("runs", arguments["run_name"])
    return ComponentSpec(name=spec.name, **spec.hparams, run_dir=str(arguments["run_dir"]))


def _check_language_data(model: Any, train: Any) -> None:
    """A tokenizer's vocabulary and a sequence length the model can take (a ConfigError naming the field)."""
    tokenizer, seq_len = getattr(train, "tokenizer", None), getattr(train, "seq_len", None)
    config = getattr(getattr(model, "module", None), "config", None)
    if tokenizer is None or config is None:
        return
    problems = []
    vocab = tokenizer.get_vocab_size()
    if getattr(config, "vocab_size", vocab) < vocab:
        problems.append(f"model.vocab_size: {config.vocab_size} is smaller than the data's tokenizer ({vocab} tokens); "
                        f"expected at least {vocab}")
    if seq_len is not None and getattr(config, "n_positions", seq_len) < seq_len:
        problems.append(f"model.n_positions: {config.n_positions} is shorter than data.seq_len={seq_len}; expected "
                        f"at least {seq_len}")
    if problems:
        raise ConfigError(problems)


def _names_a_setting(message: str) -> bool:
    """Whether an error message starts with a TrainerConfig setting: ``'seed=...: '`` or ``'eval_interval: '``."""
    match = re.match(r"([a-z_]+)\s*[=:]", message)
    return match is not None and match.group(1) in TrainerConfig.model_fields and match.group(1) not in (
        "model", "data")


def _check_run_length(config: TrainerConfig, arguments: dict[str, Any], steps_per_epoch: int | None,
                      train: Any) -> None:
    """max_duration ends and fits the step counter, now that the data's length is known (a ConfigError if not)."""
    from composerjax.core.validation import check_run_length
    from composerjax.core.validation import to_time as _to_time

    duration = arguments.get("max_duration", config.max_duration)
    try:
        time = _to_time(duration, "max_duration")
    except ValueError:
        return  # reported by validation, or an override the Trainer reports
    if time is None:
        return
    batches = None
    if time.unit is TimeUnit.BATCH:
        batches = int(time.value)
    elif time.unit is TimeUnit.EPOCH and steps_per_epoch:
        batches = int(time.value) * steps_per_epoch
    elif time.unit is TimeUnit.SAMPLE and getattr(train, "global_batch_size", None):
        batches = -(-int(time.value) // int(train.global_batch_size))
    try:
        check_run_length(time, batches=batches, counts_tokens=arguments.get("tokens_per_batch") is not None,
                         given=duration)
    except ValueError as error:
        if time.unit is TimeUnit.TOKEN:
            error = ValueError(f"{error}. In a recipe: tokens_per_batch: 'package.module:function'")
        raise ConfigError([str(error)]) from None


def to_config(trainer_settings: TrainerSettings, state: State, microbatch_size: int | None) -> TrainerConfig:
    """The config of a trainer: every setting it was given and the hyperparameters its components hold now.

    Settings come from ``trainer_settings`` (what the Trainer was called with, overrides to
    ``build_trainer`` included), written the way a recipe spells them (functions as their
    import paths); ``max_duration``, ``run_name``, ``precision`` and a microbatch size chosen by
    ``'auto'`` are read from the run as they are now. Algorithms, callbacks and loggers are read
    back from the given objects (registry name and the attributes their ``__init__`` arguments are
    stored in); model, data, optimizer and schedule come from the config the trainer was built from.

    Raises:
        ValueError: the trainer was not built from a config, or an argument has no recipe form
            (a lambda ``tokens_per_batch``), naming it.

    Example::

        config = build_trainer(load_config("examples/digits_speedup.yaml")).to_config()
    """
    from composerjax import registry

    base = trainer_settings.run.config
    if base is None:
        raise ValueError("to_config(): this Trainer was not built from a TrainerConfig (use build_trainer); its "
                         "model, data and optimizer have no names to write down")
    values = base.to_dict()
    arguments = trainer_settings.arguments()
    values.update(settings.arguments_to_recipe(arguments, values))
    for field in ("algorithms", "callbacks", "loggers"):
        specs = []
        for obj in settings.as_list(arguments[field]):
            given = _spec_of(obj)
            if given is not None:
                specs.append(given)
                continue
            name = registry.REGISTRIES[field].name_of(type(obj))
            if name is None:
                continue  # unregistered: no name to write down
            fields = registry.hparams_model(type(obj)).model_fields
            hparams = {key: settings.plain(getattr(obj, key)) for key in fields if hasattr(obj, key)}
            specs.append({"name": name, **hparams})
        values[field] = specs
    values["max_duration"] = None if state.max_duration is None else str(state.max_duration)
    values["precision"] = state.precision
    values["run_name"] = state.run_name
    if microbatch_size is not None:  # the size 'auto' chose, once it has
        values["device_train_microbatch_size"] = microbatch_size
    return TrainerConfig.from_dict(values)
