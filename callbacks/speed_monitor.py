"""SpeedMonitor: training throughput (batches, samples, tokens, FLOPs per second), MFU and wall-clock time.

Throughput is measured with the host clock at ``BATCH_END``, without synchronising with the device.
JAX dispatches steps asynchronously, so one batch's host time is the time to *dispatch* it, not to
run it; over a window of batches the two agree as soon as the window is longer than the dispatch
queue. The trainer keeps that queue short (it fetches logged values every ``log_interval`` batches,
one interval behind the newest step), so windows of a few ``log_interval`` or more measure what the
device actually sustained.
"""

from __future__ import annotations

import re
from collections import deque
from time import perf_counter
from typing import Any

import jax

from composerjax import Callback, Logger, State
from composerjax.callbacks.runtime_estimator import TIME_UNITS

__all__ = ["PEAK_FLOPS", "SpeedMonitor", "peak_flops_per_device"]

#: Dense peak FLOP/s per JAX device, by a pattern on the lower-cased ``device_kind`` and the trainer's
#: precision. Checked in order (H200 before H100, A100 before A10). ``'fp32'`` on Ampere and newer GPUs
#: is the TF32 peak, as XLA runs float32 matmuls on TF32 tensor cores by default; on TPUs float32
#: matmuls run as bf16 passes by default, so both precisions get the bf16 peak.
PEAK_FLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"h200", {"fp32": 494.5e12, "bf16": 989.5e12}),
    (r"h100.*pcie", {"fp32": 378e12, "bf16": 756e12}),
    (r"h100", {"fp32": 494.5e12, "bf16": 989.5e12}),  # SXM
    (r"a100", {"fp32": 156e12, "bf16": 312e12}),
    (r"\ba10\b", {"fp32": 62.5e12, "bf16": 125e12}),
    (r"\bl4\b", {"fp32": 60e12, "bf16": 121e12}),
    (r"v100-sxm", {"fp32": 15.7e12}),
    (r"v100-pcie", {"fp32": 14e12}),
    (r"\bt4\b", {"fp32": 8.1e12}),
    (r"^tpu v4$", {"fp32": 275e12, "bf16": 275e12}),
    (r"^tpu v5 ?(lite|e)$", {"fp32": 197e12, "bf16": 197e12}),
    (r"^tpu v5p?$", {"fp32": 459e12, "bf16": 459e12}),
    (r"^tpu v6 ?(lite|e)$", {"fp32": 918e12, "bf16": 918e12}),
)


def peak_flops_per_device(device_kind: str, precision: str = "fp32") -> float | None:
    """Return the dense peak FLOP/s of one device of ``device_kind`` at ``precision``, or None if unknown.

    Example:
        >>> peak_flops_per_device('NVIDIA A100-SXM4-80GB', 'bf16')
        312000000000000.0
        >>> peak_flops_per_device('TPU v5 lite', 'bf16')
        197000000000000.0
        >>> peak_flops_per_device('cpu') is None
        True
    """
    kind = device_kind.strip().lower()
    for pattern, peaks in PEAK_FLOPS:
        if re.search(pattern, kind):
            return peaks.get(precision)
    return None


class SpeedMonitor(Callback):
    """Log throughput over a window of batches, FLOPs per second and MFU, and wall-clock time.

    Once ``window_size + 1`` batches have ended, every ``BATCH_END`` logs the rates over the last
    ``window_size`` batches (the first batch, which includes compiling the step, only opens the
    first window):

    ================================  =============================================================
    ``throughput/batches_per_sec``    batches per second over the window
    ``throughput/samples_per_sec``    samples per second (global: all processes)
    ``throughput/tokens_per_sec``     tokens per second, from ``state.timestamp.token``; logged only
                                      when tokens are counted
    ``throughput/flops_per_sec``      FLOPs of the compiled train step (XLA's cost analysis,
                                      ``state.compiled_steps``) times batches per second
    ``throughput/device/*``           the rates above divided by the number of devices
    ``throughput/device/mfu``         ``flops_per_sec / (peak FLOP/s per device * devices)``; logged
                                      when the peak is known
    ================================  =============================================================

    Every ``BATCH_END`` also logs ``time/train`` (host time spent in ``fit`` outside evaluation),
    ``time/val`` (time in evaluation) and ``time/total``, in ``time_unit`` (Composer's names and units).

    The FLOPs of a batch are those of the most recently compiled train step variant; a run that
    switches between variants without recompiling (two plans both already compiled) is counted at
    the latest one's cost. XLA's cost analysis counts a loop body once, so with
    ``device_train_microbatch_size`` (a ``lax.scan`` over microbatches) FLOPs and MFU come out low.

    Args:
        window_size: the number of batches the rates are averaged over.
        gpu_flops_available: the peak FLOP/s of one device, for MFU. By default it is looked up in
            :data:`PEAK_FLOPS` from ``jax.devices()[0].device_kind`` and the trainer's precision;
            on CPUs and unknown devices MFU is not logged.
        time_unit: the unit of the ``time/*`` values: 'seconds', 'minutes', 'hours' (Composer's
            default) or 'days'.

    Example::

        trainer = Trainer(model, train_loader, max_duration='10ep',
                          callbacks=[SpeedMonitor(window_size=50)], loggers=[TensorboardLogger()])
    """

    #: After a grouped call (``steps_per_call``) each batch's BATCH_END runs with its own clock; the
    #: window's wall time is the group's, so rates over a window of at least one group are exact.
    accepts_grouped_batches = True

    def __init__(self, window_size: int = 100, gpu_flops_available: float | None = None,
                 time_unit: str = "hours") -> None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"SpeedMonitor(window_size={window_size!r}): expected a positive integer (batches)")
        if gpu_flops_available is not None and (
            isinstance(gpu_flops_available, bool)
            or not isinstance(gpu_flops_available, (int, float))
            or not gpu_flops_available > 0
        ):
            raise ValueError(f"SpeedMonitor(gpu_flops_available={gpu_flops_available!r}): expected a positive "
                             "number of FLOP/s per device, or None to look it up from the device kind")
        if time_unit not in TIME_UNITS:
            raise ValueError(f"SpeedMonitor(time_unit={time_unit!r}): expected one of {list(TIME_UNITS)}")
        self.time_unit = time_unit
        self._divider = TIME_UNITS[time_unit]
        self.window_size = window_size
        self.gpu_flops_available = gpu_flops_available
        # (training seconds, batch, sample, token, FLOPs so far, batches of unknown FLOPs so far) at the
        # last BATCH_ENDs; training seconds leave evaluation out, so a window across an eval is not
        # slowed by it, and running totals make every window a difference of two entries.
        self._history: deque[tuple[float, int, int, int, float, int]] = deque(maxlen=window_size + 1)
        self._flops_total = 0.0
        self._flops_unknown = 0
        self._peak: float | None = None
        self._devices = 1
        self._records_seen = 0
        self._step_flops: float | None = None
        self.train_wct = 0.0
        self.eval_wct = 0.0
        self._mark: float | None = None
        self._eval_start: float | None = None
        self._in_fit = False

    def fit_start(self, state: State, logger: Logger) -> None:
        mesh = state.mesh
        self._devices = int(mesh.devices.size) if mesh is not None else jax.device_count()
        if self.gpu_flops_available is not None:
            self._peak = float(self.gpu_flops_available)
        else:
            self._peak = peak_flops_per_device(jax.devices()[0].device_kind,
                                               "bf16" if "bf16" in state.precision else state.precision)
        self._history.clear()
        self._in_fit = True
        self._mark = perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        now = perf_counter()
        if self._mark is not None:
            self.train_wct += now - self._mark
        self._mark = now
        counts = state.timestamp.counts
        flops = self._flops_of_step(state)
        if flops is None:
            self._flops_unknown += 1
        else:
            self._flops_total += flops
        history = self._history
        history.append((self.train_wct, counts.batch, counts.sample, counts.token, self._flops_total,
                        self._flops_unknown))
        metrics: dict[str, float] = {}
        if len(history) == history.maxlen:
            metrics.update(self._rates())
        metrics["time/train"] = self.train_wct / self._divider
        metrics["time/val"] = self.eval_wct / self._divider
        metrics["time/total"] = (self.train_wct + self.eval_wct) / self._divider
        logger.log_metrics(metrics)

    def eval_start(self, state: State, logger: Logger) -> None:
        now = perf_counter()
        if self._mark is not None:
            self.train_wct += now - self._mark
            self._mark = None
        self._eval_start = now

    def eval_end(self, state: State, logger: Logger) -> None:
        now = perf_counter()
        if self._eval_start is not None:
            self.eval_wct += now - self._eval_start
            self._eval_start = None
        if self._in_fit:  # evaluation during fit: training time runs again from here
            self._mark = now

    def fit_end(self, state: State, logger: Logger) -> None:
        if self._mark is not None:
            self.train_wct += perf_counter() - self._mark
        self._mark = None
        self._in_fit = False

    def _rates(self) -> dict[str, float]:
        history = self._history
        first, last = history[0], history[-1]
        seconds = last[0] - first[0]
        if seconds <= 0:
            return {}
        devices = self._devices
        batches_per_sec = (last[1] - first[1]) / seconds
        samples_per_sec = (last[2] - first[2]) / seconds
        rates = {
            "throughput/batches_per_sec": batches_per_sec,
            "throughput/samples_per_sec": samples_per_sec,
            "throughput/device/batches_per_sec": batches_per_sec / devices,
            "throughput/device/samples_per_sec": samples_per_sec / devices,
        }
        tokens = last[3] - first[3]
        if tokens > 0:
            rates["throughput/tokens_per_sec"] = tokens / seconds
            rates["throughput/device/tokens_per_sec"] = tokens / seconds / devices
        if last[5] == first[5]:  # every batch of the window has known FLOPs
            flops_per_sec = (last[4] - first[4]) / seconds
            rates["throughput/flops_per_sec"] = flops_per_sec
            rates["throughput/device/flops_per_sec"] = flops_per_sec / devices
            if self._peak:
                rates["throughput/device/mfu"] = flops_per_sec / (self._peak * devices)
        return rates

    def _flops_of_step(self, state: State) -> float | None:
        """FLOPs of the latest compiled train step (looked up again only when a step compiles)."""
        records = state.compiled_steps
        if len(records) != self._records_seen:
            self._records_seen = len(records)
            train = [record for record in records if record.kind == "train"]
            if train:
                self._step_flops = train[-1].flops
            else:
                self._step_flops = state.run_summary.get("flops_per_step")
        return self._step_flops

    def state_dict(self) -> dict[str, Any]:
        return {"train_wct": self.train_wct, "eval_wct": self.eval_wct}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.train_wct = float(state["train_wct"])
        self.eval_wct = float(state["eval_wct"])
