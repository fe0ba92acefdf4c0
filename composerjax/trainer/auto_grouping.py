"""``steps_per_call='auto'``: time a few single steps, then group batches when the host's work dominates a step."""

from __future__ import annotations

from typing import Any

__all__ = ["AutoStepsPerCall"]


class AutoStepsPerCall:
    """Choose how many batches one compiled call runs, from the measured step time.

    After the first step has compiled, a window of ``window`` consecutive single steps is
    watched without ever waiting for the device: the wall time per batch, and how often the
    previous step had already finished (``is_ready()``) when the host came to queue the next.
    A device that is idle by then waits for the host: dispatch and the train loop dominate the
    step. When that happens for at least ``host_share`` of the window, batches are grouped by the
    power of two ``K`` that brings one call to about ``target_s`` of wall time (at most
    ``max_count``), provided the host time the rest of the run saves exceeds ``payback`` times the
    single step's compile time (a group is one more compile); otherwise the run stays per step.
    On CPU grouped steps are bit-identical to single ones, so the choice changes speed only. The
    choice is made once per trainer and kept in ``state.run_summary['steps_per_call']``.

    Args:
        window: single steps watched.
        target_s: wall seconds one grouped call should take.
        max_count: the most batches per call (bounded, so compiles stay few).
        host_share: the share of steps the device was idle waiting for from which grouping pays.
        payback: how many times its compile time grouping must save over the rest of the run.

    Example:
        >>> auto = AutoStepsPerCall()
        >>> auto.choose(seconds_per_step=2e-4, host_share=0.9, remaining=10_000, compile_seconds=0.5)
        32
        >>> auto.choose(seconds_per_step=2e-3, host_share=0.9, remaining=10_000, compile_seconds=0.5)
        8
        >>> auto.choose(seconds_per_step=0.02, host_share=0.1, remaining=10_000, compile_seconds=0.5)
        1
    """

    def __init__(self, window: int = 8, target_s: float = 0.02, max_count: int = 32, host_share: float = 0.5,
                 payback: float = 2.0) -> None:
        self.window, self.target_s, self.max_count, self.host_share = window, target_s, max_count, host_share
        self.payback = payback
        self.count: int | None = None  # None until decided
        self.reason: str | None = None  # why it was decided without measuring (decline)
        self.measured: tuple[float, float] = (0.0, 0.0)  # seconds per step, the share of steps the device idled
        self._idle: list[bool] = []
        self._start: float | None = None
        self._compiles = -1

    def choose(self, seconds_per_step: float, host_share: float, remaining: int, compile_seconds: float) -> int:
        """The batches per call for these measurements (1: no grouping)."""
        if host_share < self.host_share or seconds_per_step <= 0:
            return 1
        count = 1
        while count * 2 <= self.max_count and count * 2 * seconds_per_step <= self.target_s:
            count *= 2
        saved = remaining * host_share * seconds_per_step * (1 - 1 / count)
        return count if count > 1 and saved > self.payback * compile_seconds else 1

    def observe(self, state: Any, started: float, previous_done: bool) -> None:
        """A step began at ``started``, the one before it finished by then (or not); decide after a window."""
        if self.count is not None:
            return
        if state.compile_count != self._compiles:  # a compile restarts the window (its step is not typical)
            self._compiles, self._idle, self._start = state.compile_count, [], None
            return
        if self._start is None:
            self._start = started
            return
        self._idle.append(previous_done)
        if len(self._idle) < self.window:
            return
        per_step = (started - self._start) / len(self._idle)
        share = sum(self._idle) / len(self._idle)
        total = state.batches_in_duration()
        remaining = max(0, total - state.timestamp.counts.batch) if total else 0
        compiles = [record.compile_seconds for record in state.compiled_steps if record.kind == "train"]
        self.measured = (per_step, share)
        self.count = self.choose(per_step, share, remaining, compiles[-1] if compiles else 0.0)
        state.run_summary["steps_per_call"] = {"chosen": self.count, "step_ms": round(per_step * 1e3, 4),
                                               "host_share": round(share, 3)}

    def decline(self, state: Any, reason: str) -> None:
        """Decide for one batch per call without measuring, for ``reason`` (kept in the run summary)."""
        self.count, self.reason = 1, reason
        state.run_summary["steps_per_call"] = {"chosen": 1, "step_ms": None, "host_share": None, "reason": reason}

    def describe(self) -> str:
        """One line for the run's output, once decided."""
        if self.reason:
            return f"steps_per_call='auto': {self.count} per call ({self.reason})"
        per_step, share = self.measured
        return (f"steps_per_call='auto': {self.count} per call (a step took {per_step * 1e3:.3g} ms; the device "
                f"waited for the host at {share:.0%} of them)")
