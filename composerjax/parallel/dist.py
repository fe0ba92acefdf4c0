"""Multi-process helpers for host values: who am I, wait for the others, share and reduce numbers.

Every function works unchanged in a single process (identities and no-ops) and across the
processes of a ``jax.distributed`` run. The collectives (:func:`barrier`, :func:`broadcast`,
:func:`all_gather`, :func:`all_reduce`, :func:`reduce_metrics`) must be called by every process,
in the same order, with values of the same shapes and dtypes.

Values travel as JAX arrays: without ``jax_enable_x64``, 64-bit numbers travel as 32-bit ones
(results keep the dtype of the input, not its precision).

:func:`initialize` starts ``jax.distributed`` from explicit arguments, the variables set by
``composerjax launch``, or a detected cluster (SLURM, Open MPI, Kubernetes indexed jobs, TPU pods).
``import composerjax`` calls it by itself when ``COMPOSERJAX_COORDINATOR`` is set.

Example:
    >>> from composerjax.parallel import dist
    >>> dist.process_index(), dist.process_count(), dist.is_process_zero()
    (0, 1, True)
    >>> dist.all_reduce({'loss': 2.0, 'samples': 16}, op='sum')
    {'loss': 2.0, 'samples': 16}
    >>> dist.reduce_metrics({'loss/train': 0.5})
    {'loss/train': 0.5}
"""

from __future__ import annotations

import collections
import importlib.metadata
import importlib.util
import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

__all__ = [
    "agree_max",
    "REDUCE_OPS",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "detect_cluster",
    "initialize",
    "is_global_zero",
    "is_process_zero",
    "launched",
    "local_process_index",
    "node_rank",
    "process_count",
    "process_index",
    "reduce_metrics",
]

#: Environment variables ``composerjax launch`` sets in each process it starts.
COORDINATOR_ENV = "COMPOSERJAX_COORDINATOR"
NUM_PROCESSES_ENV = "COMPOSERJAX_NUM_PROCESSES"
PROCESS_ID_ENV = "COMPOSERJAX_PROCESS_ID"
DEVICES_PER_PROCESS_ENV = "COMPOSERJAX_DEVICES_PER_PROCESS"
LOCAL_RANK_ENV = "COMPOSERJAX_LOCAL_RANK"
NODE_RANK_ENV = "COMPOSERJAX_NODE_RANK"

#: Where the rank among the processes of one node is read from, first found wins.
LOCAL_RANK_VARIABLES = (LOCAL_RANK_ENV, "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "LOCAL_RANK")
#: Where the rank of this node is read from, first found wins.
NODE_RANK_VARIABLES = (NODE_RANK_ENV, "SLURM_NODEID", "GROUP_RANK", "NODE_RANK")

#: ``op`` of :func:`all_reduce` and :func:`reduce_metrics` -> reduction over the process axis.
REDUCE_OPS: dict[str, Callable[..., np.ndarray]] = {"sum": np.sum, "mean": np.mean, "max": np.max, "min": np.min}


# -- who am I --------------------------------------------------------------------------------------
def process_index() -> int:
    """This process's rank among all processes (``jax.process_index()``); 0 in a single process."""
    return jax.process_index()


def process_count() -> int:
    """The number of processes in the run (``jax.process_count()``); 1 in a single process."""
    return jax.process_count()


def is_process_zero() -> bool:
    """True on process 0, the one that writes files, prints summaries and logs; True in a single process.

    The one "am I process 0" check of composerjax: loggers, callbacks and the checkpointer ask it
    (``composerjax.loggers.is_process_zero`` and :func:`is_global_zero` are this function).

    Example:
        >>> is_process_zero()
        True
    """
    return jax.process_index() == 0


#: Another name for :func:`is_process_zero` (the same function).
is_global_zero = is_process_zero


def local_process_index() -> int:
    """This process's rank among the processes on its node.

    Read from the first of ``COMPOSERJAX_LOCAL_RANK`` (set by ``composerjax launch``),
    ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK`` and ``LOCAL_RANK`` that is set; 0 in a
    single process.

    Raises:
        RuntimeError: Several processes run and none of those variables is set.
        ValueError: The variable found is not a non-negative integer.
    """
    found = _rank_from_env(LOCAL_RANK_VARIABLES)
    if found is not None:
        return found
    if process_count() == 1:
        return 0
    raise RuntimeError(
        f"local_process_index(): {process_count()} processes run but none of {', '.join(LOCAL_RANK_VARIABLES)} "
        "is set; start the processes with `composerjax launch`, srun or mpirun, or set LOCAL_RANK in each"
    )


def node_rank() -> int:
    """The rank of this process's node (machine).

    Read from the first of ``COMPOSERJAX_NODE_RANK`` (set by ``composerjax launch``),
    ``SLURM_NODEID``, ``GROUP_RANK`` and ``NODE_RANK`` that is set; 0 when none is (one node).

    Raises:
        ValueError: The variable found is not a non-negative integer.
    """
    found = _rank_from_env(NODE_RANK_VARIABLES)
    return 0 if found is None else found


def _rank_from_env(names: tuple[str, ...]) -> int | None:
    for name in names:
        if os.environ.get(name, "").strip():
            return _env_int(name, minimum=0)
    return None


def _env_int(name: str, minimum: int) -> int:
    raw = os.environ[name]
    try:
        value = int(raw.strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"environment variable {name} must be an integer >= {minimum}, got {raw!r}")
    return value


# -- collectives -----------------------------------------------------------------------------------
def barrier(name: str = "barrier") -> None:
    """Wait until every process reaches the barrier with the same ``name``; no-op in a single process.

    Example:
        >>> barrier('checkpoint-saved')
    """
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


#: How long :func:`agree_max` waits for the slowest process (a peer still compiling is slow, not dead).
AGREE_TIMEOUT_S = 1800
_agree_rounds: collections.defaultdict[str, itertools.count] = collections.defaultdict(itertools.count)


def agree_max(name: str, values: Sequence[int]) -> tuple[int, ...]:
    """Every process's ``values``, combined elementwise by ``max``: the same tuple on every process.

    For decisions every process must take at the same point (stop here, save now). It goes through
    ``jax.distributed``'s coordination service (a key per process per round), never through the
    devices, so it does not wait for the steps in flight. Every process must call it the same
    number of times in the same order (rounds are numbered by call). One process: ``values`` as is.

    Raises:
        RuntimeError: a process did not answer within :data:`AGREE_TIMEOUT_S`, naming it.

    Example:
        >>> agree_max('stop', (0, 1))
        (0, 1)
    """
    values = tuple(int(v) for v in values)
    count = process_count()
    if count == 1:
        return values
    from jax._src import distributed

    client = distributed.global_state.client
    rank, round_ = process_index(), next(_agree_rounds[name])
    key = f"composerjax/agree/{name}/{{round}}/{{rank}}"
    client.key_value_set(key.format(round=round_, rank=rank), ",".join(map(str, values)))
    combined = list(values)
    for other in range(count):
        if other == rank:
            continue
        try:
            text = client.blocking_key_value_get(key.format(round=round_, rank=other), AGREE_TIMEOUT_S * 1000)
        except Exception as error:
            raise RuntimeError(f"agree_max({name!r}): process {other} did not answer round {round_} within "
                               f"{AGREE_TIMEOUT_S} s: {error}") from error
        combined = [max(a, int(b)) for a, b in zip(combined, text.split(","))]
    if round_ >= 2:  # every process has read round - 2 (each has finished round - 1): drop this one's key
        client.key_value_delete(key.format(round=round_ - 2, rank=rank))
    return tuple(combined)


def broadcast(value: Any, src: int = 0) -> Any:
    """Return process ``src``'s ``value`` on every process.

    ``value`` is a pytree of numpy arrays or Python scalars with the same structure, shapes and
    dtypes on every process (the non-source values only give the shapes). Python scalar leaves
    come back as Python scalars, array leaves as numpy arrays.

    Raises:
        ValueError: ``src`` is not a process index.

    Example:
        >>> broadcast({'lr': np.float32(0.5), 'seed': 7})
        {'lr': array(0.5, dtype=float32), 'seed': 7}
    """
    count = process_count()
    if isinstance(src, bool) or not isinstance(src, (int, np.integer)) or not 0 <= src < count:
        raise ValueError(f"broadcast: `src` must be a process index in [0, {count}) (process_count()={count}), "
                         f"got {src!r}")
    leaves, treedef = jax.tree.flatten(value)
    sendable = [_to_sendable(leaf) for leaf in leaves]
    if count > 1:
        from jax.experimental import multihost_utils

        sendable = multihost_utils.broadcast_one_to_all(sendable, is_source=process_index() == src)
    return jax.tree.unflatten(treedef, [_like(leaf, received) for leaf, received in zip(leaves, sendable)])


def all_gather(value: Any) -> Any:
    """Stack every process's ``value`` along a new leading axis, in process order.

    ``value`` is a pytree of numpy arrays or Python scalars with the same structure, shapes and
    dtypes on every process; each leaf comes back as a numpy array of shape
    ``(process_count(), *leaf.shape)`` and the leaf's dtype.

    Example:
        >>> all_gather({'rank': 0, 'xy': np.array([1.0, 2.0])})
        {'rank': array([0]), 'xy': array([[1., 2.]])}
    """
    leaves, treedef = jax.tree.flatten(value)
    sendable = [_to_sendable(leaf) for leaf in leaves]
    if process_count() > 1:
        from jax.experimental import multihost_utils

        gathered = multihost_utils.process_allgather(sendable, tiled=False)
    else:
        gathered = [array[None] for array in sendable]
    return jax.tree.unflatten(
        treedef, [np.asarray(stacked).astype(_dtype_of(leaf), copy=False) for leaf, stacked in zip(leaves, gathered)]
    )


def all_reduce(value: Any, op: str = "sum") -> Any:
    """Reduce ``value`` over processes with ``op`` ('sum', 'mean', 'max' or 'min'); same result on every process.

    ``value`` is a pytree of numpy arrays or Python scalars with the same structure, shapes and
    dtypes on every process; leaves are reduced elementwise. Python scalar leaves come back as
    Python scalars ('mean' of integers gives a float, as ``np.mean`` does).

    Raises:
        ValueError: ``op`` is not one of :data:`REDUCE_OPS`.

    Example:
        >>> all_reduce(np.array([1, 5]), op='max')
        array([1, 5])
        >>> all_reduce(3, op='mean')
        3.0
    """
    reduce = _reduce_op("all_reduce", op)
    leaves, treedef = jax.tree.flatten(value)
    gathered = all_gather(leaves)
    reduced = [reduce(stacked, axis=0) for stacked in gathered]
    return jax.tree.unflatten(treedef, [_like(leaf, result, keep_dtype=op != "mean")
                                        for leaf, result in zip(leaves, reduced)])


def reduce_metrics(metrics: Mapping[str, float], op: str = "mean") -> dict[str, float]:
    """Reduce a ``{name: number}`` dict over processes; every process must log the same names.

    Returns a dict with the same keys, in the caller's order, holding Python floats.

    Raises:
        ValueError: ``op`` is not one of :data:`REDUCE_OPS`, or the processes hold different
            metric names (the message names, per process, the names it lacks).

    Example:
        >>> reduce_metrics({'accuracy': 0.75, 'loss': 0.25}, op='max')
        {'accuracy': 0.75, 'loss': 0.25}
    """
    reduce = _reduce_op("reduce_metrics", op)
    names = list(metrics)
    if process_count() > 1:
        _check_same_names(sorted(names))
    ordered = sorted(names)
    values = np.asarray([float(metrics[name]) for name in ordered], dtype=np.float64)
    reduced = reduce(all_gather(values), axis=0)
    by_name = {name: float(result) for name, result in zip(ordered, reduced)}
    return {name: by_name[name] for name in names}


def _check_same_names(names: list[str]) -> None:
    """Raise ValueError naming what each process lacks when the processes hold different ``names``."""
    encoded = np.frombuffer("\n".join(names).encode(), dtype=np.uint8)
    longest = int(all_reduce(np.int32(encoded.size), op="max"))
    padded = np.zeros(longest + 1, dtype=np.uint8)  # + 1: never a zero-length array
    padded[: encoded.size] = encoded
    every = [set(row.tobytes().rstrip(b"\0").decode().split("\n")) - {""} for row in all_gather(padded)]
    union = set().union(*every)
    if all(held == union for held in every):
        return
    lacking = "; ".join(f"process {rank} lacks {sorted(union - held)}" for rank, held in enumerate(every)
                        if held != union)
    raise ValueError(f"reduce_metrics: every process must pass the same metric names; {lacking}")


def _reduce_op(caller: str, op: str) -> Callable[..., np.ndarray]:
    if op not in REDUCE_OPS:
        raise ValueError(f"{caller}: `op` must be one of {', '.join(map(repr, REDUCE_OPS))}, got {op!r}")
    return REDUCE_OPS[op]


def _dtype_of(leaf: Any) -> np.dtype:
    return np.asarray(leaf).dtype


def _to_sendable(leaf: Any) -> np.ndarray:
    """A numpy array that survives a device collective (booleans travel as int8)."""
    array = np.asarray(leaf)
    if array.dtype == np.bool_:
        return array.astype(np.int8)
    if array.dtype.kind not in "biufc":
        raise TypeError(f"only numbers and arrays of numbers can be shared across processes, got {leaf!r}")
    return array


def _like(leaf: Any, result: Any, keep_dtype: bool = True) -> Any:
    """``result`` in the form of ``leaf``: a Python scalar for a Python scalar, else a numpy array."""
    array = np.asarray(result)
    if keep_dtype:
        array = array.astype(_dtype_of(leaf), copy=False)
    if isinstance(leaf, (bool, int, float, complex)) and array.ndim == 0:
        return array.item()
    return array


# -- starting jax.distributed ----------------------------------------------------------------------
def launched() -> bool:
    """True when ``composerjax launch`` started this process (``COMPOSERJAX_COORDINATOR`` is set)."""
    return bool(os.environ.get(COORDINATOR_ENV, "").strip())


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_count: int | None = None,
) -> bool:
    """Start ``jax.distributed`` if this process is one of several; call before any JAX computation.

    Where the settings come from, first match wins:

    1. explicit arguments, else the ``COMPOSERJAX_COORDINATOR``, ``COMPOSERJAX_NUM_PROCESSES``,
       ``COMPOSERJAX_PROCESS_ID`` and ``COMPOSERJAX_DEVICES_PER_PROCESS`` variables set by
       ``composerjax launch`` (an argument overrides its variable);
    2. a cluster JAX detects by itself (:func:`detect_cluster`): ``jax.distributed.initialize()``
       with no arguments;
    3. nothing: a single process, nothing to do.

    On the CPU platform the cross-process collectives use gloo. Calling it again, or after
    ``jax.distributed`` was started elsewhere, does nothing.

    Args:
        coordinator_address: ``host:port`` of process 0's coordinator service.
        num_processes: How many processes take part.
        process_id: This process's rank in ``[0, num_processes)``.
        local_device_count: CPU devices per process (sets ``jax_num_cpu_devices``); only used on
            the CPU platform (choose GPUs with ``CUDA_VISIBLE_DEVICES``).

    Returns:
        True if this call started ``jax.distributed``.

    Raises:
        ValueError: Incomplete or invalid settings (the message names the argument or variable).
        RuntimeError: JAX's backend already runs, so ``jax.distributed`` can no longer start.

    Example:
        >>> initialize()  # no launcher, no cluster: a single process
        False
    """
    if jax.distributed.is_initialized():
        return False
    settings = _explicit_settings(coordinator_address, num_processes, process_id, local_device_count)
    if settings is not None:
        coordinator, count, rank, devices = settings
        _require_backend_not_started(f"{coordinator} as process {rank} of {count}")
        if _platform_is_cpu():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            if devices is not None:
                jax.config.update("jax_num_cpu_devices", devices)
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=count, process_id=rank)
        return True
    cluster = detect_cluster()
    if cluster is not None:
        _require_backend_not_started(f"the {cluster} cluster")
        if _platform_is_cpu():
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()
        return True
    return False


def _explicit_settings(
    coordinator_address: str | None, num_processes: int | None, process_id: int | None, local_device_count: int | None
) -> tuple[str, int, int, int | None] | None:
    """``(coordinator, count, rank, devices)`` from the arguments and launcher variables; None if neither gives any."""
    env = os.environ
    given = (coordinator_address, num_processes, process_id, local_device_count)
    launcher = (COORDINATOR_ENV, NUM_PROCESSES_ENV, PROCESS_ID_ENV, DEVICES_PER_PROCESS_ENV)
    if all(value is None for value in given) and not any(env.get(name, "").strip() for name in launcher):
        return None
    coordinator = coordinator_address if coordinator_address is not None else env.get(COORDINATOR_ENV, "").strip()
    missing = [f"`{arg}` (or {name})" for arg, value, name in (
        ("coordinator_address", coordinator, COORDINATOR_ENV),
        ("num_processes", num_processes if num_processes is not None else env.get(NUM_PROCESSES_ENV, "").strip(),
         NUM_PROCESSES_ENV),
        ("process_id", process_id if process_id is not None else env.get(PROCESS_ID_ENV, "").strip(), PROCESS_ID_ENV),
    ) if value is None or value == ""]
    if missing:
        raise ValueError(f"initialize: a multi-process start needs coordinator_address, num_processes and process_id; "
                         f"missing {', '.join(missing)}")
    if not isinstance(coordinator, str) or ":" not in coordinator:
        raise ValueError(f"initialize: `coordinator_address` must be 'host:port', got {coordinator!r}")
    count = _setting_int("num_processes", num_processes, NUM_PROCESSES_ENV, minimum=1)
    rank = _setting_int("process_id", process_id, PROCESS_ID_ENV, minimum=0)
    if rank >= count:
        raise ValueError(f"initialize: `process_id` must be in [0, num_processes={count}), got {rank}")
    devices = None
    if local_device_count is not None or env.get(DEVICES_PER_PROCESS_ENV, "").strip():
        devices = _setting_int("local_device_count", local_device_count, DEVICES_PER_PROCESS_ENV, minimum=1)
    return coordinator, count, rank, devices


def _setting_int(arg: str, value: Any, env_name: str, minimum: int) -> int:
    if value is None:
        return _env_int(env_name, minimum)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"initialize: `{arg}` must be an integer >= {minimum}, got {value!r}")
    return int(value)


def detect_cluster() -> str | None:
    """The multi-process cluster this process runs in, from its environment, or None.

    'slurm' (an srun step of more than one task), 'openmpi' (``mpirun -n`` > 1), 'kubernetes'
    (an indexed Job) or 'tpu' (a TPU pod of several hosts): the ones ``jax.distributed.initialize()``
    configures by itself.

    Example:
        >>> detect_cluster() is None  # a plain shell
        True
    """
    env = os.environ

    def more_than_one(name: str) -> bool:
        try:
            return int(env.get(name, "0")) > 1
        except ValueError:
            return False

    if env.get("SLURM_JOB_ID") and env.get("SLURM_PROCID") and more_than_one("SLURM_NTASKS"):
        return "slurm"
    if more_than_one("OMPI_COMM_WORLD_SIZE"):
        return "openmpi"
    if env.get("KUBERNETES_SERVICE_HOST") and env.get("JOB_COMPLETION_INDEX"):
        return "kubernetes"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([host for host in hosts.split(",") if host.strip()]) > 1:
        return "tpu"
    return None


def _platform_is_cpu() -> bool:
    """Whether JAX will run on CPU: JAX_PLATFORMS says cpu first, or no accelerator plugin is installed."""
    platforms = jax.config.jax_platforms or os.environ.get("JAX_PLATFORMS", "")
    if platforms.strip():
        return platforms.split(",")[0].strip().lower() == "cpu"
    if importlib.util.find_spec("libtpu") is not None or importlib.util.find_spec("jax_plugins") is not None:
        return False
    return not list(importlib.metadata.entry_points(group="jax_plugins"))


def _require_backend_not_started(target: str) -> None:
    try:
        from jax._src.xla_bridge import backends_are_initialized
    except ImportError:  # a JAX without it: jax.distributed.initialize raises its own error
        return
    if backends_are_initialized():
        raise RuntimeError(
            f"cannot join {target}: JAX's backend already started in this process (an array, a jax.devices() "
            "call or an NNX module was created before jax.distributed could be initialised). Import composerjax "
            "before creating any JAX array, or call composerjax.parallel.dist.initialize() first thing in the "
            "script."
        )
