"""A recipe as plain values: reading the file, the component shorthand, ``--set`` overrides, and every check
beyond the field types (components and their hyperparameters, the optimizer, time strings, settings).

:mod:`composerjax.trainer.config` validates the result into a ``TrainerConfig``; each check here
returns its problems as ``'field.path: what is wrong'`` lines, so a recipe's problems are listed
all at once.

Example:
    >>> from composerjax.trainer.recipe import apply_override, normalise
    >>> values = normalise({"algorithms": [{"mixup": {"alpha": 0.2}}]})
    >>> apply_override(values, "algorithms[0].mixup.alpha=0.4")
    >>> values["algorithms"]
    [{'name': 'mixup', 'alpha': 0.4}]
"""

from __future__ import annotations

import inspect
import json
import math
import os
import re
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import optax
import pydantic

from composerjax.core.time import Time, TimeUnit
from composerjax.trainer import settings

__all__ = ["ConfigError", "OPTIMIZERS", "apply_override", "check_components", "check_settings", "check_times",
           "loc", "normalise", "read_recipe"]

OPTIMIZERS = ("adam", "adamw", "sgd", "lamb", "lion", "rmsprop", "adafactor", "adagrad", "nadam")


class ConfigError(ValueError):
    """A recipe with problems; ``problems`` lists each as ``'field.path: what is wrong'``."""

    def __init__(self, problems: Sequence[str], source: str | None = None) -> None:
        self.problems = list(problems)
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        super().__init__(f"{len(self.problems)} problem(s){where}:\n{lines}")


# -- reading ----------------------------------------------------------------------------------------
def read_recipe(path: str) -> Any:
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


def apply_override(values: dict[str, Any], override: str) -> None:
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
    return loc(keys) or "(top level)"


def normalise(values: dict[str, Any]) -> dict[str, Any]:
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


def loc(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text



# -- checks beyond the field types -----------------------------------------------------------------
def check_components(values: dict[str, Any]) -> list[str]:
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
                hint = ""
                if item.get("type") == "extra_forbidden" and len(item["loc"]) == 1:  # a misspelt hyperparameter
                    hint = registry.did_you_mean(str(item["loc"][0]), registry.hparam_names(factory))
                problems.append(f"{label}.{loc(item['loc'])}: {item['msg']}{got}{hint}")
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


def check_times(values: dict[str, Any]) -> list[str]:
    """Every time string in the recipe parses: run lengths and intervals, the schedule, the time limit."""
    from composerjax.core.state import as_max_duration
    from composerjax.core.validation import check_interval, check_run_length
    from composerjax.core.validation import to_time as _to_time
    from composerjax.trainer.stopping import to_time_limit as _to_time_limit

    problems = []
    for field in ("max_duration", "eval_interval", "save_interval"):
        value = values.get(field)
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                time = _to_time(value, field)
                if field == "max_duration":
                    as_max_duration(time)
                    if time.unit is TimeUnit.ITERATION:
                        raise ValueError(f"max_duration={value!r}: 'iter' needs state.iteration_length, which a recipe "
                                         "cannot set; use ep, ba, sp, tok or sec")
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
                elif field == "eval_interval":
                    from composerjax.core.evaluator import evaluate_periodically

                    evaluate_periodically(value)  # any unit; 0 disables (Composer's rule)
                else:
                    check_interval(time, field, given=value)
            except ValueError as error:
                problems.append(str(error))
    schedule = values.get("schedule")
    for field in ("warmup", "decay_end"):
        value = schedule.get(field) if isinstance(schedule, dict) else None
        if isinstance(value, (str, int)) and not isinstance(value, bool):
            try:
                time = Time.from_input(value, TimeUnit.EPOCH)
            except ValueError as error:
                problems.append(f"schedule.{field}: {value!r}: {error}")
                continue
            unit = time.unit
            if unit not in (TimeUnit.EPOCH, TimeUnit.BATCH, TimeUnit.DURATION) or time.value < 0:
                problems.append(f"schedule.{field}: {value!r}: expected epochs, batches or a percentage of the run "
                                "('1ep', '500ba', '10%')")
    if values.get("time_limit") is not None:
        try:
            _to_time_limit(values["time_limit"])
        except ValueError as error:
            problems.append(f"time_limit: {str(error).split(': ', 1)[-1]}")
    return problems


def _check_optimizer(optimizer: dict[str, Any]) -> list[str]:
    name = optimizer.get("name", "adam")
    if name not in OPTIMIZERS:
        import difflib

        close = difflib.get_close_matches(str(name), OPTIMIZERS, n=3)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        return [f"optimizer.name: unknown optimizer {name!r}{hint} Accepted: {', '.join(OPTIMIZERS)}"]
    from composerjax.registry import did_you_mean

    accepted = set(inspect.signature(getattr(optax, name)).parameters) - {"learning_rate"}
    problems = []
    for key in optimizer:
        if key not in ("name", "lr") and key not in accepted:
            close = did_you_mean(str(key), sorted(accepted))
            close = f"{close} Accepted:" if "did you mean" in close else "; accepted:"
            problems.append(f"optimizer.{key}: optax.{name} has no argument {key!r}{close} "
                            f"{', '.join(sorted(accepted))}")
    # Extra arguments go to optax untyped: a NaN or infinite one would make every update NaN, silently.
    problems += [f"optimizer.{key}: expected a finite number (got {value!r})" for key, value in optimizer.items()
                 if key in accepted and isinstance(value, float) and not math.isfinite(value)]
    return problems


def check_settings(values: Mapping[str, Any], skip: Collection[str] = ()) -> list[str]:
    """The sections' own checks of setting values, run at recipe validation so they are listed all at once.

    Each setting field's check (the one the Trainer runs) on the value the recipe gives, once its
    import path resolves; values of the wrong type (``skip``: the fields pydantic refused) are
    left to pydantic, and the times to :func:`check_times`.
    """
    from composerjax.trainer.sections import TrainerSettings

    problems = []
    fields = TrainerSettings.fields()
    for name, form in settings.RECIPE_FORMS.items():  # import paths resolve, a parallelism mapping builds
        if values.get(name) is not None:
            problems += form.check(values[name])
    arguments = settings.recipe_arguments()
    for name, value in values.items():
        if name not in arguments or name in _TIMES or name in skip or value is None:
            continue
        check = fields[name][1].metadata["check"]
        if check is None or any(problem.startswith(name) for problem in problems):
            continue
        form = arguments[name].form
        try:
            check(form.build(value) if form is not None else value, name)
        except (ValueError, TypeError) as error:
            problems.append(f"{error} (got {value!r})")  # 'name=...: expected ... (got ...)', as pydantic's
    return problems


#: Settings whose values are times, checked by :func:`check_times` (with the recipe's own messages).
_TIMES = frozenset({"max_duration", "eval_interval", "save_interval", "time_limit"})
