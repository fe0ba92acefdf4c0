"""Registries: the names recipes and the command line use for algorithms, callbacks, loggers, models and data.

Every registry reads its entry-point group (``composerjax.algorithms``, ``composerjax.callbacks``,
``composerjax.loggers``, ``composerjax.models``, ``composerjax.data``) on first use, so the built-ins
(declared in composerjax's own ``pyproject.toml``) and third-party plugins are found the same way.
Each entry is imported only when it is asked for. Names match ignoring case, ``_`` and ``-``, and a
``"package.module:attr"`` path reaches anything importable without registering it.

Example:
    >>> from composerjax import registry
    >>> registry.algorithms.get("MixUp").__name__, registry.algorithms.get("label-smoothing").__name__
    ('MixUp', 'LabelSmoothing')
    >>> registry.resolve("callbacks", "composerjax.callbacks:SpeedMonitor").__name__
    'SpeedMonitor'
    >>> registry.algorithms.name_of(registry.algorithms.get("mixup")(alpha=0.2))
    'mixup'
    >>> registry.hparams_model(registry.algorithms.get("mixup"))(alpha=0.5).alpha
    0.5
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import re
import threading
import typing
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pydantic

__all__ = [
    "REGISTRIES",
    "PluginLoadWarning",
    "Registry",
    "UnknownNameError",
    "algorithms",
    "callbacks",
    "data",
    "describe_hparams",
    "did_you_mean",
    "docstring_args",
    "hparam_names",
    "hparams_model",
    "loggers",
    "models",
    "normalize_name",
    "resolve",
]


def normalize_name(name: str) -> str:
    """Return the form names are compared in: lower case, without ``_`` and ``-``.

    Example:
        >>> normalize_name("Mix_Up"), normalize_name("mix-up"), normalize_name("MIXUP")
        ('mixup', 'mixup', 'mixup')
    """
    return name.lower().replace("_", "").replace("-", "")


class UnknownNameError(ValueError, LookupError):
    """A name no registry entry matches; the message lists the closest names and all registered ones.

    Attributes:
        kind: what was looked up ('algorithm', 'callback', ...).
        name: the value that was asked for.
        suggestions: up to three registered names close to ``name`` (may be empty).
    """

    def __init__(self, message: str, kind: str, name: str, suggestions: list[str] | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.name = name
        self.suggestions = list(suggestions or [])


class PluginLoadWarning(UserWarning):
    """An entry point of a composerjax group could not be imported; its name is skipped."""


class _Entry:
    """One registered name: the object, or the entry point it will be loaded from."""

    __slots__ = ("name", "obj", "entry_point", "loaded")

    def __init__(self, name: str, obj: Any = None, entry_point: importlib.metadata.EntryPoint | None = None):
        self.name = name
        self.obj = obj
        self.entry_point = entry_point
        self.loaded = entry_point is None


def _qualified_name(obj: Any) -> str | None:
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    return f"{module}:{qualname}" if module and qualname else None


def _import_path(kind: str, path: str) -> Any:
    """Import ``"package.module:attr"`` (``attr`` may be dotted); unknown modules or attributes raise
    :class:`UnknownNameError` naming them."""
    module_name, _, attribute = path.partition(":")
    module_name, attribute = module_name.strip(), attribute.strip()
    if not module_name or not attribute:
        raise UnknownNameError(
            f"{kind} {path!r}: expected a registered name or an import path 'package.module:attribute'", kind, path
        )
    try:
        obj = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        # Only a missing module of the path itself is a wrong name; a missing dependency of an
        # existing module is that module's bug and keeps its own traceback.
        if error.name is None or not (module_name == error.name or module_name.startswith(error.name + ".")):
            raise
        raise UnknownNameError(
            f"{kind} {path!r}: cannot import module {module_name!r} ({error})", kind, path
        ) from error
    walked = module_name
    for part in attribute.split("."):
        if not hasattr(obj, part):
            candidates = [name for name in dir(obj) if not name.startswith("_")]
            suggestions = difflib.get_close_matches(part, candidates, n=3)
            hint = f"; did you mean {', '.join(repr(s) for s in suggestions)}?" if suggestions else ""
            raise UnknownNameError(
                f"{kind} {path!r}: {walked!r} has no attribute {part!r}{hint}", kind, path, suggestions
            )
        obj = getattr(obj, part)
        walked = f"{walked}.{part}" if walked != module_name else f"{module_name}:{part}"
    return obj


class Registry:
    """Names for one kind of plugin: registered in code, or found in the entry-point group ``group``.

    Args:
        kind: what the entries are, singular, for messages ('algorithm', 'callback', ...).
        group: the entry-point group read on first use (``importlib.metadata.entry_points``).

    Example:
        >>> shapes = Registry("shape", group="example.shapes")
        >>> @shapes.register("unit_square")
        ... class UnitSquare:
        ...     pass
        >>> shapes.get("UnitSquare") is UnitSquare, shapes.names(), "unit-square" in shapes
        (True, ['unit_square'], True)
        >>> shapes.name_of(UnitSquare())
        'unit_square'
        >>> shapes.get("unit_sqare")
        Traceback (most recent call last):
        ...
        composerjax.registry.UnknownNameError: unknown shape 'unit_sqare'; did you mean 'unit_square'? Registered \
shape names: ['unit_square'] (or give an import path 'package.module:attribute')
    """

    def __init__(self, kind: str, group: str) -> None:
        self.kind = kind
        self.group = group
        self._entries: dict[str, _Entry] = {}
        self._failed: dict[str, str] = {}
        self._discovered = False
        self._lock = threading.RLock()

    def __repr__(self) -> str:
        return f"Registry(kind={self.kind!r}, group={self.group!r})"

    def _discover(self) -> None:
        """Read the entry-point group once (names only: nothing is imported here)."""
        if self._discovered:
            return
        with self._lock:
            if self._discovered:
                return
            for entry_point in importlib.metadata.entry_points(group=self.group):
                key = normalize_name(entry_point.name)
                existing = self._entries.get(key)
                if existing is None:
                    self._entries[key] = _Entry(entry_point.name, entry_point=entry_point)
                    continue
                # register() reads the group before adding anything, so ``existing`` is an entry point too.
                first = existing.entry_point.value if existing.entry_point else _qualified_name(existing.obj)
                if first != entry_point.value:
                    warnings.warn(
                        f"{self.kind} name {entry_point.name!r} is declared twice in entry-point group "
                        f"{self.group!r}: {first!r} and {entry_point.value!r}; using the first",
                        PluginLoadWarning, stacklevel=4,
                    )
            # Set last: other threads skip the lock once it is True, so the entries must be complete.
            self._discovered = True

    def _load(self, key: str) -> _Entry | None:
        """The loaded entry for a normalized name, or None (warning once) when its entry point fails."""
        entry = self._entries.get(key)
        if entry is None or entry.loaded:
            return entry
        with self._lock:
            if entry.loaded:
                return entry
            entry_point = entry.entry_point
            assert entry_point is not None
            try:
                obj = entry_point.load()
            except Exception as error:  # a broken plugin must not stop the others
                distribution = getattr(getattr(entry_point, "dist", None), "name", None)
                origin = f" (distribution {distribution!r})" if distribution else ""
                reason = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"{self.kind} plugin {entry_point.name!r} = {entry_point.value!r} from entry-point group "
                    f"{self.group!r}{origin} failed to load and is skipped: {reason}",
                    PluginLoadWarning, stacklevel=4,
                )
                del self._entries[key]
                self._failed[key] = f"its entry point {entry_point.value!r} failed to load: {reason}"
                return None
            entry.obj, entry.loaded = obj, True
            return entry

    def register(self, name: str, obj: Any = None, *, replace: bool = False) -> Any:
        """Register ``obj`` (a class or factory) as ``name``; without ``obj``, return a decorator.

        Registering the same object twice is a no-op; another object under a taken name raises
        ``ValueError`` unless ``replace=True``.

        Example:
            >>> colors = Registry("color", group="example.colors")
            >>> colors.register("red", dict(rgb=(255, 0, 0)))["rgb"]
            (255, 0, 0)
            >>> colors.get("RED")
            {'rgb': (255, 0, 0)}
        """
        if not isinstance(name, str) or not normalize_name(name) or ":" in name:
            raise ValueError(f"{self.kind} name {name!r}: expected a non-empty string without ':'")
        if obj is None:
            def decorator(target: Any) -> Any:
                self.register(name, target, replace=replace)
                return target

            return decorator
        self._discover()
        key = normalize_name(name)
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None and not replace:
                if existing.loaded and existing.obj is obj:
                    return obj
                if not existing.loaded and existing.entry_point is not None:
                    if existing.entry_point.value == _qualified_name(obj):
                        existing.obj, existing.loaded = obj, True
                        return obj
                raise ValueError(
                    f"{self.kind} name {name!r} is already registered as {existing.name!r} "
                    f"({existing.entry_point.value if not existing.loaded else existing.obj!r}); "
                    "pass replace=True to replace it"
                )
            self._entries[key] = _Entry(name, obj)
            self._failed.pop(key, None)
        return obj

    def get(self, name: str) -> Any:
        """Return the object registered as ``name``, or imported from a ``"package.module:attr"`` path.

        Raises:
            UnknownNameError: naming the closest registered names and all of them.
        """
        if not isinstance(name, str):
            raise TypeError(f"{self.kind} name {name!r}: expected a string")
        if ":" in name:
            return _import_path(self.kind, name)
        self._discover()
        key = normalize_name(name)
        entry = self._load(key)
        if entry is not None:
            return entry.obj
        raise self._unknown(name, key)

    def _unknown(self, name: str, key: str) -> UnknownNameError:
        names = self.names()
        by_key = {normalize_name(n): n for n in names}
        suggestions = [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=3)]
        message = f"unknown {self.kind} {name!r}"
        if key in self._failed:
            message += f" ({self._failed[key]})"
        if suggestions:
            message += f"; did you mean {', '.join(repr(s) for s in suggestions)}?"
        message += (f" Registered {self.kind} names: {names} "
                    "(or give an import path 'package.module:attribute')")
        return UnknownNameError(message, self.kind, name, suggestions)

    def names(self) -> list[str]:
        """Return every registered name, sorted (entry points are listed without importing them)."""
        self._discover()
        return sorted(entry.name for entry in list(self._entries.values()))

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        self._discover()
        return normalize_name(name) in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def items(self) -> list[tuple[str, Any]]:
        """Return ``(name, object)`` pairs sorted by name, importing every entry point (broken ones warn)."""
        self._discover()
        pairs = []
        for key in sorted(self._entries, key=lambda k: self._entries[k].name):
            entry = self._load(key)
            if entry is not None:
                pairs.append((entry.name, entry.obj))
        return pairs

    def name_of(self, obj: Any) -> str | None:
        """Return the registered name of a class or factory, or of an instance's class; ``None`` if absent.

        Used to turn a built trainer back into a config.
        """
        target = obj if isinstance(obj, type) or inspect.isroutine(obj) else type(obj)
        self._discover()
        qualified = _qualified_name(target)
        # Entry points naming the object's own module and qualname match without importing anything.
        for entry in sorted(self._entries.values(), key=lambda e: e.name):
            if entry.loaded and entry.obj is target:
                return entry.name
            if not entry.loaded and entry.entry_point is not None and entry.entry_point.value == qualified:
                return entry.name
        for name, candidate in self.items():
            if candidate is target:
                return name
        return None


algorithms = Registry("algorithm", "composerjax.algorithms")
callbacks = Registry("callback", "composerjax.callbacks")
loggers = Registry("logger", "composerjax.loggers")
models = Registry("model", "composerjax.models")
data = Registry("data", "composerjax.data")

#: Every registry by the name a config section uses.
REGISTRIES: dict[str, Registry] = {
    "algorithms": algorithms,
    "callbacks": callbacks,
    "loggers": loggers,
    "models": models,
    "data": data,
}


def resolve(kind: str, name: str) -> Any:
    """Return ``REGISTRIES[kind].get(name)``; ``kind`` may also be singular ('algorithm').

    Example:
        >>> resolve("algorithm", "ema").__name__
        'EMA'
    """
    registry = REGISTRIES.get(kind) or next((r for r in REGISTRIES.values() if r.kind == kind), None)
    if registry is None:
        raise UnknownNameError(f"unknown registry {kind!r}; expected one of {sorted(REGISTRIES)}", "registry", kind,
                               difflib.get_close_matches(kind, list(REGISTRIES), n=3))
    return registry.get(name)


_ARGS_HEADERS = ("Args:", "Arguments:", "Parameters:", "Keyword Args:", "Keyword Arguments:")
_ARG_LINE = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:(.*)$")


def docstring_args(docstring: str | None) -> dict[str, str]:
    """Return ``{parameter: description}`` from the ``Args:`` section of a Google-style docstring.

    Continuation lines are joined with single spaces; ``name (type): text`` and ``name: text`` are
    both understood.

    Example:
        >>> docstring_args('''Scale things.
        ...
        ...     Args:
        ...         factor (float): how much to scale by,
        ...             a positive number.
        ...         name: what to call it.
        ...
        ...     Example:
        ...         >>> scale(2.0)
        ...     ''')
        {'factor': 'how much to scale by, a positive number.', 'name': 'what to call it.'}
    """
    if not docstring:
        return {}
    descriptions: dict[str, list[str]] = {}
    header_indent: int | None = None
    item_indent: int | None = None
    current: str | None = None
    for line in inspect.cleandoc(docstring).splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip())
        if header_indent is not None and indent <= header_indent:
            header_indent = current = None
        if header_indent is None:
            if stripped in _ARGS_HEADERS:
                header_indent, item_indent = indent, None
            continue
        if item_indent is None:
            item_indent = indent
        match = _ARG_LINE.match(stripped) if indent <= item_indent else None
        if match:
            current = match.group(1)
            descriptions[current] = [match.group(2).strip()]
        elif current is not None and indent > item_indent:
            descriptions[current].append(stripped)
    return {name: " ".join(" ".join(parts).split()) for name, parts in descriptions.items()}


def _signature_target(factory: Callable[..., Any]) -> tuple[Callable[..., Any], bool]:
    """The function whose parameters are the hyperparameters, and whether its first one is ``self``."""
    if isinstance(factory, type):
        return factory.__init__, True
    return factory, False


def _type_hints(function: Callable[..., Any]) -> dict[str, Any]:
    """Evaluated annotations; one that cannot be evaluated (a ``TYPE_CHECKING`` import) becomes ``Any``."""
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:
        pass
    namespace = dict(getattr(inspect.unwrap(function), "__globals__", {}))
    hints = {}
    for name, annotation in getattr(function, "__annotations__", {}).items():
        if isinstance(annotation, str):
            try:
                annotation = eval(annotation, namespace)  # the module's own annotation text
            except Exception:
                annotation = Any
        hints[name] = annotation
    return hints


def _all_parameters(factory: Callable[..., Any]) -> list[inspect.Parameter]:
    function, has_self = _signature_target(factory)
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return []
    if has_self and parameters and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                          inspect.Parameter.POSITIONAL_OR_KEYWORD):
        parameters = parameters[1:]
    return parameters


def _parameters(factory: Callable[..., Any]) -> list[inspect.Parameter]:
    """The named parameters (``self``, ``*args`` and ``**kwargs`` left out)."""
    return [p for p in _all_parameters(factory)
            if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]


def _takes_any_keyword(factory: Callable[..., Any]) -> bool:
    return any(p.kind == inspect.Parameter.VAR_KEYWORD for p in _all_parameters(factory))


def _descriptions(factory: Callable[..., Any]) -> dict[str, str]:
    function, has_self = _signature_target(factory)
    found = docstring_args(factory.__doc__) if has_self else {}
    found.update(docstring_args(getattr(function, "__doc__", None)))
    return found


_MODELS: dict[Any, type[pydantic.BaseModel]] = {}


def hparams_model(factory: Callable[..., Any]) -> type[pydantic.BaseModel]:
    """Return a pydantic model of ``factory``'s hyperparameters, to validate a config section with.

    A class attribute ``hparams_model`` (a ``pydantic.BaseModel`` subclass) is used as it is;
    otherwise the model is built from the typed signature of the class's ``__init__`` (or of the
    function): defaults kept, unannotated parameters ``Any``, unknown fields rejected (unless the
    signature has ``**kwargs``), descriptions taken from the docstring's ``Args:`` (the class's
    docstring, then ``__init__``'s).

    Example:
        >>> def blobs(samples: int, noise: float = 0.1):
        ...     '''Make blobs.
        ...
        ...     Args:
        ...         samples: how many points.
        ...     '''
        >>> Model = hparams_model(blobs)
        >>> Model(samples="8").model_dump()
        {'samples': 8, 'noise': 0.1}
        >>> Model.model_fields["samples"].description
        'how many points.'
    """
    declared = getattr(factory, "hparams_model", None)
    if isinstance(declared, type) and issubclass(declared, pydantic.BaseModel):
        return declared
    try:
        return _MODELS[factory]
    except (KeyError, TypeError):
        pass
    function, _ = _signature_target(factory)
    hints = _type_hints(function)
    descriptions = _descriptions(factory)
    fields: dict[str, Any] = {}
    for parameter in _parameters(factory):
        annotation = hints.get(parameter.name, Any)
        description = descriptions.get(parameter.name)
        if parameter.default is inspect.Parameter.empty:
            fields[parameter.name] = (annotation, pydantic.Field(description=description))
        else:
            fields[parameter.name] = (annotation, pydantic.Field(default=parameter.default, description=description))
    name = getattr(factory, "__name__", type(factory).__name__)
    # A factory with **kwargs accepts any keyword (a subclass forwarding to its base): so does its model.
    extra = "allow" if _takes_any_keyword(factory) else "forbid"
    config = pydantic.ConfigDict(extra=extra, arbitrary_types_allowed=True, protected_namespaces=())
    with warnings.catch_warnings():
        # A parameter called 'copy' or 'schema' is a fine field; pydantic only notes that it shadows a method.
        warnings.filterwarnings("ignore", message=".*shadows an attribute in parent", category=UserWarning)
        model = pydantic.create_model(f"{name}Hparams", __config__=config, __doc__=f"Hyperparameters of {name}.",
                                      **fields)
    try:
        _MODELS[factory] = model
    except TypeError:
        pass
    return model


def did_you_mean(word: str, accepted: Iterable[str]) -> str:
    """The end of a message about an unknown name: the accepted names close to ``word``, else all of them.

    Names are compared ignoring case, ``_`` and ``-``, as registry names are.

    Example:
        >>> did_you_mean("smoothng", ["smoothing", "target_key"])
        "; did you mean 'smoothing'?"
        >>> did_you_mean("zzz", ["smoothing", "target_key"])
        '; accepted: smoothing, target_key'
    """
    names = list(accepted)
    by_key = {normalize_name(name): name for name in names}
    close = [by_key[key] for key in difflib.get_close_matches(normalize_name(str(word)), list(by_key), n=3)]
    if close:
        return f"; did you mean {', '.join(map(repr, close))}?"
    return f"; accepted: {', '.join(names)}" if names else ""


def hparam_names(factory: Callable[..., Any]) -> list[str]:
    """The hyperparameters ``factory`` accepts by name (the fields of its :func:`hparams_model`).

    Example:
        >>> hparam_names(algorithms.get("label_smoothing"))
        ['smoothing', 'target_key']
    """
    return list(hparams_model(factory).model_fields)


def _type_name(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty or annotation is Any:
        return "Any"
    if isinstance(annotation, str):
        return annotation
    if isinstance(annotation, type) and typing.get_origin(annotation) is None:
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def describe_hparams(factory: Callable[..., Any]) -> list[dict[str, Any]]:
    """Describe each hyperparameter of ``factory``: name, type, default, required, description.

    ``type`` is the annotation as written in the source; ``default`` is ``None`` for required ones.

    Example:
        >>> from composerjax.registry import algorithms
        >>> alpha = describe_hparams(algorithms.get("mixup"))[0]
        >>> alpha["name"], alpha["type"], alpha["default"], alpha["required"]
        ('alpha', 'float', 0.2, False)
        >>> alpha["description"].split(".")[0]
        'concentration of the symmetric Beta distribution ``mixing`` is drawn from, ``>= 0``'
    """
    model = hparams_model(factory)
    written = {p.name: p.annotation for p in _parameters(factory)}
    rows = []
    for name, field in model.model_fields.items():
        required = field.is_required()
        rows.append({
            "name": name,
            "type": _type_name(written.get(name, field.annotation)),
            "default": None if required else field.get_default(call_default_factory=True),
            "required": required,
            "description": field.description or "",
        })
    return rows
