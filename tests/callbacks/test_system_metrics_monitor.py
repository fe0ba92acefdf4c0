"""SystemMetricsMonitor: which system metrics are logged, when, and in what ranges."""

import os
import sys
import time

import optax
import psutil  # installed with orbax-checkpoint; the /proc fallback is tested by hiding it
import pytest

from composerjax import ArrayLoader, Callback, LoggerDestination, Trainer
from composerjax.callbacks import system_metrics_monitor
from composerjax.callbacks.system_metrics_monitor import SystemMetricsMonitor, SystemSampler

HOST_KEYS = {
    "sys/cpu_percent", "sys/process_cpu_percent", "sys/memory_total_bytes", "sys/memory_available_bytes",
    "sys/memory_percent", "sys/process_rss_bytes", "sys/load_avg_1m", "sys/load_avg_5m", "sys/load_avg_15m",
}


class MetricRecorder(LoggerDestination):
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, float]]] = []

    def log_metrics(self, metrics, step=None):
        if any(name.startswith("sys/") for name in metrics):
            self.rows.append((step, dict(metrics)))


class SlowBatches(Callback):
    """Make each batch take long enough for the kernel's CPU counters (10 ms ticks) to move."""

    def batch_end(self, state, logger):
        time.sleep(0.03)


def test_logs_system_metrics_every_interval_with_the_current_load_average(
        monkeypatch, classification_arrays, make_tiny_classifier):
    monkeypatch.setattr(os, "getloadavg", lambda: (1.5, 2.5, 3.5))
    x, y = classification_arrays
    recorder = MetricRecorder()
    Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
            optimizers=optax.sgd(0.1), callbacks=[SlowBatches(), SystemMetricsMonitor("2ba")], loggers=[recorder],
            progress_bar=False, run_summary=False).fit()
    assert [step for step, _ in recorder.rows] == [2, 4, 6]
    for _, metrics in recorder.rows:
        assert set(metrics) == HOST_KEYS  # no device keys: the CPU backend has no allocator statistics
        assert (metrics["sys/load_avg_1m"], metrics["sys/load_avg_5m"], metrics["sys/load_avg_15m"]) == (1.5, 2.5, 3.5)
        assert 0.0 <= metrics["sys/cpu_percent"] <= 100.0
        assert 0.0 < metrics["sys/memory_percent"] < 100.0
        assert 0 < metrics["sys/memory_available_bytes"] < metrics["sys/memory_total_bytes"]
        assert 0 < metrics["sys/process_rss_bytes"] < metrics["sys/memory_total_bytes"]
        assert metrics["sys/process_cpu_percent"] >= 0.0


def test_epoch_interval_logs_at_epoch_end(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    recorder = MetricRecorder()
    Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ep",
            callbacks=[SystemMetricsMonitor("1ep")], loggers=[recorder], progress_bar=False, run_summary=False).fit()
    assert [step for step, _ in recorder.rows] == [4, 8]


def test_cpu_percent_is_busy_over_total_time_between_samples(monkeypatch):
    readings = iter([(10.0, 100.0), (40.0, 160.0), (40.0, 160.0)])
    monkeypatch.setattr(SystemSampler, "_cpu_times", lambda self: next(readings))
    sampler = SystemSampler()
    assert sampler.sample()["sys/cpu_percent"] == 50.0  # 30 busy seconds of 60
    assert "sys/cpu_percent" not in sampler.sample()  # no CPU time passed: nothing to measure


def test_proc_fallback_without_psutil_reads_the_same_memory_total(monkeypatch):
    expected_total = float(psutil.virtual_memory().total)
    expected_rss = float(psutil.Process().memory_info().rss)
    monkeypatch.setitem(sys.modules, "psutil", None)  # `import psutil` now raises ImportError
    sampler = SystemSampler()
    time.sleep(0.05)
    metrics = sampler.sample()
    assert metrics["sys/memory_total_bytes"] == expected_total
    assert metrics["sys/process_rss_bytes"] == pytest.approx(expected_rss, rel=0.2)
    assert 0.0 <= metrics["sys/cpu_percent"] <= 100.0
    assert set(metrics) == HOST_KEYS


class FakeDevice:
    def __init__(self, id, stats):
        self.id, self.stats = id, stats

    def memory_stats(self):
        return self.stats


def test_device_memory_statistics_of_each_local_device(monkeypatch):
    devices = [FakeDevice(0, {"bytes_in_use": 5, "peak_bytes_in_use": 7, "bytes_limit": 100, "num_allocs": 3}),
               FakeDevice(1, None)]
    monkeypatch.setattr(system_metrics_monitor.jax, "local_devices", lambda: devices)
    metrics = SystemSampler().sample()
    assert {k: v for k, v in metrics.items() if "device" in k} == {
        "sys/device0/bytes_in_use": 5.0, "sys/device0/peak_bytes_in_use": 7.0, "sys/device0/bytes_limit": 100.0}


def test_composer_default_logs_min_and_max_over_devices_with_their_ids(monkeypatch):
    devices = [FakeDevice(0, {"bytes_in_use": 5, "peak_bytes_in_use": 9, "bytes_limit": 100}),
               FakeDevice(1, {"bytes_in_use": 8, "peak_bytes_in_use": 8, "bytes_limit": 100}),
               FakeDevice(2, {"bytes_in_use": 2, "peak_bytes_in_use": 9, "bytes_limit": 100})]
    monkeypatch.setattr(system_metrics_monitor.jax, "local_devices", lambda: devices)
    monitor = SystemMetricsMonitor()
    assert monitor.log_all_data is False
    metrics = monitor._new_sampler().sample()
    assert {k: v for k, v in metrics.items() if "device" in k} == {
        "sys/min_bytes_in_use_device_2": 2.0, "sys/max_bytes_in_use_device_1": 8.0,
        "sys/min_peak_bytes_in_use_device_1": 8.0, "sys/max_peak_bytes_in_use_device_0": 9.0,
        "sys/min_bytes_limit_device_0": 100.0, "sys/max_bytes_limit_device_0": 100.0}
    all_data = SystemMetricsMonitor(log_all_data=True)._new_sampler().sample()
    assert {k for k in all_data if "device" in k} == {f"sys/device{d}/{name}" for d in range(3) for name in
                                                       ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


@pytest.mark.parametrize("interval", ["0ba", "5sp", "soon", 0])
def test_invalid_interval_names_the_argument(interval):
    with pytest.raises(ValueError, match=f"interval={interval!r}"):
        SystemMetricsMonitor(interval)
    with pytest.raises(ValueError, match=f"interval={interval!r}"):
        SystemMetricsMonitor(interval=interval)
