"""Composer's schedulers: host values and in-step values equal Composer's closed forms, at every batch of a run.

Each scheduler is checked against its formula from Composer's documentation, written here in numpy
(for the warmup schedulers, the post-warmup fraction Composer's code computes:
``(t - t_warmup) / (t_max - t_warmup)``), with times converted by Composer's rules, also written
here: ``ba`` and ``sp`` are stretched by the scale schedule ratio and truncated, ``ep`` is counted in
batches first, ``dur`` is a fraction of the (already scaled) ``max_duration``.
"""

from __future__ import annotations

import inspect
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composerjax.core.state import State
from composerjax.core.time import Time, Timestamp
from composerjax.optim import (
    ConstantScheduler,
    ConstantWithWarmupScheduler,
    CosineAnnealingScheduler,
    CosineAnnealingWarmRestartsScheduler,
    CosineAnnealingWithWarmupScheduler,
    ExponentialScheduler,
    LinearScheduler,
    LinearWithWarmupScheduler,
    MultiStepScheduler,
    MultiStepWithWarmupScheduler,
    PolynomialScheduler,
    PolynomialWithWarmupScheduler,
    ScheduleContext,
    StepScheduler,
    compile_schedulers,
    scale_max_duration,
)

STEPS_PER_EPOCH = 10
SAMPLES_PER_STEP = 16
RUNS = {"8ep": "8ep", "1280sp": "1280sp"}  # both 80 steps at ratio 1


class Run:
    """One run's clock: the scaled max_duration, and Composer's conversion of a time to (fractional) batches."""

    def __init__(self, max_duration: str, ssr: float) -> None:
        self.ssr = ssr
        self.max_duration = scale_max_duration(max_duration, ssr)
        unit_steps = {"ep": STEPS_PER_EPOCH, "sp": 1 / SAMPLES_PER_STEP}[self.max_duration.unit.value]
        self.total = round(self.max_duration.value * unit_steps)

    def steps(self, time: str, scaled: bool = True) -> float:
        parsed = Time.from_timestring(time)
        ssr = self.ssr if scaled else 1.0
        unit, value = parsed.unit.value, parsed.value
        if unit == "dur":
            if self.max_duration.unit.value == "ep":
                return int(value * STEPS_PER_EPOCH * self.max_duration.value)
            return int(value * self.max_duration.value) / SAMPLES_PER_STEP
        if unit == "ep":
            return int(value * STEPS_PER_EPOCH * ssr)
        if unit == "sp":
            return int(value * ssr) / SAMPLES_PER_STEP
        return int(value * ssr)

    def context(self) -> ScheduleContext:
        return ScheduleContext(self.max_duration, STEPS_PER_EPOCH, SAMPLES_PER_STEP,
                               scale_schedule_ratio=self.ssr)

    def state(self) -> State:
        return State(model=None, max_duration=self.max_duration, dataloader_len=STEPS_PER_EPOCH)


# -- Composer's closed forms (t in batches) ----------------------------------------------------------
def cosine(x, alpha_f):
    return alpha_f + (1 - alpha_f) * 0.5 * (1 + np.cos(np.pi * np.clip(x, 0.0, 1.0)))


def warmup(t, run, t_warmup, peak, scale_warmup, after):
    """t / t_warmup (times peak) before t_warmup, else the post-warmup form; the ramp stretched only if asked."""
    end = run.steps(t_warmup, scaled=False)
    ramp = run.steps(t_warmup, scaled=scale_warmup)
    return np.where(t < end, peak * np.minimum(1.0, t / max(ramp, 1e-12)), after(t, end))


def tau_w(t, end, t_max):
    return np.minimum(1.0, (t - end) / (t_max - end)) if t_max > end else np.zeros_like(t)


def restarts(t, t_0, t_mult, alpha_f):
    start, length = np.zeros_like(t), np.full_like(t, t_0)
    for _ in range(64):  # the cycles: length t_0, then int(t_mult * length)
        done = t >= start + length
        start = np.where(done, start + length, start)
        length = np.where(done, np.floor(t_mult * length), length)
    return cosine((t - start) / length, alpha_f)


CASES = {
    "step_ep": (StepScheduler(step_size="1ep", gamma=0.5),
                lambda t, r: 0.5 ** np.floor(t / r.steps("1ep"))),
    "step_sp": (StepScheduler(step_size="40sp", gamma=0.9),  # 2.5 steps: changes mid-step
                lambda t, r: 0.9 ** np.floor(t / r.steps("40sp"))),
    "multistep": (MultiStepScheduler(milestones=["1ep", "30ba", "0.5dur", "960sp"], gamma=0.5),
                  lambda t, r: 0.5 ** sum((t >= r.steps(m)).astype(float) for m in ["1ep", "30ba", "0.5dur", "960sp"])),
    "constant": (ConstantScheduler(alpha=0.5, t_max="0.25dur"),
                 lambda t, r: np.where(t < r.steps("0.25dur"), 0.5, 1.0)),
    "linear": (LinearScheduler(alpha_i=1.0, alpha_f=0.1, t_max="6ep"),
               lambda t, r: 1.0 + (0.1 - 1.0) * np.minimum(1.0, t / r.steps("6ep"))),
    "exponential": (ExponentialScheduler(gamma=0.9, decay_period="5ba"),
                    lambda t, r: 0.9 ** (t / r.steps("5ba"))),
    "cosine": (CosineAnnealingScheduler(t_max="1dur", alpha_f=0.1),
               lambda t, r: cosine(t / r.steps("1dur"), 0.1)),
    "warm_restarts": (CosineAnnealingWarmRestartsScheduler(t_0="1ep", t_mult=2.0),
                      lambda t, r: restarts(t, r.steps("1ep"), 2.0, 0.0)),
    "warm_restarts_dur": (CosineAnnealingWarmRestartsScheduler(t_0="0.125dur", alpha_f=0.2),
                          lambda t, r: restarts(t, r.steps("0.125dur"), 1.0, 0.2)),
    "polynomial": (PolynomialScheduler(power=2.0, t_max="800sp"),
                   lambda t, r: (1 - np.minimum(1.0, t / r.steps("800sp"))) ** 2.0),
    "multistep_warmup": (MultiStepWithWarmupScheduler(t_warmup="5ba", milestones=["2ep", "0.75dur"], gamma=0.1),
                         lambda t, r: warmup(t, r, "5ba", 1.0, False, lambda t, end: 0.1 ** (
                             (t >= r.steps("2ep")).astype(float) + (t >= r.steps("0.75dur")).astype(float)))),
    "constant_warmup": (ConstantWithWarmupScheduler(t_warmup="0.1dur", alpha=2.0),
                        lambda t, r: warmup(t, r, "0.1dur", 2.0, False, lambda t, end: np.full_like(t, 2.0))),
    "linear_warmup": (LinearWithWarmupScheduler(t_warmup="1ep", alpha_i=1.0, alpha_f=0.0, scale_warmup=True),
                      lambda t, r: warmup(t, r, "1ep", 1.0, True,
                                          lambda t, end: 1.0 - tau_w(t, end, r.steps("1dur")))),
    "cosine_warmup": (CosineAnnealingWithWarmupScheduler(t_warmup="10ba", alpha_f=0.1),
                      lambda t, r: warmup(t, r, "10ba", 1.0, False,
                                          lambda t, end: cosine(tau_w(t, end, r.steps("1dur")), 0.1))),
    "polynomial_warmup": (PolynomialWithWarmupScheduler(t_warmup="0.125dur", power=2.0, alpha_f=0.5),
                          lambda t, r: warmup(t, r, "0.125dur", 1.0, False, lambda t, end: 0.5 + 0.5 * (
                              1 - tau_w(t, end, r.steps("1dur"))) ** 2.0)),
}
# Warmup schedulers need t_warmup and t_max in one unit: an 'sp' warmup runs against an 'sp' run.
SAMPLE_RUN_ONLY = {"sp_warmup": (CosineAnnealingWithWarmupScheduler(t_warmup="160sp"),
                                 lambda t, r: warmup(t, r, "160sp", 1.0, False,
                                                     lambda t, end: cosine(tau_w(t, end, r.steps("1dur")), 0.0)))}
EPOCH_RUN_ONLY = {"linear_warmup", "cosine_warmup"}  # '1ep'/'10ba' warmups against an 'sp' t_max


def host_values(scheduler, run, steps):
    state = run.state()
    values = []
    for step in steps:
        state.timestamp = Timestamp(epoch=step // STEPS_PER_EPOCH, batch=step, sample=step * SAMPLES_PER_STEP)
        values.append(scheduler(state, run.ssr))
    return np.array(values)


def device_values(multiplier, steps):
    return np.asarray(jax.jit(jax.vmap(multiplier))(jnp.asarray(steps, jnp.int32)))


def cases_for(run_name):
    chosen = {name: case for name, case in CASES.items() if run_name == "8ep" or name not in EPOCH_RUN_ONLY}
    if run_name == "1280sp":
        chosen.update(SAMPLE_RUN_ONLY)
    return chosen


PARAMS = [pytest.param(name, run_name, ssr, id=f"{name}-{run_name}-ssr{ssr}")
          for run_name in RUNS for ssr in (1.0, 0.5) for name in cases_for(run_name)]


@pytest.mark.parametrize(("name", "run_name", "ssr"), PARAMS)
def test_host_and_step_values_equal_the_closed_form_at_every_batch(name, run_name, ssr):
    scheduler, closed_form = {**CASES, **SAMPLE_RUN_ONLY}[name]
    run = Run(RUNS[run_name], ssr)
    steps = np.arange(run.total + 1)
    expected = closed_form(steps.astype(np.float64), run)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no scheduler here has a 0 warmup
        host = host_values(scheduler, run, steps)
        multiplier = compile_schedulers([scheduler], run.context())
    np.testing.assert_allclose(host, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(device_values(multiplier, steps), expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize(("name", "run_name", "ssr"), [p for p in PARAMS if p.values[2] == 1.0])
def test_stepping_once_per_epoch_holds_the_value_at_the_epoch_start(name, run_name, ssr):
    scheduler, closed_form = {**CASES, **SAMPLE_RUN_ONLY}[name]
    run = Run(RUNS[run_name], ssr)
    steps = np.arange(run.total + 1)
    starts = (steps // STEPS_PER_EPOCH * STEPS_PER_EPOCH).astype(np.float64)
    multiplier = compile_schedulers(scheduler, run.context(), step_every_batch=False)
    np.testing.assert_allclose(device_values(multiplier, steps), closed_form(starts, run), rtol=2e-6, atol=2e-6)


# At 0, t_warmup, the middle and the end of the 80-batch run (10 batches an epoch), spelled out.
SPOT_VALUES = [
    (CosineAnnealingWithWarmupScheduler(t_warmup="1ep"), 1.0, {0: 0.0, 5: 0.5, 10: 1.0, 45: 0.5, 80: 0.0}),
    (CosineAnnealingWithWarmupScheduler(t_warmup="1ep"), 0.5, {0: 0.0, 5: 0.5, 10: 1.0, 25: 0.5, 40: 0.0}),
    (CosineAnnealingWithWarmupScheduler(t_warmup="1ep", scale_warmup=True), 0.5,
     {0: 0.0, 3: 0.6, 5: 1.0, 10: 1.0, 25: 0.5, 40: 0.0}),
    (LinearWithWarmupScheduler(t_warmup="0.25dur"), 1.0, {0: 0.0, 10: 0.5, 20: 1.0, 50: 0.5, 80: 0.0}),
    (LinearWithWarmupScheduler(t_warmup="0.25dur"), 0.5, {0: 0.0, 5: 0.5, 10: 1.0, 25: 0.5, 40: 0.0}),
    (PolynomialWithWarmupScheduler(t_warmup="20ba"), 1.0, {0: 0.0, 20: 1.0, 50: 0.25, 80: 0.0}),
    (ConstantWithWarmupScheduler(t_warmup="2ep", alpha=0.5), 1.0, {0: 0.0, 10: 0.25, 20: 0.5, 80: 0.5}),
    (MultiStepWithWarmupScheduler(t_warmup="1ep", milestones=["4ep", "6ep"]), 1.0,
     {0: 0.0, 10: 1.0, 39: 1.0, 40: 0.1, 80: 0.01}),
    (MultiStepWithWarmupScheduler(t_warmup="1ep", milestones=["4ep", "6ep"]), 0.5,
     {0: 0.0, 10: 1.0, 19: 1.0, 20: 0.1, 30: 0.01, 40: 0.01}),
    (StepScheduler(step_size="2ep", gamma=0.5), 1.0, {0: 1.0, 19: 1.0, 20: 0.5, 40: 0.25, 80: 0.0625}),
    (StepScheduler(step_size="2ep", gamma=0.5), 0.5, {0: 1.0, 10: 0.5, 20: 0.25, 40: 0.0625}),
    (MultiStepScheduler(milestones=["0.5dur", "60ba"]), 1.0, {0: 1.0, 40: 0.1, 60: 0.01, 80: 0.01}),
    (ConstantScheduler(alpha=0.1, t_max="2ep"), 1.0, {0: 0.1, 19: 0.1, 20: 1.0, 80: 1.0}),
    (LinearScheduler(alpha_i=0.0, alpha_f=1.0, t_max="0.5dur"), 1.0, {0: 0.0, 20: 0.5, 40: 1.0, 80: 1.0}),
    (ExponentialScheduler(gamma=0.5, decay_period="2ep"), 0.5, {0: 1.0, 10: 0.5, 40: 0.0625}),
    (CosineAnnealingScheduler(), 1.0, {0: 1.0, 40: 0.5, 80: 0.0}),
    (CosineAnnealingWarmRestartsScheduler(t_0="2ep"), 1.0, {0: 1.0, 10: 0.5, 20: 1.0, 30: 0.5, 79: 0.00616}),
    (PolynomialScheduler(power=1.0, t_max="1dur", alpha_f=0.2), 1.0, {0: 1.0, 40: 0.6, 80: 0.2}),
]


@pytest.mark.parametrize(("scheduler", "ssr", "values"), SPOT_VALUES,
                         ids=[f"{spot[0]!r}@{spot[1]}" for spot in SPOT_VALUES])
def test_values_at_zero_warmup_middle_and_end(scheduler, ssr, values):
    run = Run("8ep", ssr)
    steps = np.array(list(values))
    expected = np.array(list(values.values()))
    np.testing.assert_allclose(host_values(scheduler, run, steps), expected, atol=1e-4)
    np.testing.assert_allclose(device_values(compile_schedulers([scheduler], run.context()), steps), expected,
                               atol=1e-4)


# Cases from Composer's own scheduler tests (1000 batches an epoch, max_duration 1000ep scaled by ssr).
COMPOSER_CASES = [
    (StepScheduler(step_size="10ba"), 1.0, [5, 15, 35], [1.0, 0.1, 0.001]),
    (StepScheduler(step_size="0.002dur", gamma=0.8), 1.0, [1000, 3000, 7000], [1.0, 0.8, 0.512]),
    (StepScheduler(step_size="10ba", gamma=0.5), 0.5, [3, 8, 18], [1.0, 0.5, 0.125]),
    (MultiStepScheduler(milestones=["100ba", "1ep", "0.01dur"], gamma=0.5), 4.0,
     [200, 2000, 20000, 200000], [1.0, 0.5, 0.25, 0.125]),
    (LinearScheduler(alpha_i=0.0, alpha_f=1.0, t_max="0.25dur"), 2.0, [100000, 200000, 400000], [0.2, 0.4, 0.8]),
    (ExponentialScheduler(gamma=0.5), 2.0, [2000, 4000, 8000], [0.5, 0.25, 0.0625]),
    (CosineAnnealingScheduler(t_max="30ba", alpha_f=0.5), 0.2, [0, 2, 3, 4, 6, 10],
     [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]),
    (CosineAnnealingWarmRestartsScheduler(t_0="0.003dur", t_mult=1.5), 1.0, [0, 1000, 3000, 4500, 7500, 14250],
     [1.0, 0.75, 1.0, 0.75, 1.0, 1.0]),
    (CosineAnnealingWarmRestartsScheduler(t_0="30ep", t_mult=2.0, alpha_f=0.5), 0.5, [0, 5000, 15000, 25000],
     [1.0, 0.875, 1.0, 0.875]),
    (PolynomialScheduler(power=2.0, t_max="100ba", alpha_f=0.5), 0.5, [0, 10, 20, 50], [1.0, 0.82, 0.68, 0.5]),
    (MultiStepWithWarmupScheduler(t_warmup="10ba", milestones=["2ep", "4ep"], gamma=0.5, scale_warmup=True), 0.5,
     [0, 5, 15, 1500, 2500], [0.0, 1.0, 1.0, 0.5, 0.25]),
    (ConstantWithWarmupScheduler(t_warmup="500ep", alpha=3.0, t_max="501000ep"), 0.5,
     [0, 250000, 500000, 500500, 501000, 502000], [0.0, 1.5, 3.0, 3.0, 3.0, 3.0]),
    (LinearWithWarmupScheduler(t_warmup="500ep", alpha_i=3.0, alpha_f=2.0, t_max="1002ep"), 0.5,
     [0, 250000, 500000, 500500, 501000, 502000], [0.0, 1.5, 3.0, 2.5, 2.0, 2.0]),
    (LinearWithWarmupScheduler(t_warmup="500ba", scale_warmup=True), 0.5, [0, 125, 250, 249875],
     [0.0, 0.5, 1.0, 0.5]),
    (CosineAnnealingWithWarmupScheduler(t_warmup="0.9dur", alpha_f=0.5), 0.01, [0, 4500, 9000, 9333, 9500, 10000],
     [0.0, 0.5, 1.0, 0.875, 0.75, 0.5]),
    (PolynomialWithWarmupScheduler(t_warmup="0.9dur"), 1.0, [0, 450000, 900000, 913397, 929289, 1000000],
     [0.0, 0.5, 1.0, 0.75, 0.5, 0.0]),
]


@pytest.mark.parametrize(("scheduler", "ssr", "batches", "expected"), COMPOSER_CASES,
                         ids=[f"{repr(case[0])}@{case[1]}" for case in COMPOSER_CASES])
def test_composer_test_vectors(scheduler, ssr, batches, expected):
    max_duration = Time(int(1000 * ssr), "ep")
    state = State(model=None, max_duration=max_duration, dataloader_len=1000)
    multiplier = scheduler.multiplier(ScheduleContext(max_duration, steps_per_epoch=1000, scale_schedule_ratio=ssr))
    for batch, value in zip(batches, expected):
        state.timestamp = Timestamp(epoch=batch // 1000, batch=batch)
        assert scheduler(state, ssr) == pytest.approx(value, abs=1e-3)
        assert float(multiplier(jnp.int32(batch))) == pytest.approx(scheduler(state, ssr), abs=2e-6)


@pytest.mark.parametrize("scheduler_class", [CosineAnnealingWithWarmupScheduler, ConstantWithWarmupScheduler,
                                             LinearWithWarmupScheduler, PolynomialWithWarmupScheduler])
def test_warmup_checks_fail_when_built_as_composer_fails_when_called(scheduler_class):
    context = ScheduleContext(Time(4, "ep"), steps_per_epoch=32, samples_per_step=16)
    state = State(model=None, max_duration="4ep", dataloader_len=32)
    mismatched = scheduler_class(t_warmup="512sp", t_max="1dur")  # t_max becomes batches, t_warmup stays samples
    short = scheduler_class(t_warmup="1ep", t_max="96ba")  # ends before the 128-batch run
    for scheduler, message in ((mismatched, "t_warmup and t_max must use the same units"),
                               (short, "must be greater than or equal to max_duration")):
        with pytest.raises(ValueError, match=message):
            scheduler(state)
        with pytest.raises(ValueError, match=message):
            scheduler.multiplier(context)


def test_a_zero_warmup_warns_like_composer():
    with pytest.warns(UserWarning, match="The warmup duration is 0"):
        multiplier = LinearWithWarmupScheduler(t_warmup="0ba").multiplier(ScheduleContext("10ba"))
    assert float(multiplier(jnp.int32(0))) == 1.0
    assert float(multiplier(jnp.int32(5))) == 0.5


def test_warm_restarts_that_decay_to_nothing_are_refused_before_the_run_reaches_it():
    scheduler = CosineAnnealingWarmRestartsScheduler(t_0="8ba", t_mult=0.5)  # cycles 8, 4, 2, 1, then 0 at batch 15
    state = State(model=None, max_duration="20ba")
    state.timestamp = Timestamp(batch=14)
    assert scheduler(state) == pytest.approx(1.0)
    state.timestamp = Timestamp(batch=15)
    with pytest.raises(ValueError, match="decayed to 0"):
        scheduler(state)
    with pytest.raises(ValueError, match="decayed to 0 at 15"):
        scheduler.multiplier(ScheduleContext("20ba"))
    multiplier = scheduler.multiplier(ScheduleContext("15ba"))
    assert [float(multiplier(jnp.int32(step))) for step in (0, 4, 8, 12, 14)] == pytest.approx(
        [1.0, 0.5, 1.0, 1.0, 1.0])


def test_every_scheduler_has_composer_arguments_and_defaults():
    defaults = {name: {key: value.default for key, value in inspect.signature(cls).parameters.items()}
                for name, cls in [("step", StepScheduler), ("cosine_warmup", CosineAnnealingWithWarmupScheduler),
                                  ("poly_warmup", PolynomialWithWarmupScheduler), ("exp", ExponentialScheduler),
                                  ("restarts", CosineAnnealingWarmRestartsScheduler)]}
    empty = inspect.Parameter.empty
    assert defaults["step"] == {"step_size": empty, "gamma": 0.1}
    assert defaults["cosine_warmup"] == {"t_warmup": empty, "t_max": "1dur", "alpha_f": 0.0, "scale_warmup": False}
    assert defaults["poly_warmup"] == {"t_warmup": empty, "power": 2.0, "t_max": "1dur", "alpha_f": 0.0,
                                       "scale_warmup": False}
    assert defaults["exp"] == {"gamma": empty, "decay_period": "1ep"}
    assert defaults["restarts"] == {"t_0": empty, "t_mult": 1.0, "alpha_f": 0.0}
    assert math.isclose(ConstantScheduler()(_state_at(3)), 1.0)


def _state_at(batch):
    state = State(model=None, max_duration="10ba")
    state.timestamp = Timestamp(batch=batch)
    return state
