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
"""

from __future__ import annotations

import copy
import inspect
import json
import math
import os
import re
from collections.abc import Sequence
from typing import Any

import optax
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from composerjax.core.time import Time, TimeUnit

__all__ = [
    "ComponentSpec",
    "ConfigError",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainerConfig",
    "build_trainer",
    "load_config",
    "OPTIMIZERS",
    "SCHEDULES",
]

OPTIMIZERS = ("adam", "adamw", "sgd", "lamb", "lion", "rmsprop", "adafactor", "adagrad", "nadam")
SCHEDULES = ("constant", "cosine", "linear")


class ConfigError(ValueError):
    """A recipe with problems; ``problems`` lists each as ``'field.path: what is wrong'``."""

    def __init__(self, problems: Sequence[str], source: str | None = None) -> None:
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")


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


class TrainerConfig(BaseModel):
    """Everything a training run needs, by name: validated, serialisable, and buildable into a Trainer.

    Example:
        >>> config = TrainerConfig.from_dict({"model": {"name": "digits_cnn"}, "data": {"name": "digits"},
        ...                                   "max_duration": "1ep", "algorithms": [{"mixup": {"alpha": 0.2}}]})
        >>> config.algorithms[0].name, config.algorithms[0].hparams
        ('mixup', {'alpha': 0.2})
    """

    model_config = ConfigDict(extra="forbid")

    model: ComponentSpec
    data: ComponentSpec
    max_duration: str | int
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig | None = None
    algorithms: list[ComponentSpec] = Field(default_factory=list)
    callbacks: list[ComponentSpec] = Field(default_factory=list)
    loggers: list[ComponentSpec] = Field(default_factory=list)
    eval_interval: str | int | None = None
    device_train_microbatch_size: int | str | None = None
    device_memory_budget: int | None = Field(None, ge=1)
    precision: str = "fp32"
    seed: int = 0
    run_name: str | None = None
    run_dir: str | None = None
    progress_bar: bool = True
    log_interval: int = Field(10, ge=1)
    run_summary: bool = True
    devices: str | int | list[int] = "auto"
    accelerator: str = "auto"
    parallelism: str = "auto"
    save_folder: str | None = None
    save_interval: str | int = "1ep"
    save_num_checkpoints_to_keep: int = -1
    save_weights_only: bool = False
    save_overwrite: bool = False
    load_path: str | None = None
    load_weights_only: bool = False
    autoresume: bool = False
    time_limit: str | None = None
    skip_nonfinite_updates: bool = False

    @classmethod
    def from_dict(cls, values: dict[str, Any], source: str | None = None) -> TrainerConfig:
        """Validate a dict; raise :class:`ConfigError` listing every problem (components included)."""
        if not isinstance(values, dict):
            raise ConfigError([f"(top level): expected a mapping of settings, got {type(values).__name__}"], source)
        values = _normalise(values)
        problems: list[str] = []
        try:
            config = cls.model_validate(values)
        except pydantic.ValidationError as error:
            problems += [_pydantic_problem(e) for e in error.errors()]
            config = None
        problems += _check_components(values)
        problems += _check_times(values)
        problems += _check_settings(values)
        if problems:
            raise ConfigError(problems, source)
        return config

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], overrides: Sequence[str] = ()) -> TrainerConfig:
        """Read a YAML or JSON recipe, apply ``key.path=value`` overrides, validate."""
        return load_config(path, overrides)

    def to_dict(self) -> dict[str, Any]:
        """A plain dict that :meth:`from_dict` accepts (components as ``{name: ..., **hparams}``)."""
        out = self.model_dump(exclude={"model", "data", "algorithms", "callbacks", "loggers", "optimizer"})
        out["model"] = self.model.to_dict()
        out["data"] = self.data.to_dict()
        out["optimizer"] = {"name": self.optimizer.name, "lr": self.optimizer.lr, **self.optimizer.hparams}
        for field in ("algorithms", "callbacks", "loggers"):
            out[field] = [spec.to_dict() for spec in getattr(self, field)]
        return out

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
        values = _read(name)
        if not isinstance(values, dict):
            got = "nothing (the file is empty)" if values is None else f"a {type(values).__name__}"
            raise ConfigError([f"(top level): expected a mapping of settings (model:, data:, max_duration:, ...), "
                               f"got {got}"], name)
    if isinstance(values, dict):
        values = _normalise(values)  # components as {name: ..., **hparams}, so override paths have one shape
    problems = []
    for override in overrides:
        try:
            _apply_override(values, override)
        except ValueError as error:
            problems.append(str(error))
    if problems:
        raise ConfigError(problems, name)
    return TrainerConfig.from_dict(values, name)


def _read(path: str) -> Any:
    """The parsed contents of a recipe file; every way it can be unreadable is a ConfigError."""
    import yaml

    kind = "JSON" if path.endswith(".json") else "YAML"
    if os.path.isdir(path):
        raise ConfigError([f"(file): {path!r} is a directory; expected a YAML or JSON recipe file"])
    if not os.path.exists(path):
        raise ConfigError([f"(file): {path!r} does not exist; expected a YAML or JSON recipe"])
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except UnicodeDecodeError as error:
        byte = error.object[error.start]
        raise ConfigError([f"(file): {path!r} is not a text file (byte {error.start} is {byte:#04x}, not UTF-8); "
                           "expected a YAML or JSON recipe"]) from None
    except OSError as error:
        raise ConfigError([f"(file): cannot read {path!r}: {error.strerror or error}"]) from None
    try:
        if kind == "JSON":
            return json.loads(text)
        return yaml.safe_load(text)
    except json.JSONDecodeError as error:
        raise ConfigError([f"(file): {path} is not valid JSON: {error.msg} (line {error.lineno}, column "
                           f"{error.colno})"]) from None
    except yaml.YAMLError as error:
        raise ConfigError([f"(file): {path} is not valid {kind}: {_yaml_problem(error)}"]) from None


def _yaml_problem(error: Exception) -> str:
    """A YAML parse error on one line: what was wrong, and where."""
    problem = getattr(error, "problem", None)
    if not problem:
        return " ".join(str(error).split())
    mark = getattr(error, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    context = getattr(error, "context", None)
    return f"{problem}{where}" + (f", {context}" if context else "")


def _split_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for chunk in path.replace("]", "").replace("[", ".").split("."):
        if chunk == "":
            raise ValueError(f"--set {path}: an empty key in the path")
        parts.append(int(chunk) if chunk.isdigit() else chunk)
    return parts


def _skip_component_names(values: Any, keys: list[str | int]) -> list[str | int]:
    """``algorithms[0].mixup.alpha`` -> ``algorithms[0].alpha``: the name in a path is the component's own."""
    from composerjax.registry import normalize_name

    out: list[str | int] = []
    node = values
    for key in keys:
        if (isinstance(node, dict) and isinstance(key, str) and key not in node and "name" in node
                and normalize_name(key) == normalize_name(str(node["name"]))):
            continue
        out.append(key)
        if isinstance(node, dict):
            node = node.get(key)
        elif isinstance(node, list) and isinstance(key, int) and key < len(node):
            node = node[key]
        else:
            node = None
    return out


def _apply_override(values: dict[str, Any], override: str) -> None:
    """Set one ``key.path=value`` in ``values``; any problem is a ValueError naming the path and value."""
    import yaml

    if "=" not in override or not override.split("=", 1)[0].strip():
        raise ValueError(f"--set {override!r}: expected key.path=value")
    path, raw = override.split("=", 1)
    path = path.strip()
    keys = _split_path(path)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as error:
        raise ValueError(f"--set {path}={raw}: the value is not valid YAML ({_yaml_problem(error)}); quote it to pass "
                         "a string, e.g. --set 'key=\"text\"'") from None
    keys = _skip_component_names(values, keys)
    node: Any = values
    for depth, key in enumerate(keys[:-1]):
        nxt = keys[depth + 1]
        if isinstance(node, list):
            if not isinstance(key, int) or key >= len(node):
                raise ValueError(f"--set {path}: {_path_text(keys[:depth])} has {len(node)} items; "
                                 f"no item {key}")
            node = node[key]
        else:
            _check_key(node, key, keys[:depth], path)
            if key not in node or node[key] is None:
                node[key] = [] if isinstance(nxt, int) else {}
            node = node[key]
        if isinstance(node, str) and not isinstance(nxt, int):  # `- ema` written as a bare name
            raise ValueError(f"--set {path}: {key} is the bare name {node!r}; write it as {{{node}: {{}}}} first")
        if not isinstance(node, (dict, list)):
            here = _path_text(keys[: depth + 1])
            kind = type(node).__name__
            raise ValueError(f"--set {path}: {here} is {node!r} ({'an' if kind[0] in 'aeiou' else 'a'} {kind}), not a "
                             f"mapping or a list, so it has no {nxt!r} inside; set {here} itself (--set {here}=VALUE)")
    last = keys[-1]
    if isinstance(node, list):
        if not isinstance(last, int) or last > len(node):
            raise ValueError(f"--set {path}: no item {last} in a list of {len(node)}")
        if last == len(node):
            node.append(value)
        else:
            node[last] = value
    else:
        _check_key(node, last, keys[:-1], path)
        node[last] = value


def _check_key(node: dict[str, Any], key: str | int, parents: Sequence[str | int], path: str) -> None:
    """A list index ``[i]`` into a mapping is a typo for a name (``model[0]``): refuse it."""
    if isinstance(key, int) and key not in node:
        here = _path_text(parents)
        raise ValueError(f"--set {path}: {here} is a mapping, so it has no item [{key}]; name the key instead "
                         f"(e.g. {'' if not parents else here + '.'}name)")


def _path_text(keys: Sequence[str | int]) -> str:
    """``['algorithms', 0, 'alpha']`` -> ``'algorithms[0].alpha'``; ``(top level)`` for none."""
    return _loc(keys) or "(top level)"


def _normalise(values: dict[str, Any]) -> dict[str, Any]:
    """Component lists and the optimizer/schedule in their canonical ``{name: ..., **hparams}`` form."""
    values = dict(values)
    for field in ("model", "data"):
        if isinstance(values.get(field), str):
            values[field] = {"name": values[field]}
    for field in ("algorithms", "callbacks", "loggers"):
        items = values.get(field)
        if items is None:
            values[field] = []
        elif isinstance(items, list):
            values[field] = [_component(item) for item in items]
    for field in ("optimizer", "schedule"):
        if isinstance(values.get(field), str):
            values[field] = {"name": values[field]}
    return values


def _component(item: Any) -> Any:
    if isinstance(item, str):
        return {"name": item}
    if isinstance(item, dict) and "name" not in item and len(item) == 1:
        (name, hparams), = item.items()
        if hparams is None:
            hparams = {}
        if isinstance(hparams, dict):
            return {"name": name, **hparams}
    return item


def _loc(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _pydantic_problem(error: dict[str, Any]) -> str:
    loc = _loc(error["loc"])
    value = error.get("input")
    shown = f" (got {value!r})"
    if isinstance(value, dict) and len(shown) > 80:  # a whole component: its fields have their own problems
        shown = ""
    hint = ""
    if error.get("type") == "extra_forbidden" and len(error["loc"]) == 1:  # an unknown top-level setting
        import difflib

        known = list(TrainerConfig.model_fields)
        close = difflib.get_close_matches(str(error["loc"][0]), known, n=3)
        hint = (f"; did you mean {', '.join(map(repr, close))}?" if close
                else f"; accepted: {', '.join(known)}")
    return f"{loc or '(top level)'}: {error['msg']}{shown}{hint}"


def _check_components(values: dict[str, Any]) -> list[str]:
    """Resolve every named component and validate its hyperparameters; one problem per mistake."""
    from composerjax import registry

    problems = []
    checks: list[tuple[str, str, Any]] = []
    for field, kind in (("model", "models"), ("data", "data")):
        if isinstance(values.get(field), dict):
            checks.append((field, kind, values[field]))
    for field in ("algorithms", "callbacks", "loggers"):
        for index, item in enumerate(values.get(field) or []):
            if isinstance(item, dict):
                checks.append((f"{field}[{index}]", field, item))
    for path, kind, spec in checks:
        name = spec.get("name")
        if not isinstance(name, str):
            continue  # pydantic reports it
        try:
            factory = registry.resolve(kind, name)
        except (ValueError, LookupError, ImportError) as error:
            problems.append(f"{path}.name: {error}")
            continue
        hparams = {key: value for key, value in spec.items() if key != "name"}
        label = path if kind in ("models", "data") else f"{path}.{name}"
        try:
            validated = registry.hparams_model(factory).model_validate(hparams)
        except pydantic.ValidationError as error:
            for item in error.errors():
                value = item.get("input")
                got = "" if isinstance(value, dict) else f" (got {value!r})"
                problems.append(f"{label}.{_loc(item['loc'])}: {item['msg']}{got}")
            continue
        if kind in ("algorithms", "callbacks"):
            # Their own checks (ranges, combinations) run in __init__, which is cheap and has no side effects.
            try:
                factory(**{key: getattr(validated, key) for key in hparams})
            except (ValueError, TypeError) as error:
                # Point at the hyperparameter the message names, if it names one.
                named = [key for key in hparams if re.search(rf"\b{re.escape(key)}\b", str(error))]
                problems.append(f"{label}{'.' + named[0] if named else ''}: {error}")
    optimizer = values.get("optimizer")
    if isinstance(optimizer, dict):
        problems += _check_optimizer(optimizer)
    return problems


def _check_times(values: dict[str, Any]) -> list[str]:
    """Every time string in the recipe parses: run lengths and intervals, the schedule, the time limit."""
    from composerjax.core.state import as_max_duration
    from composerjax.trainer.trainer import _to_time, _to_time_limit
    from composerjax.trainer.validation import check_interval, check_run_length

    problems = []
    for field in ("max_duration", "eval_interval", "save_interval"):
        value = values.get(field)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                time = _to_time(value, field)
                if field == "max_duration":
                    as_max_duration(time)
            except ValueError as error:
                message = str(error)  # 'field: ...' or 'field=value: ...'
                if not message.startswith(f"{field}:"):
                    message = f"{field}: {message.split(': ', 1)[-1]}"
                problems.append(message)
                continue
            try:  # 'field=value: ...' messages, as the Trainer gives them
                if field == "max_duration":
                    # 'ep' and 'sp' runs are counted in batches once the data is known (build_trainer).
                    check_run_length(time, batches=time.value if time.unit is TimeUnit.BATCH else None,
                                     counts_tokens=True, given=value)
                else:
                    check_interval(time, field, given=value)
            except ValueError as error:
                problems.append(str(error))
    schedule = values.get("schedule")
    for field in ("warmup", "decay_end"):
        value = schedule.get(field) if isinstance(schedule, dict) else None
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                unit = Time.from_input(value, TimeUnit.EPOCH).unit
            except ValueError as error:
                problems.append(f"schedule.{field}: {value!r}: {error}")
                continue
            if unit not in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.DURATION):
                problems.append(f"schedule.{field}: {value!r}: expected epochs, batches or a percentage of the run "
                                "('1ep', '500ba', '10%')")
    if values.get("time_limit") is not None:
        try:
            _to_time_limit(values["time_limit"])
        except ValueError as error:
            problems.append(f"time_limit: {str(error).split(': ', 1)[-1]}")
    return problems


def _check_settings(values: dict[str, Any]) -> list[str]:
    """The Trainer's own checks of plain settings, run at validation so a recipe lists them all at once.

    Only values of the right type are checked here: pydantic already reports the others.
    """
    from composerjax.parallel.strategy import resolve_parallelism
    from composerjax.step.precision import compute_dtype
    from composerjax.trainer.validation import check_seed

    problems = []
    seed = values.get("seed")
    if isinstance(seed, int):  # bool included: True is not a seed
        try:
            check_seed(seed)
        except ValueError as error:
            problems.append(str(error))  # 'seed=...: expected ...'
    keep = values.get("save_num_checkpoints_to_keep")
    if isinstance(keep, int) and not isinstance(keep, bool) and keep < 1 and keep != -1:
        problems.append(f"save_num_checkpoints_to_keep: expected a positive integer, or -1 to keep all (got {keep!r})")
    micro = values.get("device_train_microbatch_size")
    if (isinstance(micro, int) and not isinstance(micro, bool) and micro < 1) or (
            isinstance(micro, str) and micro != "auto"):
        problems.append(f"device_train_microbatch_size: expected a positive integer, 'auto' or null (got {micro!r})")
    for field, check in (("precision", compute_dtype), ("parallelism", resolve_parallelism)):
        value = values.get(field)
        if isinstance(value, str):
            try:
                check(value)
            except ValueError as error:
                problems.append(str(error))  # 'field=...: expected ...'
    return problems


def _check_optimizer(optimizer: dict[str, Any]) -> list[str]:
    name = optimizer.get("name", "adam")
    if name not in OPTIMIZERS:
        import difflib

        close = difflib.get_close_matches(str(name), OPTIMIZERS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return [f"optimizer.name: unknown optimizer {name!r}{hint} Accepted: {', '.join(OPTIMIZERS)}"]
    accepted = set(inspect.signature(getattr(optax, name)).parameters) - {"learning_rate"}
    problems = [f"optimizer.{key}: optax.{name} has no argument {key!r}; accepted: {', '.join(sorted(accepted))}"
                for key in optimizer if key not in ("name", "lr") and key not in accepted]
    # Extra arguments go to optax untyped: a NaN or infinite one would make every update NaN, silently.
    problems += [f"optimizer.{key}: expected a finite number (got {value!r})" for key, value in optimizer.items()
                 if key in accepted and isinstance(value, float) and not math.isfinite(value)]
    return problems


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
    """The optax transform the config names, with its schedule."""
    factory = getattr(optax, config.optimizer.name)
    return factory(learning_rate(config, steps_per_epoch), **config.optimizer.hparams)


def _instantiate(kind: str, spec: ComponentSpec, path: str | None = None) -> Any:
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
        try:  # what the recipe said, for to_config (attributes may hold derived values)
            made._config_spec = spec.to_dict()
        except AttributeError:
            pass
    return made


def build_trainer(config: TrainerConfig | dict[str, Any], **overrides: Any) -> Any:
    """Build the Trainer a config describes (INIT runs; nothing trains yet).

    The trainer keeps the config as ``trainer.config``; ``trainer.to_config()`` rebuilds it from the
    trainer's own objects.

    Example::

        trainer = build_trainer(load_config("examples/digits_speedup.yaml"))
        trainer.fit()
    """
    from composerjax.trainer.trainer import Trainer

    if not isinstance(config, TrainerConfig):
        config = TrainerConfig.from_dict(config)
    model = _instantiate("models", config.model)
    splits = _instantiate("data", config.data)
    train, evaluation = (splits.train, splits.eval) if hasattr(splits, "train") else (splits, None)
    try:
        steps_per_epoch = len(train)
    except TypeError:
        steps_per_epoch = None
    arguments = config.model_dump(exclude={"model", "data", "optimizer", "schedule", "algorithms", "callbacks",
                                           "loggers"})
    arguments.update(overrides)
    _check_run_length(config, arguments, steps_per_epoch, train)
    optimizer = build_optimizer(config, steps_per_epoch)
    components = {field: [_instantiate(field, spec, f"{field}[{index}]") for index, spec in enumerate(specs)]
                  for field, specs in (("algorithms", config.algorithms), ("callbacks", config.callbacks),
                                       ("loggers", config.loggers))}
    try:
        trainer = Trainer(model, train, optimizers=optimizer, eval_dataloader=evaluation, **components, **arguments)
    except (ValueError, FileNotFoundError) as error:
        # The Trainer's argument checks say 'field=value: ...' or 'field: ...': for a recipe field that
        # is a recipe problem (exit status 2 on the command line), not a failure.
        if isinstance(error, ConfigError) or not _names_a_setting(str(error)):
            raise
        raise ConfigError([str(error)]) from None
    trainer.config = config
    return trainer


def _names_a_setting(message: str) -> bool:
    """Whether an error message starts with a TrainerConfig setting: ``'seed=...: '`` or ``'eval_interval: '``."""
    match = re.match(r"([a-z_]+)\s*[=:]", message)
    return match is not None and match.group(1) in TrainerConfig.model_fields and match.group(1) not in (
        "model", "data")


def _check_run_length(config: TrainerConfig, arguments: dict[str, Any], steps_per_epoch: int | None,
                      train: Any) -> None:
    """max_duration ends and fits the step counter, now that the data's length is known (a ConfigError if not)."""
    from composerjax.trainer.trainer import _to_time
    from composerjax.trainer.validation import check_run_length

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
            error = ValueError(f"{error}. A recipe has no tokens_per_batch setting: build the trainer in Python "
                               "with build_trainer(config, tokens_per_batch=fn)")
        raise ConfigError([str(error)]) from None


def trainer_to_config(trainer: Any) -> TrainerConfig:
    """The config of a trainer: its settings and the hyperparameters its components hold now.

    Algorithms, callbacks and loggers are read back from the objects (registry name and the
    attributes their ``__init__`` arguments are stored in); model, data, optimizer and schedule come
    from the config the trainer was built from.
    """
    from composerjax import registry

    base = getattr(trainer, "config", None)
    if base is None:
        raise ValueError("to_config(): this Trainer was not built from a TrainerConfig (use build_trainer); its "
                         "model, data and optimizer have no names to write down")
    values = base.to_dict()
    for field, objects in (("algorithms", trainer.state.algorithms), ("callbacks", trainer.state.callbacks),
                           ("loggers", getattr(trainer, "_given_loggers", []))):
        specs = []
        for obj in objects:
            given = getattr(obj, "_config_spec", None)
            if given is not None:
                specs.append(dict(given))
                continue
            name = registry.REGISTRIES[field].name_of(type(obj))
            if name is None:
                continue  # added by the trainer itself (the progress bar) or unregistered
            fields = registry.hparams_model(type(obj)).model_fields
            hparams = {key: _plain(getattr(obj, key)) for key in fields if hasattr(obj, key)}
            specs.append({"name": name, **hparams})
        values[field] = specs
    values["max_duration"] = str(trainer.state.max_duration) if trainer.state.max_duration is not None else None
    values["seed"] = trainer._seed
    values["precision"] = trainer.state.precision
    values["run_name"] = trainer.state.run_name
    values["log_interval"] = trainer.log_interval
    values["device_train_microbatch_size"] = trainer.microbatch_size
    return TrainerConfig.from_dict(values)


def _plain(value: Any) -> Any:
    if isinstance(value, (Time, TimeUnit)):
        return str(value)
    if isinstance(value, tuple):
        return list(value)
    return value
