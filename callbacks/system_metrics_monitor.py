"""System metrics monitor: CPU, host memory, load average and device memory, logged every interval."""

from __future__ import annotations

import os
import time
from typing import Any

import jax
import numpy as np

from composerjax import Callback, Logger, State, Time, TimeUnit
from composerjax.core.time import parse_time
from composerjax.parallel import dist

__all__ = ["SystemMetricsMonitor", "SystemSampler", "device_memory_metrics"]

# The device allocator statistics worth a chart (XLA's names); others vary by backend.
_DEVICE_MEMORY_STATS = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")


class SystemSampler:
    """Read system metrics; CPU utilisation is measured between consecutive ``sample()`` calls.

    ``sample()`` returns host numbers under ``sys/...``:

    - ``sys/cpu_percent``: utilisation of all CPUs since the previous sample (0-100; psutil, or
      ``/proc/stat`` on Linux).
    - ``sys/process_cpu_percent``: this process's CPU time over the wall time since the previous
      sample (100 = one core busy; may exceed 100).
    - ``sys/memory_total_bytes``, ``sys/memory_available_bytes``, ``sys/memory_percent``: host memory
      (psutil, or ``/proc/meminfo``).
    - ``sys/process_rss_bytes``: this process's resident memory.
    - ``sys/load_avg_1m``, ``sys/load_avg_5m``, ``sys/load_avg_15m``: ``os.getloadavg()``.
    - ``sys/device<id>/bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit``: for each device whose
      backend reports allocator statistics (GPUs and TPUs; not CPU), or with ``log_all_data=False``
      only the min and max over devices (:func:`device_memory_metrics`). With ``gather``, the devices
      of every process (a collective every process must make at the same time).

    Metrics a platform cannot provide are left out. Reading them needs no device synchronisation.

    Example:
        >>> sampler = SystemSampler()
        >>> metrics = sampler.sample()
        >>> 'sys/load_avg_1m' in metrics and metrics['sys/process_rss_bytes'] > 0
        True
    """

    def __init__(self, log_all_data: bool = True, gather: bool = False) -> None:
        self.log_all_data = log_all_data
        self.gather = gather
        try:
            import psutil
        except ImportError:
            psutil = None
        self._psutil: Any = psutil
        self._process = psutil.Process() if psutil is not None else None
        self._last_process_cpu = _process_cpu_seconds()
        self._last_wall = time.perf_counter()
        self._last_cpu_times = self._cpu_times()

    def sample(self) -> dict[str, float]:
        """Return the current metrics (see the class docstring)."""
        metrics: dict[str, float] = {}
        metrics.update(self._cpu())
        metrics.update(self._memory())
        if hasattr(os, "getloadavg"):
            for window, value in zip(("1m", "5m", "15m"), os.getloadavg()):
                metrics[f"sys/load_avg_{window}"] = float(value)
        metrics.update(device_memory_metrics(self.device_memory(), self.log_all_data))
        return metrics

    def device_memory(self) -> dict[int, dict[str, float]]:
        """Allocator statistics by global device id: this process's devices, or every process's when gathering."""
        per_device = _device_memory()
        return _all_processes(per_device) if self.gather else per_device

    # -- CPU -------------------------------------------------------------------------------------
    def _cpu_times(self) -> tuple[float, float] | None:
        """(busy, total) CPU seconds of the whole machine so far, or None where unknown."""
        if self._psutil is not None:
            times = self._psutil.cpu_times()
            # Guest time is already counted in user/nice on Linux (psutil's own cpu_percent drops it too).
            total = sum(times) - getattr(times, "guest", 0.0) - getattr(times, "guest_nice", 0.0)
            idle = times.idle + getattr(times, "iowait", 0.0)
            return total - idle, total
        try:
            with open("/proc/stat", encoding="ascii") as stat:
                fields = [float(value) for value in stat.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        # user nice system idle iowait irq softirq steal (guest time is already in user/nice).
        total = sum(fields[:8])
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
        return total - idle, total

    def _cpu(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        now, process_cpu = time.perf_counter(), _process_cpu_seconds()
        wall = now - self._last_wall
        if wall > 0:
            metrics["sys/process_cpu_percent"] = 100.0 * (process_cpu - self._last_process_cpu) / wall
        self._last_wall, self._last_process_cpu = now, process_cpu
        cpu_times = self._cpu_times()
        if cpu_times is not None and self._last_cpu_times is not None:
            busy = cpu_times[0] - self._last_cpu_times[0]
            total = cpu_times[1] - self._last_cpu_times[1]
            if total > 0:
                metrics["sys/cpu_percent"] = min(max(100.0 * busy / total, 0.0), 100.0)
        self._last_cpu_times = cpu_times
        return metrics

    # -- memory ----------------------------------------------------------------------------------
    def _memory(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        if self._psutil is not None:
            memory = self._psutil.virtual_memory()
            total, available = float(memory.total), float(memory.available)
            metrics["sys/process_rss_bytes"] = float(self._process.memory_info().rss)
        else:
            meminfo = _meminfo()
            total, available = meminfo.get("MemTotal", 0.0), meminfo.get("MemAvailable", 0.0)
            rss = _process_rss_bytes()
            if rss is not None:
                metrics["sys/process_rss_bytes"] = rss
        if total > 0:
            metrics["sys/memory_total_bytes"] = total
            metrics["sys/memory_available_bytes"] = available
            metrics["sys/memory_percent"] = 100.0 * (total - available) / total
        return metrics


def _process_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


def _meminfo() -> dict[str, float]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    values: dict[str, float] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                name, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    values[name] = float(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except (OSError, ValueError):
        return {}
    return values


def _process_rss_bytes() -> float | None:
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            return float(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    # ru_maxrss is the peak, in kB on Linux: the best this platform offers.
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _device_memory() -> dict[int, dict[str, float]]:
    """Allocator statistics of every local device that reports them, by global device id."""
    per_device: dict[int, dict[str, float]] = {}
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # backends without allocator statistics raise or return None
            stats = None
        values = {name: float(stats[name]) for name in _DEVICE_MEMORY_STATS if stats and name in stats}
        if values:
            per_device[int(device.id)] = values
    return per_device


def device_memory_metrics(per_device: dict[int, dict[str, float]], log_all_data: bool) -> dict[str, float]:
    """Name the device statistics as logged: every device's, or (Composer's default) the min and max over devices.

    ``log_all_data=True`` gives ``sys/device<id>/<stat>`` for every device; ``False`` gives, for each
    statistic, ``sys/min_<stat>_device_<id>`` and ``sys/max_<stat>_device_<id>`` naming the devices
    that hold them (Composer's ``min_<metric>_rank_<r>``, per device since one process may drive several).

    Example:
        >>> device_memory_metrics({0: {'bytes_in_use': 5.0}, 1: {'bytes_in_use': 9.0}}, log_all_data=False)
        {'sys/min_bytes_in_use_device_0': 5.0, 'sys/max_bytes_in_use_device_1': 9.0}
    """
    if log_all_data:
        return {f"sys/device{device}/{name}": value for device, values in sorted(per_device.items())
                for name, value in values.items()}
    metrics: dict[str, float] = {}
    for name in _DEVICE_MEMORY_STATS:
        holders = [(values[name], device) for device, values in sorted(per_device.items()) if name in values]
        if holders:
            low, high = min(holders), max(holders, key=lambda item: (item[0], -item[1]))
            metrics[f"sys/min_{name}_device_{low[1]}"] = low[0]
            metrics[f"sys/max_{name}_device_{high[1]}"] = high[0]
    return metrics


def _all_processes(per_device: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """Every process's device statistics (a collective: all processes call it at the same batches)."""
    if jax.process_count() == 1:
        return per_device
    rows = np.full((len(jax.local_devices()), 1 + len(_DEVICE_MEMORY_STATS)), np.nan)
    for row, device in zip(rows, jax.local_devices()):
        row[0] = device.id
        for column, name in enumerate(_DEVICE_MEMORY_STATS, start=1):
            row[column] = per_device.get(int(device.id), {}).get(name, np.nan)
    gathered = dist.all_gather(rows).reshape(-1, rows.shape[1])
    return {int(row[0]): {name: float(value) for name, value in zip(_DEVICE_MEMORY_STATS, row[1:])
                          if not np.isnan(value)} for row in gathered if not np.all(np.isnan(row[1:]))}


class SystemMetricsMonitor(Callback):
    """Log CPU utilisation, host memory, load average and device memory every ``interval``.

    The metrics (see :class:`SystemSampler`) are read on the host at ``BATCH_END`` (or ``EPOCH_END``
    for an epoch interval) and logged with ``logger.log_metrics`` at the current batch. CPU
    utilisation is the average since the previous sample, so the first one (at ``FIT_START``
    sampling starts) covers the first interval.

    Args:
        log_all_data: log every device's memory statistics; by default (Composer's) only the min and
            max over the devices of all processes, with the device that holds each.
        interval: how often: a time string or Time in batches (``'10ba'``) or epochs (``'1ep'``); an
            int means batches. (Composer samples at every batch start; this is the one argument it
            does not have. A time passed as the first positional argument is read as ``interval``.)

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.system_metrics_monitor import SystemMetricsMonitor

        trainer = Trainer(model, loader, max_duration='1ep', callbacks=[SystemMetricsMonitor(interval='50ba')],
                          loggers=[TensorBoardLogger()])
    """

    def __init__(self, log_all_data: bool = False, interval: int | str | Time = "10ba") -> None:
        if not isinstance(log_all_data, bool) and isinstance(log_all_data, (int, str, Time)):
            log_all_data, interval = False, log_all_data  # the earlier signature: SystemMetricsMonitor('50ba')
        if not isinstance(log_all_data, bool):
            raise ValueError(f"SystemMetricsMonitor(log_all_data={log_all_data!r}): expected True or False")
        self.log_all_data = log_all_data
        self.interval = parse_time(interval, "interval", (TimeUnit.BATCH, TimeUnit.EPOCH), TimeUnit.BATCH, minimum=1,
                                   expected="a positive number of batches or epochs, such as '10ba', '1ep' or 10")
        self.sampler: SystemSampler | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self.sampler = self._new_sampler()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit == TimeUnit.BATCH and state.timestamp.batch.value % self.interval.value == 0:
            self._log(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit == TimeUnit.EPOCH and state.timestamp.epoch.value % self.interval.value == 0:
            self._log(state, logger)

    def _new_sampler(self) -> SystemSampler:
        return SystemSampler(log_all_data=self.log_all_data, gather=True)

    def _log(self, state: State, logger: Logger) -> None:
        if self.sampler is None:
            self.sampler = self._new_sampler()
        logger.log_metrics(self.sampler.sample(), step=state.timestamp.batch.value)
