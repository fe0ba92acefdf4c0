"""Loading a checkpoint as Composer does: ``load_ignore_keys``, ``load_exclude_algorithms``, strict weights.

A checkpoint is shown to ``load_ignore_keys`` as Composer's state dict (:func:`build_view`): model
weights under ``state/model``, the optax state under ``state/optimizers``, algorithms, callbacks,
timestamp, data position and ``rng``; arrays not read yet are :class:`SavedArray` placeholders.
:func:`plan_arrays` matches what is left with the run's arrays (every difference listed before
anything is read), and :func:`load_into` reads what the plan keeps, checks it against the saved
checksums and only then changes the run's state. The run keeps its own values for everything left
out. :class:`~composerjax.checkpoint.checkpointer.Checkpointer` ``.restore`` calls it.

Example:
    >>> LoadOptions(ignore_keys=["state/optimizers/*"], exclude_algorithms=["EMA"]).excludes("EMA#1")
    True
"""

from __future__ import annotations

import fnmatch
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from composerjax.checkpoint.checks import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    checksums,
    compare_named,
    first_line,
    is_array,
    structure_problem,
)
from composerjax.checkpoint.writer import CheckpointInfo
from composerjax.parallel.sharding import path_of

__all__ = ["ArrayPlan", "LoadOptions", "SavedArray", "build_view", "glob_filter", "load_into", "lookup", "plan_arrays",
           "view_path"]

# The train state's parts that make up the model's weights (all a weights-only checkpoint holds).
MODEL_KEYS = ("params", "rest")
_GROUPS = frozenset({"params", "rest", "opt_state", "algorithm_state", "clock"})


class SavedArray(NamedTuple):
    """An array of a checkpoint, not read yet: ``load_ignore_keys`` sees these in place of the values.

    Attributes:
        name: orbax's name for it (``'params.layers.0.kernel'``), which the checksums use.
        shape: its saved shape.
        dtype: its saved dtype, as a string.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LoadOptions:
    """How a checkpoint is loaded: Composer's ``load_*`` arguments of the Trainer.

    Args:
        weights_only: load only the model's variables (``load_weights_only``).
        strict_model_weights: the model's names and shapes in checkpoint and run must match
            exactly; False loads the names both have and warns about the rest.
        ignore_keys: glob paths into the checkpoint's state dict (:func:`build_view`) that are not
            loaded (the run keeps its own values), or a function that edits that dict in place.
        exclude_algorithms: algorithm class names whose saved state is neither loaded nor compared.

    Example:
        >>> LoadOptions(ignore_keys=["state/optimizers/*"]).ignore_keys
        ('state/optimizers/*',)
    """

    weights_only: bool = False
    strict_model_weights: bool = True
    ignore_keys: tuple[str, ...] | Callable[[dict], None] | None = None
    exclude_algorithms: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name, value in (("load_weights_only", self.weights_only),
                            ("load_strict_model_weights", self.strict_model_weights)):
            if not isinstance(value, bool):
                raise ValueError(f"{name}={value!r}: expected True or False")
        keys = self.ignore_keys
        if keys is not None and not callable(keys):
            if isinstance(keys, str) or not isinstance(keys, Sequence) or not all(isinstance(k, str) for k in keys):
                raise ValueError(f"load_ignore_keys={keys!r}: expected a list of paths such as ['state/model/*', "
                                 "'rng'], a function fn(state_dict) -> None, or None")
            object.__setattr__(self, "ignore_keys", tuple(keys) or None)
        names = self.exclude_algorithms if self.exclude_algorithms is not None else ()
        if isinstance(names, str) or not isinstance(names, Sequence) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"load_exclude_algorithms={self.exclude_algorithms!r}: expected a list of algorithm "
                             "class names such as ['EMA'], or None")
        object.__setattr__(self, "exclude_algorithms", tuple(names))

    def excludes(self, algorithm_name: str) -> bool:
        """Whether the state of algorithm ``algorithm_name`` (``'EMA'``, ``'EMA#1'``) is left out."""
        return algorithm_name.split("#")[0] in self.exclude_algorithms


_MISSING = object()


def view_path(name: str) -> tuple[str, ...]:
    """Where the train-state array orbax calls ``name`` sits in Composer's state dict (:func:`build_view`).

    Example:
        >>> view_path("params.layers.0.kernel"), view_path("algorithm_state.EMA.params.w")
        (('state', 'model', 'layers.0.kernel'), ('state', 'algorithms', 'EMA', 'device', 'params.w'))
    """
    group, _, rest = name.partition(".")
    if group in ("params", "rest"):
        return ("state", "model", rest)
    if group == "opt_state":
        return ("state", "optimizers", rest)
    if group == "algorithm_state":
        algorithm, _, rest = rest.partition(".")
        return ("state", "algorithms", algorithm, "device", *((rest,) if rest else ()))
    if group == "clock":
        return ("state", "timestamp", "clock")
    return ("state", name)


def build_view(arrays: dict[str, Any], host: dict[str, Any], algorithm_names: Sequence[str]) -> dict[str, Any]:
    """The checkpoint as Composer's state dict, the shape ``load_ignore_keys`` paths and functions see.

    ::

        {"state": {"model": {"layers.0.kernel": ..., "layers.1.mean": ...},  # params and other variables
                   "optimizers": {"0.mu.layers.0.kernel": ..., "0.count": ...},  # the optax state
                   "algorithms": {"EMA": {"device": {"params.layers.0.kernel": ...}, "host": {...}}},
                   "callbacks": {"SpeedMonitor": {...}},
                   "timestamp": {"epoch": 1, "batch": 8, ..., "clock": ...},  # with the step clock
                   "dataset_state": {...}, "run_name": "..."},
         "rng": [...]}

    Array names are orbax's, the group dropped (``.``-separated, as PyTorch names parameters), so
    ``'state/model/layers.0.*'`` matches a layer's arrays.

    Args:
        arrays: orbax's array names -> :class:`SavedArray` (or the values, once read).
        host: the checkpoint's host record.
        algorithm_names: the run's algorithm names, for checkpoints that did not record theirs
            (matched by position when the counts agree).

    Example:
        >>> build_view({"params.w": SavedArray("params.w", (2,), "float32")}, {"rng": [0, 1]}, [])
        {'state': {'model': {'w': SavedArray(name='params.w', shape=(2,), dtype='float32')}}, 'rng': [0, 1]}
    """
    view: dict[str, Any] = {"state": {}}
    state = view["state"]
    for name, value in arrays.items():
        *parents, leaf = view_path(name)
        node = view
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    if "timestamp" in host:
        state["timestamp"] = {**dict(host["timestamp"]), **state.get("timestamp", {})}
    if "rng" in host:
        view["rng"] = host["rng"]
    if "dataloader" in host:
        state["dataset_state"] = host["dataloader"]
    saved_algorithms = host.get("algorithms")
    if saved_algorithms is not None:
        names = host.get("algorithm_names")
        if names is None:  # written before algorithm names were saved: by position
            names = list(algorithm_names) if len(algorithm_names) == len(saved_algorithms) else [
                f"#{index}" for index in range(len(saved_algorithms))]
        for name, saved in zip(names, saved_algorithms):
            state.setdefault("algorithms", {}).setdefault(name, {})["host"] = saved
    if host.get("callbacks") is not None:
        state["callbacks"] = dict(zip(host.get("callback_names") or [], host["callbacks"]))
    if "run_name" in host:
        state["run_name"] = host["run_name"]
    return view


def lookup(view: dict[str, Any], path: Sequence[str], default: Any = _MISSING) -> Any:
    """The value at ``path`` in a state-dict view, or ``default`` (a private marker) when it is gone.

    Example:
        >>> lookup({"state": {"model": {"w": 1}}}, ("state", "model", "w"))
        1
    """
    node: Any = view
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def _flat_paths(node: Any, prefix: str, out: list[str]) -> None:
    """Every path of a nested dict/list, parents included (Composer's ``_flatten_keys``)."""
    if isinstance(node, dict) and node:
        for key, value in node.items():
            _flat_paths(value, f"{prefix}/{key}", out)
    elif isinstance(node, list) and node and not all(isinstance(v, (int, float)) for v in node):
        for index, value in enumerate(node):
            _flat_paths(value, f"{prefix}/{index}", out)
    out.append(prefix.lstrip("/"))


def _remove(node: Any, parts: list[str]) -> None:
    key: Any = parts[0]
    if isinstance(node, list):
        key = int(key)
        if key >= len(node):
            return
    elif not isinstance(node, dict) or key not in node:
        return
    if len(parts) == 1:
        del node[key]
    else:
        _remove(node[key], parts[1:])


def glob_filter(globs: Sequence[str]) -> Callable[[dict], None]:
    """A function that deletes every part of a state dict whose ``/``-joined path matches one of ``globs``.

    A glob that matches nothing is warned about, as Composer does.

    Example:
        >>> view = {"state": {"model": {"a.w": 1, "b.w": 2}, "timestamp": {"batch": 3}}, "rng": [1]}
        >>> glob_filter(["state/model/a.*", "rng"])(view)
        >>> view
        {'state': {'model': {'b.w': 2}, 'timestamp': {'batch': 3}}}
    """
    def remove_matching(state_dict: dict) -> None:
        paths: list[str] = []
        _flat_paths(state_dict, "", paths)
        matched: list[str] = []
        for pattern in globs:
            found = fnmatch.filter(paths, pattern)
            if not found:
                warnings.warn(f"load_ignore_keys: {pattern!r} matches nothing in the checkpoint's state dict",
                              UserWarning, stacklevel=2)
            matched.extend(found)
        for path in sorted(set(matched), key=lambda p: [int(x) if x.isdigit() else -1 for x in p.split("/")],
                           reverse=True):
            if path:
                _remove(state_dict, path.split("/"))

    return remove_matching


class ArrayPlan(NamedTuple):
    """What a load takes from the checkpoint, as :func:`plan_arrays` decided it.

    Attributes:
        values: the run's array name -> the :class:`SavedArray` to read, or the value to use.
        ignored: the run's arrays the checkpoint has but ``load_ignore_keys`` left out (kept as they are).
        missing: model arrays of the run the checkpoint lacks (kept; only without strict weights).
        unexpected: model arrays of the checkpoint the run lacks (not loaded; only without strict weights).
        problems: every difference that stops the load (:func:`compare_named`'s lines).
    """

    values: dict[str, Any]
    ignored: list[str]
    missing: list[str]
    unexpected: list[str]
    problems: list[str]


def _model(name: str) -> bool:
    return name.split(".")[0] in ("params", "rest")


def _array_entries(view: dict[str, Any], groups: set[str]) -> list[tuple[tuple[str, ...], str, Any]]:
    """``(path, name, value)`` of every array in the view's array parts, for ``groups`` (``params``, ...)."""
    state = view.get("state") if isinstance(view.get("state"), dict) else {}
    found = []
    regions = [("model", "params", {"params", "rest"}), ("optimizers", "opt_state", {"opt_state"})]
    for key, group, needs in regions:
        if groups & needs and isinstance(state.get(key), dict):
            found += [(("state", key, sub), f"{group}.{sub}", v) for sub, v in state[key].items()]
    if "algorithm_state" in groups and isinstance(state.get("algorithms"), dict):
        for algorithm, entry in state["algorithms"].items():
            device = entry.get("device", _MISSING) if isinstance(entry, dict) else _MISSING
            base = ("state", "algorithms", algorithm, "device")
            if isinstance(device, dict):
                found += [((*base, sub), f"algorithm_state.{algorithm}.{sub}", v) for sub, v in device.items()]
            elif device is not _MISSING:
                found.append((base, f"algorithm_state.{algorithm}", device))
    clock = lookup(view, ("state", "timestamp", "clock"))
    if "clock" in groups and clock is not _MISSING:
        found.append((("state", "timestamp", "clock"), "clock", clock))
    return [(path, getattr(v, "name", name) if isinstance(v, SavedArray) else name, v) for path, name, v in found]


def plan_arrays(view: dict[str, Any], saved: dict[str, SavedArray], target: dict[str, Any], groups: set[str],
                strict_model_weights: bool = True) -> ArrayPlan:
    """Match what is left of a checkpoint's view (after ``load_ignore_keys``) with the run's arrays.

    Args:
        view: the state dict (:func:`build_view`), as ``load_ignore_keys`` left it.
        saved: every array of the checkpoint before the edits (orbax name -> :class:`SavedArray`).
        target: the run's arrays to fill (orbax name -> array), excluded algorithms left out.
        groups: the train-state groups this load covers (``params``, ``rest`` for weights only).
        strict_model_weights: model names must match exactly; False keeps what both have.

    Example:
        >>> import numpy as np
        >>> saved = {"params.w": SavedArray("params.w", (2,), "float32")}
        >>> plan = plan_arrays(build_view(saved, {}, []), saved, {"params.w": np.zeros(2), "params.b": np.zeros(1)},
        ...                    {"params"}, strict_model_weights=False)
        >>> list(plan.values), plan.missing, plan.problems
        (['params.w'], ['params.b'], [])
    """
    values, ignored, missing = {}, [], []
    for name in target:
        value = lookup(view, view_path(name))
        if value is _MISSING:
            (ignored if name in saved else missing).append(name)
        else:
            values[name] = value
    targets = {view_path(name) for name in target}
    unexpected = {name: value for path, name, value in _array_entries(view, groups) if path not in targets}
    dropped_missing = [n for n in missing if _model(n)] if not strict_model_weights else []
    dropped_unexpected = [n for n in unexpected if _model(n)] if not strict_model_weights else []
    missing = [n for n in missing if n not in dropped_missing]
    for name in dropped_unexpected:
        del unexpected[name]
    problems = [f"{name}: the value at {'/'.join(view_path(name))} is a {type(value).__name__}, not an array"
                for name, value in values.items() if not is_array(value)]
    offered = {name: (tuple(np.shape(value)),) for name, value in values.items() if is_array(value)}
    offered.update({name: (tuple(np.shape(value)),) for name, value in unexpected.items() if is_array(value)})
    order = [name for name in saved if name in offered] + [name for name in offered if name not in saved]
    expected = {name: (tuple(np.shape(target[name])),) for name in target if name in values or name in missing}
    problems += compare_named({name: offered[name] for name in order}, expected)
    return ArrayPlan(values, ignored, dropped_missing, dropped_unexpected, problems)


def load_into(writer: Any, state: Any, info: CheckpointInfo, host: dict[str, Any], options: LoadOptions,
              where: str) -> ArrayPlan:
    """Load checkpoint ``info`` into ``state`` as ``options`` say; nothing changes before every check passed.

    Args:
        writer: the orbax checkpointer that reads (``Checkpointer.writer``).
        state: the run to load into; its device state gives the names, shapes and shardings.
        info: the checkpoint.
        host: its host record (``Checkpointer.read_host``).
        options: the load options.
        where: how errors name the checkpoint (``"load_path='...': checkpoint ep1-ba8"``).

    Returns:
        What was loaded (:class:`ArrayPlan`).

    Raises:
        CheckpointMismatchError: the checkpoint does not fit (every difference is listed).
        CheckpointCorruptError: it cannot be read back as written (missing item, unreadable file, checksum).
    """
    weights_only = options.weights_only
    if host.get("weights_only", False) and not weights_only:
        raise CheckpointMismatchError(
            f"{where} holds weights only (saved with save_weights_only=True); pass load_weights_only=True to load "
            "its weights, or point at a full checkpoint to resume")
    tree = array_tree(writer, info, where)
    saved = {name: SavedArray(name, tuple(leaf.shape), str(np.dtype(leaf.dtype)))
             for name, leaf in named_leaves(tree).items()}
    groups = set(MODEL_KEYS) if weights_only else set(_GROUPS)
    current = state.train_state
    every = {name: leaf for name, leaf in named_leaves(current._asdict()).items() if isinstance(leaf, jax.Array)}

    def kept(name: str) -> bool:
        group, _, rest = name.partition(".")
        return group in groups and not (group == "algorithm_state" and options.excludes(rest.split(".")[0]))

    target = {name: leaf for name, leaf in every.items() if kept(name)}
    run_algorithms = [algorithm.name for algorithm in state.algorithms]
    view, read = _view(saved, host, run_algorithms, options), {}
    if callable(options.ignore_keys):  # it may read and change the values: read them first
        read = read_arrays(writer, info, {n: _spec(every.get(n), saved[n]) for n in saved if kept(n)}, host, where)
        view = _view({**saved, **read}, host, run_algorithms, options)
        options.ignore_keys(view)
    elif options.ignore_keys:
        glob_filter(options.ignore_keys)(view)
    plan = plan_arrays(view, saved, target, groups, options.strict_model_weights)
    problems = plan.problems
    if not problems and "opt_state" in groups and all(
            isinstance(plan.values.get(n), SavedArray) for n in target if n.startswith("opt_state")):
        structure = structure_problem({"opt_state": tree.get("opt_state")}, {"opt_state": current.opt_state})
        problems = [structure] if structure else []
    if problems:
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise CheckpointMismatchError(f"{where} does not fit this run's model, optimizer or algorithms (saved vs "
                                      "expected):\n  " + "\n  ".join(problems[:20]) + more)
    if plan.missing or plan.unexpected:
        warnings.warn(f"{where}: load_strict_model_weights=False: loaded the {len(plan.values)} arrays both have; "
                      f"missing from the checkpoint (kept as they are): {plan.missing}; not in this run (not "
                      f"loaded): {plan.unexpected}", UserWarning, stacklevel=3)
    wanted = {v.name: _spec(target[n], v) for n, v in plan.values.items() if isinstance(v, SavedArray)}
    read.update(read_arrays(writer, info, {n: s for n, s in wanted.items() if n not in read}, host, where))
    values = {n: read[v.name] if isinstance(v, SavedArray) else v for n, v in plan.values.items()}
    train_state = current._replace(**{group: _fill(getattr(current, group), group, values) for group in groups})
    if weights_only:
        state.train_state = train_state
        state.mark_model_stale()
    else:
        state.load_state_dict(_host_state(state, view, train_state, options))
    return plan


def _view(arrays: dict[str, Any], host: dict[str, Any], run_algorithms: list[str],
          options: LoadOptions) -> dict[str, Any]:
    view = build_view(arrays, host, run_algorithms)
    algorithms = view["state"].get("algorithms", {})
    for name in [name for name in algorithms if options.excludes(name)]:
        del algorithms[name]
    return view


def array_tree(writer: Any, info: CheckpointInfo, where: str) -> Any:
    """The saved arrays' metadata tree (names, shapes, dtypes), read without reading any array.

    Raises:
        CheckpointCorruptError: it cannot be read, or the checkpoint has no ``state`` item.
    """
    try:
        items = writer.metadata(info.path).item_metadata
        metadata = items.get("state") if items is not None else None
    except Exception as error:
        raise CheckpointCorruptError(f"{where}'s arrays cannot be listed: {first_line(error)}") from error
    if metadata is None:
        present = sorted(name for name in os.listdir(info.path) if not name.startswith("_"))
        raise CheckpointCorruptError(f"{where} is incomplete: its 'state' item (the arrays) is missing; the folder "
                                     f"holds {present}")
    return getattr(metadata, "tree", metadata)


def read_arrays(writer: Any, info: CheckpointInfo, wanted: dict[str, Any], host: dict[str, Any],
                where: str) -> dict[str, Any]:
    """Read the arrays ``wanted`` (orbax name -> target ``ShapeDtypeStruct``, or None for numpy), checksum-checked.

    Raises:
        CheckpointCorruptError: a file cannot be read, or an array differs from what was written.
    """
    if not wanted:
        return {}
    tree = array_tree(writer, info, where)

    def item_of(path: Any, leaf: Any) -> Any:
        name = path_of(path, ".")
        if leaf is None or name not in wanted:
            return None if leaf is None else ocp.PLACEHOLDER
        return wanted[name] if wanted[name] is not None else jax.ShapeDtypeStruct(leaf.shape, leaf.dtype)

    def restore_args(spec: Any) -> Any:
        if spec is None:
            return None
        if spec is ocp.PLACEHOLDER:
            return ocp.RestoreArgs()
        if getattr(spec, "sharding", None) is None:
            return ocp.RestoreArgs(restore_type=np.ndarray)
        return ocp.ArrayRestoreArgs(sharding=spec.sharding, global_shape=spec.shape, dtype=spec.dtype)

    is_end = lambda x: x is None or x is ocp.PLACEHOLDER or is_array(x)  # noqa: E731
    item = jax.tree_util.tree_map_with_path(item_of, tree, is_leaf=is_end)
    args = jax.tree.map(restore_args, item, is_leaf=is_end)
    try:
        restored = writer.restore(info.path, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
            item=item, restore_args=args)))["state"]
    except Exception as error:
        raise CheckpointCorruptError(f"{where}'s arrays cannot be read: {first_line(error)}") from error
    values = {name: leaf for name, leaf in named_leaves(restored).items() if name in wanted}
    saved_sums = host.get("checksums")
    if saved_sums is not None:
        on_devices = {n: v for n, v in values.items() if isinstance(v, jax.Array)}
        read_sums = {**checksums(on_devices),
                     **checksums({n: jnp.asarray(v) for n, v in values.items() if n not in on_devices})}
        bad = [name for name, value in read_sums.items() if name in saved_sums and saved_sums[name] != value]
        if bad:
            raise CheckpointCorruptError(f"{where} is corrupt: {len(bad)} array(s) read back differ from what was "
                                         f"written (checksum): {', '.join(bad[:5])}")
    return values


def _host_state(state: Any, view: dict[str, Any], train_state: Any, options: LoadOptions) -> dict[str, Any]:
    """``State.load_state_dict``'s input from what is left of the view; parts left out stay as they are."""
    saved = view.get("state") if isinstance(view.get("state"), dict) else {}
    timestamp = {key: value for key, value in (saved.get("timestamp") or {}).items() if key != "clock"}
    algorithms = saved.get("algorithms") or {}
    callbacks = saved.get("callbacks") or {}
    rng = view.get("rng")

    def algorithm_state(algorithm: Any) -> Any:
        entry = algorithms.get(algorithm.name)
        if options.excludes(algorithm.name) or not isinstance(entry, dict) or "host" not in entry:
            return algorithm.state_dict()
        return entry["host"]

    return {
        "train_state": train_state,
        "rng": np.asarray(jax.random.key_data(state.rng) if rng is None else rng, np.uint32),
        "timestamp": {**state.timestamp.state_dict(), **timestamp},
        "dataloader": saved.get("dataset_state"),
        "algorithms": [algorithm_state(algorithm) for algorithm in state.algorithms],
        "callbacks": list(callbacks.values()),
        "callback_names": list(callbacks),
        "run_name": saved.get("run_name", state.run_name),
    }


def named_leaves(tree: Any) -> dict[str, Any]:
    """``{'params.layers.0.kernel': leaf}``: every array (or array metadata) leaf, named as orbax names it.

    Example:
        >>> named_leaves({"params": {"w": np.zeros(2)}, "clock": np.zeros(2)}).keys()
        dict_keys(['clock', 'params.w'])
    """
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_array)[0]
    return {path_of(path, "."): leaf for path, leaf in flat if is_array(leaf)}


def _fill(tree: Any, group: str, values: dict[str, Any]) -> Any:
    """``tree`` (train-state group ``group``) with the leaves ``values`` names replaced, on their shardings."""
    def fill(path: Any, leaf: Any) -> Any:
        name = f"{group}.{path_of(path, '.')}" if path else group
        return _place(values[name], leaf) if name in values else leaf

    return jax.tree_util.tree_map_with_path(fill, tree)


def _spec(target: Any, saved: SavedArray) -> jax.ShapeDtypeStruct | None:
    """Read a saved array straight onto the run's sharding when the run has it at that shape; else to numpy."""
    if isinstance(target, jax.Array) and tuple(target.shape) == tuple(saved.shape):
        return jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=target.sharding)
    return None


def _place(value: Any, like: Any) -> Any:
    if not isinstance(like, jax.Array):
        return value
    if getattr(value, "dtype", like.dtype) != like.dtype:
        value = jnp.asarray(value).astype(like.dtype)
    if isinstance(value, jax.Array) and value.sharding == like.sharding:
        return value
    return jax.device_put(value, like.sharding)
