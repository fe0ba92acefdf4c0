"""How a recipe spells the Trainer arguments whose Python type has no YAML form (:data:`RECIPE_FORMS`).

A function is named by its import path ``'package.module:attr'``, devices by index, a
``ParallelismConfig`` as a mapping, an ``eval_interval`` as a time string. Each form says how to
build the argument from the recipe value, how to write it back, and what to check at validation.

Example:
    >>> RECIPE_FORMS["tokens_per_batch"].recipe_type
    str | None
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from composerjax.core.time import Time

__all__ = ["PARALLELISM_FIELDS", "RECIPE_FORMS", "RecipeForm", "reference_of", "resolve_reference"]

@dataclass(frozen=True)
class RecipeForm:
    """How a recipe spells one Trainer argument whose Python type has no YAML form.

    Attributes:
        recipe_type: the type pydantic validates the recipe value against.
        why: what a recipe writes instead, and why.
        build: recipe value -> Trainer argument (resolves import paths).
        write: ``(Trainer argument, the recipe value it was built from or None)`` -> recipe value.
        check: recipe value -> problems (``'field: what is wrong'``), run at validation; values of
            the wrong type are left to pydantic.
    """

    recipe_type: Any
    why: str
    build: Callable[[Any], Any]
    write: Callable[[Any, Any], Any]
    check: Callable[[Any], list[str]] = lambda value: []


def _write_interval(value: Any) -> Any:
    """An eval_interval as a recipe writes it: a time string, an int, or None for a callable."""
    if value is None or isinstance(value, (int, str)):
        return value
    return str(value) if isinstance(value, Time) else None


# -- import paths ----------------------------------------------------------------------------------
def resolve_reference(path: Any, field: str = "reference") -> Any:
    """The object an import path ``'package.module:attr'`` names, found the way plugin names are.

    Raises:
        ValueError: naming ``field`` and the path when it is not one or does not resolve.

    Example:
        >>> resolve_reference("math:sqrt", "tokens_per_batch").__name__
        'sqrt'
    """
    from composerjax.registry import _import_path

    if not isinstance(path, str) or ":" not in path:
        raise ValueError(f"{field}: expected an import path 'package.module:attr' (got {path!r})")
    try:
        return _import_path("import path", path)
    except LookupError as error:  # "import path 'x:y': cannot import module 'x' (...)"
        raise ValueError(f"{field}: {error}") from None


def reference_of(obj: Any, given: Any = None) -> str | None:
    """An import path that resolves to ``obj``: ``given`` if it does, else ``module:qualname``; None if none does.

    Example:
        >>> import math
        >>> reference_of(math.sqrt), reference_of(lambda x: x)
        ('math:sqrt', None)
    """
    for path in (given, f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"):
        if isinstance(path, str) and ":" in path and "<" not in path:
            try:
                if resolve_reference(path) is obj:
                    return path
            except (ValueError, ImportError):
                pass
    return None


def _write_reference(field_name: str) -> Callable[[Any, Any], Any]:
    def write(value: Any, given: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        path = reference_of(value, given)
        if path is None:
            raise ValueError(f"to_config(): {field_name}={value!r} has no import path a recipe could name (a lambda, "
                             "a local function or a partial); define it at module level, then pass it or its "
                             "'package.module:attr' path")
        return path

    return write


def _check_function(field_name: str) -> Callable[[Any], list[str]]:
    def check(path: Any) -> list[str]:
        if not isinstance(path, str):
            return []
        try:
            obj = resolve_reference(path, field_name)
        except ValueError as error:
            return [str(error)]
        return [] if callable(obj) else [f"{field_name}: {path!r} is a {type(obj).__name__}; expected a function"]

    return check


def _check_passes(value: Any) -> list[str]:
    problems: list[str] = []
    for index, item in enumerate(value if isinstance(value, list) else []):
        path = item[0] if isinstance(item, (list, tuple)) and item else item
        problems += _check_function(f"algorithm_passes[{index}]")(path)
    return problems


def _build_reference(field_name: str) -> Callable[[Any], Any]:
    return lambda value: None if value is None else resolve_reference(value, field_name)


def _build_passes(value: Any) -> Any:
    if value is None:
        return None
    return [resolve_reference(item, "algorithm_passes") if isinstance(item, str)
            else (resolve_reference(item[0], "algorithm_passes"), item[1]) for item in value]


def _write_passes(value: Any, given: Any) -> Any:
    if value is None:
        return None
    given = list(given or [])
    write = _write_reference("algorithm_passes")
    out = []
    for index, item in enumerate(value):
        mine = given[index] if index < len(given) else None
        if isinstance(item, tuple):
            out.append([write(item[0], mine[0] if isinstance(mine, (list, tuple)) else None), item[1]])
        else:
            out.append(write(item, mine))
    return out


PARALLELISM_FIELDS = ("fsdp", "tensor", "min_fsdp_size", "rules")


def _build_parallelism(value: Any) -> Any:
    from composerjax.parallel.strategy import ParallelismConfig

    if not isinstance(value, Mapping):
        return value
    values = dict(value)
    if values.get("rules") is not None:
        values["rules"] = tuple(resolve_reference(values["rules"], "parallelism.rules"))
    else:
        values.pop("rules", None)
    return ParallelismConfig(**values)


def _check_parallelism(value: Any) -> list[str]:
    if not isinstance(value, Mapping):
        return []  # a strategy name: resolve_parallelism checks it
    unknown = [key for key in value if key not in PARALLELISM_FIELDS]
    if unknown:
        return [f"parallelism: unknown field(s) {unknown}; accepted: {', '.join(PARALLELISM_FIELDS)}"]
    try:
        _build_parallelism(value)
    except (ValueError, TypeError) as error:
        text = str(error)
        return [text if text.startswith("parallelism") else f"parallelism: {text}"]
    return []


def _write_parallelism(value: Any, given: Any) -> Any:
    if isinstance(value, str):
        return value
    out = {name: getattr(value, name) for name in PARALLELISM_FIELDS if name != "rules"}
    if value.rules:
        path = given.get("rules") if isinstance(given, Mapping) else None
        try:
            same = path is not None and tuple(resolve_reference(path)) == tuple(value.rules)
        except (ValueError, ImportError, TypeError):
            same = False
        if not same:
            raise ValueError("to_config(): parallelism has rules that no import path names; give them as "
                             "parallelism: {rules: 'package.module:RULES', ...}")
        out["rules"] = path
    return out


def _write_devices(value: Any, given: Any) -> Any:
    if isinstance(value, (str, int)) or value is None:
        return value
    items = list(value)
    if not all(isinstance(item, int) and not isinstance(item, bool) for item in items):
        raise ValueError(f"to_config(): devices={value!r}: a recipe names devices by local index; pass indices")
    return items


#: Trainer arguments a recipe spells differently, with their recipe type and reason.
RECIPE_FORMS: dict[str, RecipeForm] = {
    "loss_fn": RecipeForm(str | None, "a function, named by its import path 'package.module:function'",
                          _build_reference("loss_fn"), _write_reference("loss_fn"), _check_function("loss_fn")),
    "tokens_per_batch": RecipeForm(str | None, "a function fn(batch) -> int, named by its import path "
                                   "'package.module:function'", _build_reference("tokens_per_batch"),
                                   _write_reference("tokens_per_batch"), _check_function("tokens_per_batch")),
    "algorithm_passes": RecipeForm(list[str | tuple[str, int]] | None, "engine passes by import path, each "
                                   "'package.module:function' or ['package.module:function', priority]",
                                   _build_passes, _write_passes, _check_passes),
    "devices": RecipeForm(str | int | list[int] | None, "'auto', a count or a list of local device indices; "
                          "jax.Device objects exist only in a running process", lambda value: value, _write_devices),
    "eval_interval": RecipeForm(str | int | None, "a time string ('1ep', '500ba', '0.25dur') or an int (epochs); "
                                "a callable (state, event) -> bool exists only in Python", lambda value: value,
                                lambda value, given: given if given is not None else _write_interval(value)),
    "load_ignore_keys": RecipeForm(list[str] | None, "glob paths into the checkpoint's state dict ('state/model/*', "
                                   "'rng'); a function fn(state_dict) exists only in Python", lambda value: value,
                                   lambda value, given: None if value is None or callable(value) else list(value)),
    "parallelism": RecipeForm(str | dict[str, Any], "a strategy name, or a mapping of ParallelismConfig fields "
                              "(fsdp, tensor, min_fsdp_size, rules: 'package.module:RULES')", _build_parallelism,
                              _write_parallelism, _check_parallelism),
}
