"""MemoryMonitor: host RSS against a direct read, the logging interval, device statistics from a fake device."""

from __future__ import annotations

import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.callbacks.memory_monitor import MemoryMonitor, device_memory
from composerjax.loggers import InMemoryLogger


def vm_rss_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def test_logs_host_memory_every_interval_and_nothing_for_cpu_devices(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ep",
                      optimizers=optax.sgd(0.1), callbacks=[MemoryMonitor(interval=3)], loggers=[memory],
                      progress_bar=False, run_summary=False)
    trainer.fit()
    direct = vm_rss_bytes()
    assert [step for step, _ in memory.data["memory/host_rss_bytes"]] == [3, 6]
    logged = memory.data["memory/host_rss_bytes"][-1][1]
    assert abs(logged - direct) <= 0.05 * direct  # nothing big is allocated between the two reads
    peaks = [value for _, value in memory.data["memory/host_peak_rss_bytes"]]
    assert peaks[-1] >= logged and peaks == sorted(peaks)
    assert not any(name.startswith("memory/device_") for name in memory.data)  # CPU: no allocator stats


class FakeDevice:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_device_statistics_are_the_largest_over_devices():
    devices = [FakeDevice({"bytes_in_use": 10, "peak_bytes_in_use": 40, "num_allocs": 3}),
               FakeDevice({"bytes_in_use": 25, "peak_bytes_in_use": 30}), FakeDevice(None)]
    assert device_memory(devices) == {"device_bytes_in_use": 25, "device_peak_bytes_in_use": 40}
    assert device_memory(devices, ["num_allocs"]) == {"device_num_allocs": 3}
    # Composer's memory_keys form: statistic -> logged name.
    assert device_memory(devices, {"peak_bytes_in_use": "peak_mem"}) == {"peak_mem": 40}


def test_composer_signature_and_aggregation_of_one_process(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    memory = InMemoryLogger()
    Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="4ba",
            optimizers=optax.sgd(0.1), callbacks=[MemoryMonitor(None, 2, interval=4)], loggers=[memory],
            progress_bar=False, run_summary=False).fit()
    # Logged at batch 2 (aggregation) and 4 (interval and aggregation); one process: avg = min = max.
    assert [step for step, _ in memory.data["memory/host_rss_bytes_max"]] == [2, 4]
    for step, rss in memory.data["memory/host_rss_bytes"]:
        assert dict(memory.data["memory/host_rss_bytes_avg"])[step] == rss
        assert dict(memory.data["memory/host_rss_bytes_min"])[step] == rss


def test_memory_metrics_include_the_fake_devices():
    monitor = MemoryMonitor(memory_keys=["bytes_in_use"])
    monitor._devices = [FakeDevice({"bytes_in_use": np.int64(7)})]
    metrics = monitor.memory_metrics()
    assert metrics["device_bytes_in_use"] == 7 and type(metrics["device_bytes_in_use"]) is int
    assert metrics["host_rss_bytes"] > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"interval": 0}, "interval=0"),
    ({"memory_keys": "bytes_in_use"}, "memory_keys='bytes_in_use'"),
    ({"dist_aggregate_batch_interval": 0}, "dist_aggregate_batch_interval=0"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MemoryMonitor(**kwargs)
