"""``steps_per_call='auto'``: group batches when the compiled step's own cost says the host bounds it."""

from __future__ import annotations

from typing import Any

__all__ = ["AutoStepsPerCall", "DEVICE_RATES"]

#: Conservative sustained rates per platform, ``(FLOP/s, bytes/s)``: a step's compiled cost over these
#: estimates the device's share of a step. They are constants, so the estimate (and the choice) is the
#: same on a quiet machine and a busy one; they only need to tell a step of microseconds from one of
#: milliseconds, not to be exact.
DEVICE_RATES: dict[str, tuple[float, float]] = {
    "cpu": (1e11, 2e10),
    "gpu": (5e13, 2e12),
    "cuda": (5e13, 2e12),
    "rocm": (5e13, 2e12),
    "tpu": (1e14, 1e12),
}


class AutoStepsPerCall:
    """Choose how many batches one compiled call runs, from the first compiled step's cost analysis.

    The rule is a pure function of what XLA reports for the compiled step (its FLOPs and bytes
    accessed), the platform and the number of batches left, never of a wall-clock measurement,
    so the same job makes the same choice on a quiet machine and a busy one, and every process of
    a job the same choice. The device's share of a step is estimated as
    ``max(flops / flop_rate, bytes / byte_rate)`` with the platform's conservative rates
    (:data:`DEVICE_RATES`). When that is at most ``max_step_s`` (1 ms), the fixed per-batch host
    work (dispatch and the train loop, about ``host_step_s`` = 0.1 ms) is a real share of the
    step, so batches are grouped by the largest power of two ``K`` at most ``max_count`` with
    ``K * max(estimate, host_step_s) <= target_s`` (one call of about 20 ms), provided at least
    ``min_remaining`` batches are left to repay compiling the group. Otherwise the run stays per
    step. On CPU grouped steps are bit-identical to single ones, so the choice changes speed only.
    The choice is made once per trainer, at the first compiled train step, and kept in
    ``state.run_summary['steps_per_call']`` with the reason.

    Args:
        target_s: the wall time one grouped call is sized for.
        max_count: the most batches per call (bounded, so compiles stay few).
        max_step_s: the largest estimated device time per step that is still grouped.
        host_step_s: the per-batch host work grouping saves, as a floor on a step's time.
        min_remaining: the fewest batches left for which one more compile pays.
        rates: ``{platform: (FLOP/s, bytes/s)}`` overriding :data:`DEVICE_RATES`.

    Example:
        >>> auto = AutoStepsPerCall()
        >>> auto.choose(flops=1e5, bytes_accessed=1.2e5, platform="cpu", remaining=20_000)[0]
        32
        >>> auto.choose(flops=8e7, bytes_accessed=1e6, platform="cpu", remaining=20_000)[0]
        16
        >>> auto.choose(flops=4.2e8, bytes_accessed=4.2e7, platform="cpu", remaining=20_000)[0]
        1
        >>> auto.choose(flops=1e5, bytes_accessed=1.2e5, platform="cpu", remaining=100)[0]
        1
    """

    def __init__(self, target_s: float = 0.02, max_count: int = 32, max_step_s: float = 1e-3,
                 host_step_s: float = 1e-4, min_remaining: int = 2048,
                 rates: dict[str, tuple[float, float]] | None = None) -> None:
        self.target_s, self.max_count, self.max_step_s = target_s, max_count, max_step_s
        self.host_step_s, self.min_remaining = host_step_s, min_remaining
        self.rates = {**DEVICE_RATES, **(rates or {})}
        self.count: int | None = None  # None until decided
        self.reason: str | None = None

    def estimate(self, flops: float | None, bytes_accessed: float | None, platform: str) -> float | None:
        """Estimated device seconds of one step from its compiled cost (None: no cost analysis or rates)."""
        rates = self.rates.get(platform)
        if rates is None or flops is None:
            return None
        flop_rate, byte_rate = rates
        return max(flops / flop_rate, (bytes_accessed or 0.0) / byte_rate)

    def choose(self, flops: float | None, bytes_accessed: float | None, platform: str,
               remaining: int) -> tuple[int, str]:
        """``(batches per call, why)`` for a step of this compiled cost with ``remaining`` batches left."""
        seconds = self.estimate(flops, bytes_accessed, platform)
        if seconds is None:
            return 1, f"no cost analysis of the step on {platform}"
        work = f"a step's compiled cost is about {seconds * 1e3:.3g} ms of device work ({flops:.3g} FLOPs"
        work += f", {bytes_accessed:.3g} bytes)" if bytes_accessed is not None else ")"
        if seconds > self.max_step_s:
            return 1, f"{work}: over {self.max_step_s * 1e3:g} ms, the device bounds it"
        if remaining < self.min_remaining:
            return 1, f"{remaining} batches left: fewer than {self.min_remaining} do not repay compiling a group"
        floor = max(seconds, self.host_step_s)
        count = 1
        while count * 2 <= self.max_count and count * 2 * floor <= self.target_s:
            count *= 2
        if count == 1:
            return 1, f"{work}: one step already fills a {self.target_s * 1e3:g} ms call"
        return count, f"{work}: the host bounds it; {count} steps fill a call of about {self.target_s * 1e3:g} ms"

    def decide(self, state: Any, record: Any, platform: str) -> int:
        """Decide from the first compiled train step's ``record`` (a ``CompiledStep``); kept in the run summary."""
        total = state.batches_in_duration()
        remaining = max(0, total - state.timestamp.counts.batch) if total else 0
        self.count, self.reason = self.choose(record.flops, record.bytes_accessed, platform, remaining)
        seconds = self.estimate(record.flops, record.bytes_accessed, platform)
        state.run_summary["steps_per_call"] = {
            "given": "auto", "chosen": self.count, "reason": self.reason, "flops": record.flops,
            "bytes_accessed": record.bytes_accessed,
            "estimated_step_ms": None if seconds is None else round(seconds * 1e3, 6),
        }
        return self.count

    def decline(self, state: Any, reason: str) -> None:
        """Decide for one batch per call without estimating, for ``reason`` (kept in the run summary)."""
        self.count, self.reason = 1, reason
        state.run_summary["steps_per_call"] = {"given": "auto", "chosen": 1, "reason": reason, "flops": None,
                                               "bytes_accessed": None, "estimated_step_ms": None}

    def describe(self) -> str:
        """One line for the run's output, once decided."""
        return f"steps_per_call='auto': {self.count} per call ({self.reason})"
