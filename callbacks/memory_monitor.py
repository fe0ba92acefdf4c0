"""MemoryMonitor: log device memory (where the backend reports it) and the host process's resident memory."""

from __future__ import annotations

import resource
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from composerjax import Callback, Logger, State
from composerjax.parallel import dist

__all__ = ["DEVICE_MEMORY_KEYS", "MemoryMonitor", "aggregate_over_processes", "device_memory", "host_memory"]

#: The allocator statistics logged by default (``jax.Device.memory_stats()`` keys on GPUs and TPUs).
DEVICE_MEMORY_KEYS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit", "bytes_reserved", "largest_alloc_size")


def host_memory() -> dict[str, int]:
    """The resident set size of this process and its peak, in bytes.

    Read from ``/proc/self/status`` (``VmRSS``, ``VmHWM``) on Linux; elsewhere only the peak is
    known, from ``resource.getrusage``.

    Example:
        >>> host_memory()['host_peak_rss_bytes'] > 0
        True
    """
    found: dict[str, int] = {}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    name = "host_rss_bytes" if line.startswith("VmRSS") else "host_peak_rss_bytes"
                    found[name] = int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    if "host_peak_rss_bytes" not in found:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        found["host_peak_rss_bytes"] = peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS
    return found


def device_memory(devices: Sequence[jax.Device], keys: Sequence[str] | Mapping[str, str] = DEVICE_MEMORY_KEYS,
                  ) -> dict[str, int]:
    """The largest value of each allocator statistic in ``keys`` over ``devices``; empty where none reports.

    ``keys`` lists ``memory_stats()`` keys, logged as ``device_<key>``, or maps each key to the name
    it is logged under (Composer's ``memory_keys`` form). CPU devices have no statistics
    (``memory_stats()`` is None), so on CPU the result is empty.

    Example:
        >>> device_memory(jax.devices('cpu'))
        {}
    """
    names = dict(keys) if isinstance(keys, Mapping) else {key: f"device_{key}" for key in keys}
    found: dict[str, int] = {}
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        for key, name in names.items():
            if stats and key in stats:
                found[name] = max(found.get(name, 0), int(stats[key]))
    return found


def aggregate_over_processes(values: dict[str, float], names: Sequence[str]) -> dict[str, float]:
    """``<name>_avg``, ``_min`` and ``_max`` of each value over every process (Composer's aggregation).

    A collective: every process calls it at the same batches. Each name in ``names`` is a slot every
    process fills (a value a process lacks is left out of that statistic); one process gives its own
    value three times.

    Example:
        >>> aggregate_over_processes({'host_rss_bytes': 10.0}, ['host_rss_bytes'])
        {'host_rss_bytes_avg': 10.0, 'host_rss_bytes_min': 10.0, 'host_rss_bytes_max': 10.0}
    """
    row = np.array([values.get(name, np.nan) for name in names], dtype=np.float64)
    table = dist.all_gather(row)
    aggregated: dict[str, float] = {}
    for column, name in enumerate(names):
        column_values = table[:, column][~np.isnan(table[:, column])]
        if column_values.size:
            aggregated[f"{name}_avg"] = float(column_values.mean())
            aggregated[f"{name}_min"] = float(column_values.min())
            aggregated[f"{name}_max"] = float(column_values.max())
    return aggregated


class MemoryMonitor(Callback):
    """Log device and host memory every ``interval`` batches, as ``memory/<name>`` in bytes.

    ==================================  ==========================================================
    ``memory/device_bytes_in_use``      bytes the allocator has handed out, largest over the
                                        process's devices (also ``peak_bytes_in_use``,
                                        ``bytes_limit``, ``bytes_reserved``, ``largest_alloc_size``
                                        where the backend reports them; none on CPU)
    ``memory/host_rss_bytes``           this process's resident set size (Linux)
    ``memory/host_peak_rss_bytes``      its peak resident set size
    ==================================  ==========================================================

    With ``dist_aggregate_batch_interval`` (Composer's), every that many batches each value also
    gets ``<name>_avg``, ``_min`` and ``_max`` over all processes (a collective at those batches).
    Reading the statistics does not wait for the device: the values are what the allocator holds
    when the host reaches ``BATCH_END``, with the device possibly a few steps behind.

    Args:
        memory_keys: the ``memory_stats()`` keys to log (default :data:`DEVICE_MEMORY_KEYS`), or
            Composer's form, a dict from each key to the name it is logged under.
        dist_aggregate_batch_interval: aggregate over processes every this many batches; None
            (Composer's default) never.
        interval: log every this many batches (Composer logs every batch; an int passed as the
            first positional argument is read as ``interval``, the earlier signature).

    Example::

        trainer = Trainer(model, train_loader, max_duration='1ep', callbacks=[MemoryMonitor(interval=50)])
    """

    def __init__(self, memory_keys: Sequence[str] | Mapping[str, str] | None = None,
                 dist_aggregate_batch_interval: int | None = None, interval: int = 10) -> None:
        if isinstance(memory_keys, int) and not isinstance(memory_keys, bool):
            memory_keys, interval = None, memory_keys  # the earlier signature: MemoryMonitor(50)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"MemoryMonitor(interval={interval!r}): expected a positive integer (batches)")
        valid_keys = (isinstance(memory_keys, Mapping) and all(isinstance(k, str) and isinstance(v, str)
                                                               for k, v in memory_keys.items())) or (
            isinstance(memory_keys, Sequence) and not isinstance(memory_keys, str)
            and all(isinstance(key, str) for key in memory_keys))
        if memory_keys is not None and not valid_keys:
            raise ValueError(f"MemoryMonitor(memory_keys={memory_keys!r}): expected a sequence of memory_stats() "
                             f"keys such as {list(DEVICE_MEMORY_KEYS)}, or a dict from such keys to logged names")
        if dist_aggregate_batch_interval is not None and (
                isinstance(dist_aggregate_batch_interval, bool) or not isinstance(dist_aggregate_batch_interval, int)
                or dist_aggregate_batch_interval < 1):
            raise ValueError(f"MemoryMonitor(dist_aggregate_batch_interval={dist_aggregate_batch_interval!r}): "
                             "expected a positive integer (batches) or None")
        self.interval = interval
        self.dist_aggregate_batch_interval = dist_aggregate_batch_interval
        if memory_keys is None:
            self.memory_keys: tuple[str, ...] | dict[str, str] = DEVICE_MEMORY_KEYS
        else:
            self.memory_keys = dict(memory_keys) if isinstance(memory_keys, Mapping) else tuple(memory_keys)
        self._devices: list[jax.Device] | None = None

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = state.timestamp.batch.value
        aggregate = self.dist_aggregate_batch_interval is not None and batch % self.dist_aggregate_batch_interval == 0
        if batch % self.interval and not aggregate:
            return
        if self._devices is None:
            mesh = state.mesh
            devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
            self._devices = [d for d in devices if d.process_index == jax.process_index()]
        metrics: dict[str, Any] = self.memory_metrics()
        if aggregate:
            metrics.update(aggregate_over_processes(metrics, self._slot_names()))
        logger.log_metrics({f"memory/{name}": value for name, value in metrics.items()})

    def _slot_names(self) -> list[str]:
        keys = self.memory_keys
        device_names = list(keys.values()) if isinstance(keys, dict) else [f"device_{key}" for key in keys]
        return device_names + ["host_rss_bytes", "host_peak_rss_bytes"]

    def memory_metrics(self) -> dict[str, Any]:
        """The current statistics (without the ``memory/`` prefix)."""
        devices = self._devices if self._devices is not None else jax.local_devices()
        return {**device_memory(devices, self.memory_keys), **host_memory()}
