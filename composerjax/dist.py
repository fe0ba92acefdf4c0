"""Moved to :mod:`composerjax.parallel.dist`; this module keeps the old import path working.

``from composerjax import dist`` and ``import composerjax.dist`` give the same functions and
constants as :mod:`composerjax.parallel.dist` (the module whose globals they read).

Example:
    >>> from composerjax import dist
    >>> from composerjax.parallel import dist as moved
    >>> dist.all_reduce is moved.all_reduce and dist.COORDINATOR_ENV == moved.COORDINATOR_ENV
    True
"""

from composerjax.parallel.dist import (
    AGREE_TIMEOUT_S,
    COORDINATOR_ENV,
    DEVICES_PER_PROCESS_ENV,
    LOCAL_RANK_ENV,
    LOCAL_RANK_VARIABLES,
    NODE_RANK_ENV,
    NODE_RANK_VARIABLES,
    NUM_PROCESSES_ENV,
    PROCESS_ID_ENV,
    REDUCE_OPS,
    agree_max,
    all_gather,
    all_reduce,
    barrier,
    broadcast,
    detect_cluster,
    initialize,
    is_global_zero,
    is_process_zero,
    launched,
    local_process_index,
    node_rank,
    process_count,
    process_index,
    reduce_metrics,
)

__all__ = [
    "AGREE_TIMEOUT_S",
    "COORDINATOR_ENV",
    "DEVICES_PER_PROCESS_ENV",
    "LOCAL_RANK_ENV",
    "LOCAL_RANK_VARIABLES",
    "NODE_RANK_ENV",
    "NODE_RANK_VARIABLES",
    "NUM_PROCESSES_ENV",
    "PROCESS_ID_ENV",
    "REDUCE_OPS",
    "agree_max",
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
