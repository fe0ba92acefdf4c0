"""MemoryMonitor: log device memory (where the backend reports it) and the host process's resident memory."""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence
from typing import Any

import jax

from composerjax import Callback, Logger, State

__all__ = ["DEVICE_MEMORY_KEYS", "MemoryMonitor", "device_memory", "host_memory"]

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


def device_memory(devices: Sequence[jax.Device], keys: Sequence[str] = DEVICE_MEMORY_KEYS) -> dict[str, int]:
    """The largest value of each allocator statistic in ``keys`` over ``devices``; empty where none reports.

    CPU devices have no statistics (``memory_stats()`` is None), so on CPU the result is empty.

    Example:
        >>> device_memory(jax.devices('cpu'))
        {}
    """
    found: dict[str, int] = {}
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        for key in keys:
            if stats and key in stats:
                found[f"device_{key}"] = max(found.get(f"device_{key}", 0), int(stats[key]))
    return found


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

    Reading the statistics does not wait for the device: the values are what the allocator holds
    when the host reaches ``BATCH_END``, with the device possibly a few steps behind.

    Args:
        interval: log every this many batches.
        memory_keys: the ``memory_stats()`` keys to log (default :data:`DEVICE_MEMORY_KEYS`).

    Example::

        trainer = Trainer(model, train_loader, max_duration='1ep', callbacks=[MemoryMonitor(interval=50)])
    """

    def __init__(self, interval: int = 10, memory_keys: Sequence[str] | None = None) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"MemoryMonitor(interval={interval!r}): expected a positive integer (batches)")
        if memory_keys is not None and (isinstance(memory_keys, str)
                                        or not all(isinstance(key, str) for key in memory_keys)):
            raise ValueError(f"MemoryMonitor(memory_keys={memory_keys!r}): expected a sequence of memory_stats() "
                             f"keys such as {list(DEVICE_MEMORY_KEYS)}")
        self.interval = interval
        self.memory_keys = tuple(memory_keys) if memory_keys is not None else DEVICE_MEMORY_KEYS
        self._devices: list[jax.Device] | None = None

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch.value % self.interval:
            return
        if self._devices is None:
            mesh = state.mesh
            devices = list(mesh.devices.flat) if mesh is not None else jax.local_devices()
            self._devices = [d for d in devices if d.process_index == jax.process_index()]
        logger.log_metrics({f"memory/{name}": value for name, value in self.memory_metrics().items()})

    def memory_metrics(self) -> dict[str, Any]:
        """The current statistics (without the ``memory/`` prefix)."""
        devices = self._devices if self._devices is not None else jax.local_devices()
        return {**device_memory(devices, self.memory_keys), **host_memory()}
