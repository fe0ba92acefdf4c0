"""Composer's stateless learning-rate schedulers, readable on the host and compiled into the train step.

Each scheduler returns a *multiplier* :math:`\\alpha(t)` of the optimizer's learning rate
(:math:`\\eta(t) = \\eta_i \\times \\alpha(t)`), with Composer's arguments, defaults and formulas.
It has two forms that give the same number at the same batch:

* ``scheduler(state, ssr=1.0)``: Composer's host API, read from ``state.timestamp``,
  ``state.max_duration`` and ``state.dataloader_len``;
* ``scheduler.multiplier(context)``: built once on the host from a :class:`ScheduleContext`, a pure
  jnp function of the optimizer step count for use inside the compiled step (no host work per batch).

Times may be in any unit (``'10ba'``, ``'2ep'``, ``'0.1dur'``, ``'5000sp'``, ``'1e6tok'``) and are
converted by Composer's rules (:func:`composerjax.optim.schedule_time.convert_time`); with a scale
schedule ratio ``ssr``, :math:`\\alpha_\\sigma(t) = \\alpha(t / \\sigma)`. The schedulers with a
warmup are in :mod:`composerjax.optim.warmup_scheduler`.

Example:
    >>> import jax.numpy as jnp
    >>> from composerjax.core.time import Time
    >>> multiplier = CosineAnnealingScheduler(t_max='100ba').multiplier(ScheduleContext(Time(100, 'ba')))
    >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 50, 100)]
    [1.0, 0.5, 0.0]
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from composerjax.core.time import Time
from composerjax.optim.schedule_time import (
    HostClock,
    ScheduleContext,
    StepClock,
    convert_time,
    restart_cycles,
)

__all__ = [
    "ComposerScheduler",
    "ConstantScheduler",
    "CosineAnnealingScheduler",
    "CosineAnnealingWarmRestartsScheduler",
    "ExponentialScheduler",
    "LinearScheduler",
    "MultiStepScheduler",
    "PolynomialScheduler",
    "StepScheduler",
]

Clock = HostClock | StepClock


def cosine_anneal(xp: Any, x: Any, min_y: float = 0.0, max_y: float = 1.0) -> Any:
    """cos on [0, pi] stretched to x in [0, 1] (clipped) and y in [min_y, max_y]."""
    x = xp.clip(x, 0.0, 1.0)
    return min_y + (max_y - min_y) * (1 + xp.cos(x * math.pi)) / 2


class ComposerScheduler:
    """A learning-rate multiplier as a function of training time; subclasses define ``_times`` and ``_alpha``.

    ``_times`` converts the scheduler's arguments (Composer's rules, with its checks) into a dict of
    Times; ``_alpha`` computes the multiplier from a clock and those times, with ``clock.xp`` (numpy
    on the host, jnp in the step) for the arithmetic, so both forms share one formula.
    """

    def __call__(self, state: Any, ssr: float = 1.0) -> float:
        """The multiplier at ``state.timestamp``, stretched by the scale schedule ratio ``ssr`` (Composer's API)."""
        times = self._times(state.max_duration, state.dataloader_len, ssr)
        return float(self._alpha(HostClock(state.timestamp), times))

    def multiplier(self, context: ScheduleContext) -> Callable[[jax.Array], jax.Array]:
        """A pure function of the optimizer step count returning this scheduler's multiplier (float32).

        Times are converted here, once, to the steps they span; a time the step count cannot
        measure (``sp`` without ``context.samples_per_step``, ``iter``) is refused here, naming the
        argument. The value at step ``n`` equals ``self(state, ssr)`` when ``state.timestamp`` is
        at batch ``n`` of the same run.

        Raises:
            ValueError: an argument that cannot be converted, or one of Composer's checks fails.
        """
        times = self._times(context.max_duration, context.steps_per_epoch, context.scale_schedule_ratio)
        for label, time in self._labelled(times):
            context.steps_per_unit(time.unit, f"{label} ({time} after conversion)")
        self._check_run(times, context)

        def multiplier(step: jax.Array) -> jax.Array:
            return jnp.asarray(self._alpha(StepClock(step, context), times), jnp.float32)

        return multiplier

    # -- for subclasses ---------------------------------------------------------------------------
    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        raise NotImplementedError

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        raise NotImplementedError

    def _check_run(self, times: dict[str, Any], context: ScheduleContext) -> None:
        """Checks that need the whole run (Composer would raise when the run got there)."""

    def _convert(self, argument: str, max_duration: Time | None, dataloader_len: int | None, ssr: float,
                 nonzero: bool = False) -> Time:
        value = getattr(self, argument)
        time = convert_time(value, max_duration, dataloader_len, ssr, field=self._label(argument))
        if nonzero and time.value == 0:
            raise ValueError(f"{self._label(argument)}: converts to {time}, and the schedule divides by it; use a "
                             "longer time")
        return time

    def _label(self, argument: str, index: int | None = None) -> str:
        value = getattr(self, argument)
        if index is None:
            return f"{type(self).__name__}({argument}={value!r})"
        return f"{type(self).__name__}({argument}[{index}]={value[index]!r})"

    def _labelled(self, times: dict[str, Any]) -> list[tuple[str, Time]]:
        found = []
        for key, value in times.items():
            argument = key.partition(".")[0]  # 't_warmup.scaled' is t_warmup's
            if isinstance(value, list):
                found += [(self._label(argument, index), time) for index, time in enumerate(value)]
            else:
                found.append((self._label(argument), value))
        return found

    def __repr__(self) -> str:
        arguments = ", ".join(f"{name}={getattr(self, name)!r}"
                              for name in inspect.signature(type(self).__init__).parameters if name != "self")
        return f"{type(self).__name__}({arguments})"


class StepScheduler(ComposerScheduler):
    r"""Decay the learning rate by ``gamma`` every ``step_size``: :math:`\alpha(t) = \gamma^{\lfloor t / \rho \rfloor}`.

    Args:
        step_size: time between changes, e.g. ``'10ba'``, ``'1ep'``.
        gamma: multiplicative decay factor.

    Example:
        >>> from composerjax.core.time import Time, Timestamp
        >>> from composerjax.core.state import State
        >>> state = State(model=None, max_duration='100ba')
        >>> state.timestamp = Timestamp(batch=25)
        >>> round(StepScheduler(step_size='10ba', gamma=0.5)(state), 6)
        0.25
    """

    def __init__(self, step_size: str | Time, gamma: float = 0.1) -> None:
        self.step_size = step_size
        self.gamma = gamma

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"step_size": self._convert("step_size", max_duration, dataloader_len, ssr, nonzero=True)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        return clock.xp.power(self.gamma, clock.multiples(times["step_size"]))


class MultiStepScheduler(ComposerScheduler):
    r"""Decay the learning rate by ``gamma`` at each milestone: :math:`\alpha(t) = \gamma^x`, x milestones reached.

    Args:
        milestones: times at which the learning rate changes.
        gamma: multiplicative decay factor.

    Example:
        >>> from composerjax.core.time import Timestamp
        >>> from composerjax.core.state import State
        >>> state = State(model=None, max_duration='100ba')
        >>> state.timestamp = Timestamp(batch=50)
        >>> round(MultiStepScheduler(milestones=['10ba', '30ba', '70ba'])(state), 6)
        0.01
    """

    def __init__(self, milestones: Sequence[str | Time], gamma: float = 0.1) -> None:
        self.milestones = list(milestones)
        self.gamma = gamma

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return milestone_times(self, max_duration, dataloader_len, ssr)

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        return milestone_factor(clock, times["milestones"], self.gamma)


def milestone_times(scheduler: ComposerScheduler, max_duration: Time | None, dataloader_len: int | None,
                     ssr: float) -> dict[str, Any]:
    milestones = scheduler.milestones  # type: ignore[attr-defined]
    return {"milestones": [convert_time(milestone, max_duration, dataloader_len, ssr,
                                        scheduler._label("milestones", index))
                           for index, milestone in enumerate(milestones)]}


def milestone_factor(clock: Clock, milestones: list[Time], gamma: float) -> Any:
    """gamma once per milestone reached, multiplied in turn as Composer does."""
    factor = 1.0
    for milestone in milestones:
        factor = factor * clock.xp.where(clock.before(milestone), 1.0, gamma)
    return factor


class ConstantScheduler(ComposerScheduler):
    r"""Hold the multiplier at ``alpha`` until ``t_max``, then 1: :math:`\alpha(t) = \alpha` if :math:`t < t_{max}`.

    Args:
        alpha: the multiplier while this scheduler is active.
        t_max: how long it is active.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = ConstantScheduler(alpha=0.5, t_max='4ba').multiplier(ScheduleContext(Time(8, 'ba')))
        >>> [float(multiplier(jnp.int32(step))) for step in (0, 3, 4)]
        [0.5, 0.5, 1.0]
    """

    def __init__(self, alpha: float = 1.0, t_max: str | Time = "1dur") -> None:
        self.alpha = alpha
        self.t_max = t_max

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"t_max": self._convert("t_max", max_duration, dataloader_len, ssr)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        return clock.xp.where(clock.before(times["t_max"]), self.alpha, 1.0)


class LinearScheduler(ComposerScheduler):
    r"""Move the multiplier linearly from ``alpha_i`` to ``alpha_f`` over ``t_max``.

    :math:`\alpha(t) = \alpha_i + (\alpha_f - \alpha_i) \times \tau`, :math:`\tau = \min(1, t / t_{max})`.

    Args:
        alpha_i: the initial multiplier.
        alpha_f: the final multiplier.
        t_max: the duration of the change.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = LinearScheduler(t_max='10ba').multiplier(ScheduleContext(Time(20, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 4, 10, 15)]
        [1.0, 0.6, 0.0, 0.0]
    """

    def __init__(self, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: str | Time = "1dur") -> None:
        self.alpha_i = alpha_i
        self.alpha_f = alpha_f
        self.t_max = t_max

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"t_max": self._convert("t_max", max_duration, dataloader_len, ssr, nonzero=True)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        fraction = clock.xp.minimum(1.0, clock.progress(times["t_max"]))
        return self.alpha_i + fraction * (self.alpha_f - self.alpha_i)


class ExponentialScheduler(ComposerScheduler):
    r"""Decay the multiplier by ``gamma`` every ``decay_period``, continuously: :math:`\alpha(t) = \gamma^{t / \rho}`.

    Args:
        gamma: multiplicative decay factor.
        decay_period: the time over which the multiplier falls by ``gamma``.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> context = ScheduleContext(Time(4, 'ep'), steps_per_epoch=10)
        >>> multiplier = ExponentialScheduler(gamma=0.5).multiplier(context)
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 5, 10, 20)]
        [1.0, 0.7071, 0.5, 0.25]
    """

    def __init__(self, gamma: float, decay_period: str | Time = "1ep") -> None:
        self.gamma = gamma
        self.decay_period = decay_period

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"decay_period": self._convert("decay_period", max_duration, dataloader_len, ssr, nonzero=True)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        return clock.xp.power(self.gamma, clock.progress(times["decay_period"]))


class CosineAnnealingScheduler(ComposerScheduler):
    r"""Decay the multiplier along half a cosine from 1 to ``alpha_f`` over ``t_max``.

    :math:`\alpha(t) = \alpha_f + (1 - \alpha_f) \times \frac{1}{2}(1 + \cos(\pi \tau))`,
    :math:`\tau = t / t_{max}` clipped to [0, 1].

    Args:
        t_max: the duration of the decay.
        alpha_f: the final multiplier.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = CosineAnnealingScheduler(t_max='30ba', alpha_f=0.5).multiplier(ScheduleContext(Time(60, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 10, 15, 30, 50)]
        [1.0, 0.875, 0.75, 0.5, 0.5]
    """

    def __init__(self, t_max: str | Time = "1dur", alpha_f: float = 0.0) -> None:
        self.t_max = t_max
        self.alpha_f = alpha_f

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"t_max": self._convert("t_max", max_duration, dataloader_len, ssr, nonzero=True)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        return cosine_anneal(clock.xp, clock.progress(times["t_max"]), self.alpha_f)


class CosineAnnealingWarmRestartsScheduler(ComposerScheduler):
    r"""Cosine annealing that restarts every cycle; cycle ``i`` lasts :math:`t_0 t_{mult}^i` (each truncated).

    :math:`\alpha(t) = \alpha_f + (1 - \alpha_f) \times \frac{1}{2}(1 + \cos(\pi \tau_i))`, with
    :math:`\tau_i` the fraction of the current cycle elapsed. With ``t_mult < 1`` cycles shrink to
    0, where Composer raises: a run known to get there is refused when compiled, and past it the
    compiled multiplier stays at ``alpha_f``.

    Args:
        t_0: the first cycle's duration.
        t_mult: the multiplier of each cycle's duration over the previous one.
        alpha_f: the multiplier at the end of each cycle.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = CosineAnnealingWarmRestartsScheduler(t_0='30ba').multiplier(ScheduleContext(Time(60, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 15, 30, 40)]
        [1.0, 0.5, 1.0, 0.75]
    """

    def __init__(self, t_0: str | Time, t_mult: float = 1.0, alpha_f: float = 0.0) -> None:
        self.t_0 = t_0
        self.t_mult = t_mult
        self.alpha_f = alpha_f

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"t_0": self._convert("t_0", max_duration, dataloader_len, ssr, nonzero=True)}

    def _check_run(self, times: dict[str, Any], context: ScheduleContext) -> None:
        t_0 = times["t_0"]
        restart_cycles(t_0.value, self.t_mult, context.total_steps, context.steps_per_unit(t_0.unit, "t_0"),
                       self._label("t_0"))

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        progress = clock.restart_progress(times["t_0"], self.t_mult, self._label("t_0"))
        return cosine_anneal(clock.xp, progress, self.alpha_f)


class PolynomialScheduler(ComposerScheduler):
    r"""Decay the multiplier as a power of the time left.

    :math:`\alpha(t) = \alpha_f + (1 - \alpha_f)(1 - \tau)^\kappa`, :math:`\tau = \min(1, t / t_{max})`.

    Args:
        power: the exponent :math:`\kappa`.
        t_max: the duration of the decay.
        alpha_f: the final multiplier.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> scheduler = PolynomialScheduler(power=2.0, t_max='100ba', alpha_f=0.5)
        >>> multiplier = scheduler.multiplier(ScheduleContext(Time(100, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 10, 50, 100)]
        [1.0, 0.905, 0.625, 0.5]
    """

    def __init__(self, power: float, t_max: str | Time = "1dur", alpha_f: float = 0.0) -> None:
        self.power = power
        self.t_max = t_max
        self.alpha_f = alpha_f

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        return {"t_max": self._convert("t_max", max_duration, dataloader_len, ssr, nonzero=True)}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        fraction = clock.xp.minimum(1.0, clock.progress(times["t_max"]))
        return self.alpha_f + clock.xp.power(1 - fraction, self.power) * (1.0 - self.alpha_f)
