"""Composer's schedulers with a linear warmup: multi-step, constant, linear, cosine and polynomial after it.

As in Composer, ``t_warmup`` is not stretched by the scale schedule ratio unless
``scale_warmup=True`` (then the ramp is, but the warmup still ends at the unscaled ``t_warmup``),
and ``t_max`` must be in the same unit as ``t_warmup`` after conversion and cover ``max_duration``.

Example:
    >>> import jax.numpy as jnp
    >>> from composerjax.core.time import Time
    >>> scheduler = CosineAnnealingWithWarmupScheduler(t_warmup='10ba')
    >>> multiplier = scheduler.multiplier(ScheduleContext(Time(110, 'ba')))
    >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 5, 10, 60, 110)]
    [0.0, 0.5, 1.0, 0.5, 0.0]
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from composerjax.core.time import Time
from composerjax.optim.schedule_time import ScheduleContext, check_same_unit, check_t_max_covers_run  # noqa: F401 (examples)
from composerjax.optim.scheduler import Clock, ComposerScheduler, cosine_anneal, milestone_factor, milestone_times

__all__ = [
    "ConstantWithWarmupScheduler",
    "CosineAnnealingWithWarmupScheduler",
    "LinearWithWarmupScheduler",
    "MultiStepWithWarmupScheduler",
    "PolynomialWithWarmupScheduler",
]

_ZERO_WARMUP = ("The warmup duration is 0. If you specified warmup as a fraction of total training duration, take "
                "note that the warmup duration is calculated in the same unit as the trainer's max_duration "
                "parameter.")


class _WarmupScheduler(ComposerScheduler):
    """A linear warmup from 0 to ``warmup_peak`` over ``t_warmup``, then ``_after_warmup``.

    As in Composer, the warmup is not stretched by the scale schedule ratio unless ``scale_warmup``:
    then the ramp (not the end of warmup) is stretched.
    """

    t_warmup: str | Time
    scale_warmup: bool
    warmup_peak: float = 1.0

    def _times(self, max_duration: Time | None, dataloader_len: int | None, ssr: float) -> dict[str, Any]:
        t_warmup = self._convert("t_warmup", max_duration, dataloader_len, 1.0)
        times = {"t_warmup": t_warmup, **self._times_after_warmup(t_warmup, max_duration, dataloader_len, ssr)}
        ramp = self._convert("t_warmup", max_duration, dataloader_len, ssr) if self.scale_warmup else t_warmup
        if t_warmup.value == 0:
            warnings.warn(_ZERO_WARMUP, stacklevel=3)
        elif ramp.value == 0:
            raise ValueError(f"{self._label('t_warmup')}: scaled by scale_schedule_ratio={ssr} it converts to {ramp}, "
                             "and the warmup divides by it; use a longer warmup or scale_warmup=False")
        times["t_warmup.scaled"] = ramp
        return times

    def _times_after_warmup(self, t_warmup: Time, max_duration: Time | None, dataloader_len: int | None,
                            ssr: float) -> dict[str, Any]:
        t_max = self._convert("t_max", max_duration, dataloader_len, ssr)
        check_same_unit(t_warmup, t_max, type(self).__name__)
        check_t_max_covers_run(t_max, max_duration, dataloader_len, type(self).__name__)
        return {"t_max": t_max}

    def _alpha(self, clock: Clock, times: dict[str, Any]) -> Any:
        ramp = self.warmup_peak * clock.xp.minimum(1.0, clock.progress(times["t_warmup.scaled"]))
        return clock.xp.where(clock.before(times["t_warmup"]), ramp, self._after_warmup(clock, times))

    def _decay_fraction(self, clock: Clock, times: dict[str, Any]) -> Any:
        """:math:`\\tau_w = (t - t_{warmup}) / (t_{max} - t_{warmup})` clipped to 1, 0 if t_max <= t_warmup."""
        return clock.xp.minimum(1.0, clock.progress(times["t_max"], start=times["t_warmup"]))

    def _after_warmup(self, clock: Clock, times: dict[str, Any]) -> Any:
        raise NotImplementedError


class MultiStepWithWarmupScheduler(_WarmupScheduler):
    r"""Warm up linearly over ``t_warmup``, then decay by ``gamma`` at each milestone.

    :math:`\alpha(t) = t / t_{warmup}` if :math:`t < t_{warmup}`, else :math:`\gamma^x` (x milestones reached).

    Args:
        t_warmup: warmup time.
        milestones: times at which the learning rate changes.
        gamma: multiplicative decay factor.
        scale_warmup: whether the scale schedule ratio also stretches the warmup.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> scheduler = MultiStepWithWarmupScheduler(t_warmup='10ba', milestones=['20ba', '40ba'])
        >>> multiplier = scheduler.multiplier(ScheduleContext(Time(50, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 5, 15, 25, 45)]
        [0.0, 0.5, 1.0, 0.1, 0.01]
    """

    def __init__(self, t_warmup: str | Time, milestones: Sequence[str | Time], gamma: float = 0.1,
                 scale_warmup: bool = False) -> None:
        self.t_warmup = t_warmup
        self.milestones = list(milestones)
        self.gamma = gamma
        self.scale_warmup = scale_warmup

    def _times_after_warmup(self, t_warmup: Time, max_duration: Time | None, dataloader_len: int | None,
                            ssr: float) -> dict[str, Any]:
        return milestone_times(self, max_duration, dataloader_len, ssr)

    def _after_warmup(self, clock: Clock, times: dict[str, Any]) -> Any:
        return milestone_factor(clock, times["milestones"], self.gamma)


class LinearWithWarmupScheduler(_WarmupScheduler):
    r"""Warm up linearly to ``alpha_i`` over ``t_warmup``, then move linearly to ``alpha_f`` by ``t_max``.

    :math:`\alpha(t) = \alpha_i t / t_{warmup}` if :math:`t < t_{warmup}`, else
    :math:`\alpha_i + (\alpha_f - \alpha_i)\tau_w`, with
    :math:`\tau_w = \min(1, (t - t_{warmup}) / (t_{max} - t_{warmup}))`
    (what Composer's code computes; its docstring writes :math:`t_{max}` as the denominator).

    Args:
        t_warmup: warmup time.
        alpha_i: the multiplier at the end of warmup.
        alpha_f: the final multiplier.
        t_max: the duration of this scheduler (at least ``max_duration``).
        scale_warmup: whether the scale schedule ratio also stretches the warmup.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = LinearWithWarmupScheduler(t_warmup='0.5dur').multiplier(ScheduleContext(Time(100, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 25, 50, 75, 100)]
        [0.0, 0.5, 1.0, 0.5, 0.0]
    """

    def __init__(self, t_warmup: str | Time, alpha_i: float = 1.0, alpha_f: float = 0.0, t_max: str | Time = "1dur",
                 scale_warmup: bool = False) -> None:
        self.t_warmup = t_warmup
        self.alpha_i = alpha_i
        self.alpha_f = alpha_f
        self.t_max = t_max
        self.scale_warmup = scale_warmup
        self.warmup_peak = alpha_i

    def _after_warmup(self, clock: Clock, times: dict[str, Any]) -> Any:
        return self.alpha_i + self._decay_fraction(clock, times) * (self.alpha_f - self.alpha_i)


class ConstantWithWarmupScheduler(LinearWithWarmupScheduler):
    r"""Warm up linearly to ``alpha`` over ``t_warmup``, then hold ``alpha``.

    :math:`\alpha(t) = \alpha t / t_{warmup}` if :math:`t < t_{warmup}`, else :math:`\alpha` (Composer
    runs it as :class:`LinearWithWarmupScheduler` with ``alpha_i = alpha_f = alpha``, so ``alpha``
    holds past ``t_max`` too).

    Args:
        t_warmup: warmup time.
        alpha: the multiplier after warmup.
        t_max: the duration of this scheduler (at least ``max_duration``).
        scale_warmup: whether the scale schedule ratio also stretches the warmup.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> scheduler = ConstantWithWarmupScheduler(t_warmup='4ba', alpha=2.0)
        >>> multiplier = scheduler.multiplier(ScheduleContext(Time(8, 'ba')))
        >>> [float(multiplier(jnp.int32(step))) for step in (0, 2, 4, 8)]
        [0.0, 1.0, 2.0, 2.0]
    """

    def __init__(self, t_warmup: str | Time, alpha: float = 1.0, t_max: str | Time = "1dur",
                 scale_warmup: bool = False) -> None:
        super().__init__(t_warmup, alpha_i=alpha, alpha_f=alpha, t_max=t_max, scale_warmup=scale_warmup)
        self.alpha = alpha


class CosineAnnealingWithWarmupScheduler(_WarmupScheduler):
    r"""Warm up linearly over ``t_warmup``, then decay along half a cosine to ``alpha_f`` by ``t_max``.

    :math:`\alpha(t) = t / t_{warmup}` if :math:`t < t_{warmup}`, else
    :math:`\alpha_f + (1 - \alpha_f) \times \frac{1}{2}(1 + \cos(\pi \tau_w))`,
    :math:`\tau_w = \min(1, (t - t_{warmup}) / (t_{max} - t_{warmup}))`.

    Args:
        t_warmup: warmup time.
        t_max: the duration of this scheduler (at least ``max_duration``).
        alpha_f: the final multiplier.
        scale_warmup: whether the scale schedule ratio also stretches the warmup.

    Example:
        >>> from composerjax.core.time import Timestamp
        >>> from composerjax.core.state import State
        >>> state = State(model=None, max_duration='1000ba')
        >>> state.timestamp = Timestamp(batch=550)
        >>> round(CosineAnnealingWithWarmupScheduler(t_warmup='100ba')(state), 6)
        0.5
    """

    def __init__(self, t_warmup: str | Time, t_max: str | Time = "1dur", alpha_f: float = 0.0,
                 scale_warmup: bool = False) -> None:
        self.t_warmup = t_warmup
        self.t_max = t_max
        self.alpha_f = alpha_f
        self.scale_warmup = scale_warmup

    def _after_warmup(self, clock: Clock, times: dict[str, Any]) -> Any:
        return cosine_anneal(clock.xp, self._decay_fraction(clock, times), self.alpha_f)


class PolynomialWithWarmupScheduler(_WarmupScheduler):
    r"""Warm up linearly over ``t_warmup``, then decay as a power of the time left to ``alpha_f`` by ``t_max``.

    :math:`\alpha(t) = t / t_{warmup}` if :math:`t < t_{warmup}`, else
    :math:`\alpha_f + (1 - \alpha_f)(1 - \tau_w)^\kappa`,
    :math:`\tau_w = \min(1, (t - t_{warmup}) / (t_{max} - t_{warmup}))`.

    Args:
        t_warmup: warmup time.
        power: the exponent :math:`\kappa`.
        t_max: the duration of this scheduler (at least ``max_duration``).
        alpha_f: the final multiplier.
        scale_warmup: whether the scale schedule ratio also stretches the warmup.

    Example:
        >>> import jax.numpy as jnp
        >>> from composerjax.core.time import Time
        >>> multiplier = PolynomialWithWarmupScheduler(t_warmup='10ba').multiplier(ScheduleContext(Time(110, 'ba')))
        >>> [round(float(multiplier(jnp.int32(step))), 4) for step in (0, 5, 10, 60, 110)]
        [0.0, 0.5, 1.0, 0.25, 0.0]
    """

    def __init__(self, t_warmup: str | Time, power: float = 2.0, t_max: str | Time = "1dur", alpha_f: float = 0.0,
                 scale_warmup: bool = False) -> None:
        self.t_warmup = t_warmup
        self.power = power
        self.t_max = t_max
        self.alpha_f = alpha_f
        self.scale_warmup = scale_warmup

    def _after_warmup(self, clock: Clock, times: dict[str, Any]) -> Any:
        fraction = self._decay_fraction(clock, times)
        return self.alpha_f + clock.xp.power(1 - fraction, self.power) * (1.0 - self.alpha_f)
