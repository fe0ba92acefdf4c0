"""Model surgery: replace submodules of an NNX model, in place, by class."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from flax import nnx

__all__ = ["ModuleFactory", "count_modules", "replace_modules"]

#: ``factory(old_module) -> new_module``, or ``factory(old_module, index)`` where ``index`` counts the
#: replacements of that class so far.
ModuleFactory = Callable[..., nnx.Module]


def count_modules(model: nnx.Module, *classes: type) -> int:
    """Count the submodules of ``model`` (itself included) that are instances of ``classes``.

    Example:
        >>> count_modules(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.relu), nnx.Linear)
        1
    """
    return sum(1 for _, module in nnx.iter_modules(model) if isinstance(module, classes))


def replace_modules(
    model: nnx.Module, policies: Mapping[type, ModuleFactory], *, recurse_into_replaced: bool = False
) -> int:
    """Replace every submodule whose class is a key of ``policies`` with ``factory(old)``; return the count.

    A factory may return the old module unchanged to skip it; skipped modules are not counted.

    The model is changed in place; its parameters become whatever the factories build (a factory
    usually copies the old weights). Run it at ``Event.INIT``: the trainer splits the model and
    places its parameters on the mesh after INIT, so replaced modules are sharded like the rest.
    The model object itself cannot be replaced: wrap it in a parent module first.

    Args:
        model: the NNX module to edit.
        policies: ``{OldClass: factory}``; exact class match first, then ``isinstance``.
        recurse_into_replaced: also visit the children of newly built modules (off by default, so a
            factory that wraps the old module does not wrap it again).

    Example:
        >>> model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.relu)
        >>> replace_modules(model, {nnx.Linear: lambda old: nnx.LayerNorm(2, rngs=nnx.Rngs(0))})
        1
        >>> type(model.layers[0]).__name__
        'LayerNorm'
    """
    if not policies:
        return 0
    counts: dict[type, int] = {}
    replaced = 0
    # Walk parents first so that a replaced module's old children are not visited.
    visited: set[int] = set()

    def visit(parent: Any) -> None:
        nonlocal replaced
        if id(parent) in visited:
            return
        visited.add(id(parent))
        for key, child in list(_children(parent)):
            policy = _policy_for(child, policies)
            if policy is None:
                if isinstance(child, (nnx.Module, nnx.List, nnx.Dict)) or _is_container(child):
                    visit(child)
                continue
            old_class, factory = policy
            index = counts.get(old_class, 0)
            counts[old_class] = index + 1
            new = _call_factory(factory, child, index)
            if new is child:  # the factory chose to keep this one
                visited.add(id(child))
                continue
            if not isinstance(new, nnx.Module):
                raise TypeError(f"replace_modules: the factory for {old_class.__name__} returned a "
                                f"{type(new).__name__}; expected an nnx.Module")
            _set_child(parent, key, new)
            replaced += 1
            if recurse_into_replaced:
                visit(new)
            else:
                visited.add(id(new))

    visit(model)
    return replaced


def _policy_for(module: Any, policies: Mapping[type, ModuleFactory]) -> tuple[type, ModuleFactory] | None:
    if not isinstance(module, nnx.Module):
        return None
    if type(module) in policies:
        return type(module), policies[type(module)]
    for cls, factory in policies.items():
        if isinstance(module, cls):
            return cls, factory
    return None


def _is_container(value: Any) -> bool:
    return isinstance(value, (list, tuple, dict))


def _children(parent: Any) -> list[tuple[Any, Any]]:
    if isinstance(parent, (list, tuple)):
        return list(enumerate(parent))
    if isinstance(parent, dict):
        return list(parent.items())
    if isinstance(parent, nnx.List):
        return [(i, parent[i]) for i in range(len(parent))]
    if isinstance(parent, nnx.Dict):
        return [(k, parent[k]) for k in list(parent.keys())]
    return [(name, value) for name, value in vars(parent).items() if not name.startswith("_")]


def _set_child(parent: Any, key: Any, value: nnx.Module) -> None:
    if isinstance(parent, tuple):
        raise TypeError("replace_modules: cannot replace a module held in a tuple; use a list or nnx.List")
    if isinstance(parent, (list, dict, nnx.List, nnx.Dict)):
        parent[key] = value
    else:
        setattr(parent, key, value)


def _call_factory(factory: ModuleFactory, module: nnx.Module, index: int) -> nnx.Module:
    # A class (NNX's metaclass hides its signature) is inspected through __init__, less self.
    target = factory.__init__ if isinstance(factory, type) else factory
    try:
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):  # builtins without a signature: pass the module only
        return factory(module)
    if isinstance(factory, type):
        parameters = parameters[1:]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_index = len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in parameters)
    return factory(module, index) if takes_index else factory(module)
