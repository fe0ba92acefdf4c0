"""SpeedMonitor: rates, FLOPs, MFU and wall-clock time against a fake clock, so every number is exact."""

from __future__ import annotations

import optax
import pytest

from composerjax import ArrayLoader, Callback, State, Trainer
from composerjax.callbacks import speed_monitor
from composerjax.callbacks.speed_monitor import SpeedMonitor, peak_flops_per_device
from composerjax.loggers import InMemoryLogger, Logger

BATCH_SECONDS = 0.25
EVAL_SECONDS = 1.0


class FakeClock:
    """A clock that only moves when the test says so (exact binary fractions: no rounding)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class AdvanceClock(Callback):
    """Listed before the SpeedMonitor: each batch takes BATCH_SECONDS, each evaluation EVAL_SECONDS."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def batch_end(self, state, logger):
        self.clock.now += BATCH_SECONDS

    def eval_end(self, state, logger):
        self.clock.now += EVAL_SECONDS


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(speed_monitor, "perf_counter", fake)
    return fake


def run(clock, classification_arrays, make_tiny_classifier, monitor, **kwargs) -> tuple[Trainer, InMemoryLogger]:
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), optimizers=optax.sgd(0.1),
                      callbacks=[AdvanceClock(clock), monitor], loggers=[memory], progress_bar=False,
                      run_summary=False, **kwargs)
    trainer.fit()
    return trainer, memory


def test_rates_flops_and_mfu_over_the_window(clock, classification_arrays, make_tiny_classifier):
    trainer, memory = run(clock, classification_arrays, make_tiny_classifier,
                          SpeedMonitor(window_size=4, gpu_flops_available=1e6), max_duration="2ep")
    state = trainer.state
    [record] = state.compiled_steps
    assert record.kind == "train" and record.flops > 0
    assert state.run_summary["flops_per_step"] == record.flops

    # The first window closes at batch 5 (batch 1, with the compile, only opens it).
    assert memory.data["throughput/batches_per_sec"] == [(b, 1 / BATCH_SECONDS) for b in (5, 6, 7, 8)]
    assert memory.data["throughput/samples_per_sec"] == [(b, 16 / BATCH_SECONDS) for b in (5, 6, 7, 8)]
    assert memory.data["throughput/device/samples_per_sec"] == [(b, 16 / BATCH_SECONDS) for b in (5, 6, 7, 8)]
    flops_per_sec = record.flops / BATCH_SECONDS
    assert [v for _, v in memory.data["throughput/flops_per_sec"]] == pytest.approx([flops_per_sec] * 4, rel=1e-12)
    assert [v for _, v in memory.data["throughput/device/mfu"]] == pytest.approx([flops_per_sec / 1e6] * 4, rel=1e-12)
    assert "throughput/tokens_per_sec" not in memory.data  # the classifier's batches count no tokens
    # Composer's default unit: hours.
    assert memory.data["time/train"] == [(b, BATCH_SECONDS * b / 3600) for b in range(1, 9)]
    assert trainer.compile_count == 1


def test_no_mfu_without_a_known_peak_on_cpu(clock, classification_arrays, make_tiny_classifier):
    _, memory = run(clock, classification_arrays, make_tiny_classifier, SpeedMonitor(window_size=2),
                    max_duration="4ba")
    assert len(memory.data["throughput/flops_per_sec"]) == 2
    assert "throughput/device/mfu" not in memory.data


def test_evaluation_time_is_left_out_of_training_time_and_rates(clock, classification_arrays,
                                                                make_tiny_classifier):
    x, y = classification_arrays
    _, memory = run(clock, classification_arrays, make_tiny_classifier,
                    SpeedMonitor(window_size=2, time_unit="seconds"), max_duration="2ep",
                    eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False))
    # One evaluation after epoch 1 (batch 4); the window over batches 4-6 spans it.
    assert memory.data["time/train"][-1] == (8, 8 * BATCH_SECONDS)
    assert dict(memory.data["time/val"])[4] == 0.0
    assert dict(memory.data["time/val"])[5] == EVAL_SECONDS
    assert dict(memory.data["time/total"])[5] == 5 * BATCH_SECONDS + EVAL_SECONDS
    assert set(v for _, v in memory.data["throughput/batches_per_sec"]) == {1 / BATCH_SECONDS}


def test_tokens_per_sec_from_the_timestamp(clock):
    state = State(model=None)
    memory = InMemoryLogger()
    logger = Logger(state, [memory])
    monitor = SpeedMonitor(window_size=2)
    monitor.fit_start(state, logger)
    for _ in range(3):
        clock.now += 0.5
        state.timestamp = state.timestamp.to_next_batch(samples=4, tokens=512)
        monitor.batch_end(state, logger)
    assert memory.data["throughput/tokens_per_sec"] == [(3, 1024.0)]
    assert memory.data["throughput/samples_per_sec"] == [(3, 8.0)]
    assert "throughput/flops_per_sec" not in memory.data  # nothing compiled: FLOPs unknown


def test_peak_lookup_and_state_dict():
    assert peak_flops_per_device("NVIDIA H100 80GB HBM3", "bf16") == 989.5e12
    assert peak_flops_per_device("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops_per_device("NVIDIA H200", "fp32") == 494.5e12
    assert peak_flops_per_device("NVIDIA A10G", "bf16") is None
    assert peak_flops_per_device("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_flops_per_device("TPU v5", "bf16") == 459e12
    monitor = SpeedMonitor()
    monitor.load_state_dict({"train_wct": 3.5, "eval_wct": 1.0})
    assert monitor.state_dict() == {"train_wct": 3.5, "eval_wct": 1.0}


@pytest.mark.parametrize("kwargs, message", [
    ({"window_size": 0}, "window_size=0"),
    ({"gpu_flops_available": -1.0}, "gpu_flops_available=-1.0"),
    ({"time_unit": "weeks"}, "time_unit='weeks'"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SpeedMonitor(**kwargs)

