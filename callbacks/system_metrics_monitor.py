"""System metrics monitor: CPU, host memory, load average and device memory, logged every interval."""

from __future__ import annotations

import os
import time
from typing import Any

import jax

from composerjax import Callback, Logger, State, Time, TimeUnit
from composerjax.core.time import parse_time

__all__ = ["SystemMetricsMonitor", "SystemSampler"]

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
    - ``sys/device<i>/bytes_in_use``, ``peak_bytes_in_use``, ``bytes_limit``: for each local device
      whose backend reports allocator statistics (GPUs and TPUs; not CPU).

    Metrics a platform cannot provide are left out. Reading them needs no device synchronisation.

    Example:
        >>> sampler = SystemSampler()
        >>> metrics = sampler.sample()
        >>> 'sys/load_avg_1m' in metrics and metrics['sys/process_rss_bytes'] > 0
        True
    """

    def __init__(self) -> None:
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
        metrics.update(_device_memory())
        return metrics

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


def _device_memory() -> dict[str, float]:
    metrics: dict[str, float] = {}
    for index, device in enumerate(jax.local_devices()):
        try:
            stats = device.memory_stats()
        except Exception:  # backends without allocator statistics raise or return None
            stats = None
        for name in _DEVICE_MEMORY_STATS:
            if stats and name in stats:
                metrics[f"sys/device{index}/{name}"] = float(stats[name])
    return metrics


class SystemMetricsMonitor(Callback):
    """Log CPU utilisation, host memory, load average and device memory every ``interval``.

    The metrics (see :class:`SystemSampler`) are read on the host at ``BATCH_END`` (or ``EPOCH_END``
    for an epoch interval) and logged with ``logger.log_metrics`` at the current batch. CPU
    utilisation is the average since the previous sample, so the first one (at ``FIT_START``
    sampling starts) covers the first interval.

    Args:
        interval: how often: a time string or Time in batches (``'10ba'``) or epochs (``'1ep'``); an
            int means batches.

    Example::

        from composerjax import Trainer
        from composerjax.callbacks.system_metrics_monitor import SystemMetricsMonitor

        trainer = Trainer(model, loader, max_duration='1ep', callbacks=[SystemMetricsMonitor('50ba')],
                          loggers=[TensorBoardLogger()])
    """

    def __init__(self, interval: int | str | Time = "10ba") -> None:
        self.interval = parse_time(interval, "interval", (TimeUnit.BATCH, TimeUnit.EPOCH), TimeUnit.BATCH, minimum=1,
                                   expected="a positive number of batches or epochs, such as '10ba', '1ep' or 10")
        self.sampler: SystemSampler | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self.sampler = SystemSampler()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit == TimeUnit.BATCH and state.timestamp.batch.value % self.interval.value == 0:
            self._log(state, logger)

    def epoch_end(self, state: State, logger: Logger) -> None:
        if self.interval.unit == TimeUnit.EPOCH and state.timestamp.epoch.value % self.interval.value == 0:
            self._log(state, logger)

    def _log(self, state: State, logger: Logger) -> None:
        if self.sampler is None:
            self.sampler = SystemSampler()
        logger.log_metrics(self.sampler.sample(), step=state.timestamp.batch.value)
