"""Composer's time conversion for schedulers, scale_max_duration, and what the step count cannot measure."""

from __future__ import annotations

import math

import jax.numpy as jnp
import pytest

from composerjax.core.time import Time
from composerjax.optim import (
    CosineAnnealingScheduler,
    LinearWithWarmupScheduler,
    ScheduleContext,
    StepScheduler,
    convert_time,
    scale_max_duration,
)


@pytest.mark.parametrize(("time", "max_duration", "ssr", "expected"), [
    ("0.5dur", Time(4, "ep"), 1.0, Time(20, "ba")),     # dur of an epoch run: batches
    ("0.5dur", Time(4, "ep"), 0.5, Time(20, "ba")),     # dur is never scaled again (max_duration already is)
    ("0.25dur", Time(1000, "sp"), 1.0, Time(250, "sp")),  # dur of a sample run: samples
    ("0.333dur", Time(10, "ba"), 1.0, Time(3, "ba")),   # truncated
    ("2ep", Time(4, "ep"), 0.5, Time(10, "ba")),        # epochs are counted in batches, then scaled
    ("7ba", Time(4, "ep"), 0.5, Time(3, "ba")),         # int(3.5)
    ("100sp", Time(4, "ep"), 0.25, Time(25, "sp")),
    ("3iter", Time(4, "ep"), 1.0, Time(3, "iter")),
])
def test_convert_time_follows_composer(time, max_duration, ssr, expected):
    assert convert_time(time, max_duration, dataloader_len=10, ssr=ssr) == expected


@pytest.mark.parametrize(("time", "max_duration", "loader", "message"), [
    ("10sec", Time(4, "ep"), 10, "wall clock time is not an allowed time unit"),
    ("0.5dur", Time(600, "sec"), 10, "a 'dur' time is a fraction of max_duration, which is wall-clock time"),
    ("1ep", Time(4, "ba"), None, "cannot convert epochs to batches: the train data loader has no length"),
    ("0.5dur", Time(4, "ep"), None, "cannot convert epochs to batches"),
    ("1ba", None, 10, "max_duration should be set whenever schedulers are invoked"),
])
def test_convert_time_refuses_what_composer_refuses(time, max_duration, loader, message):
    with pytest.raises(ValueError, match=message):
        convert_time(time, max_duration, loader, field="t_max")


def test_scale_max_duration_truncates_in_its_own_unit():
    assert scale_max_duration("10ep", 0.25) == Time(2, "ep")
    assert scale_max_duration("7ba", 0.5) == Time(3, "ba")
    assert scale_max_duration(Time(1000, "sp"), 1.5) == Time(1500, "sp")
    assert scale_max_duration("3ep", 1.0) == Time(3, "ep")
    with pytest.raises(ValueError, match="Scale schedule has reduced the max_duration to 0"):
        scale_max_duration("1ep", 0.5)
    with pytest.raises(ValueError, match="cannot scale max_duration='7200sec'; use ep, ba, sp or tok"):
        scale_max_duration("2h", 0.5)
    with pytest.raises(ValueError, match="scale_schedule_ratio=0: expected a positive number"):
        scale_max_duration("10ep", 0)


def test_context_knows_the_run_length_in_steps_where_it_can():
    assert ScheduleContext("3ep", steps_per_epoch=7).total_steps == 21
    assert ScheduleContext("3ep").total_steps is None
    assert ScheduleContext("100sp", samples_per_step=32).total_steps == 4
    assert ScheduleContext("1000tok", tokens_per_step=300).total_steps == 4
    assert ScheduleContext("10ba").total_steps == 10
    assert ScheduleContext("2h").total_steps is None
    with pytest.raises(ValueError, match=r"ScheduleContext\(steps_per_epoch=0\): expected a positive integer"):
        ScheduleContext("3ep", steps_per_epoch=0)
    with pytest.raises(ValueError, match=r"ScheduleContext\(scale_schedule_ratio=-1\)"):
        ScheduleContext("3ep", scale_schedule_ratio=-1)
    with pytest.raises(ValueError, match=r"ScheduleContext\(max_duration='0.5dur'\): a run is measured in ep, ba"):
        ScheduleContext("50%")


def test_samples_without_a_step_size_are_refused_naming_the_argument():
    context = ScheduleContext("10ep", steps_per_epoch=10)
    with pytest.raises(ValueError) as error:
        CosineAnnealingScheduler(t_max="5000sp").multiplier(context)
    assert str(error.value) == (
        "CosineAnnealingScheduler(t_max='5000sp') (5000sp after conversion) is counted in 'sp', but the number of "
        "samples in one optimizer step is unknown (samples_per_step=None); give the time in ba, ep or dur (of a ba "
        "or ep max_duration), or a batch of fixed size")
    with pytest.raises(ValueError, match=r"LinearWithWarmupScheduler\(t_warmup='100tok'\) .*tokens_per_step=None"):
        LinearWithWarmupScheduler(t_warmup="100tok", t_max="1000tok").multiplier(context)
    with pytest.raises(ValueError, match=r"StepScheduler\(step_size='2iter'\) .*'iter', which the step count cannot"):
        StepScheduler(step_size="2iter").multiplier(context)


def test_a_dur_time_of_a_sample_run_is_counted_through_the_step_size():
    context = ScheduleContext("1000sp", samples_per_step=30)  # 33 full steps and a partial one
    multiplier = CosineAnnealingScheduler().multiplier(context)
    assert float(multiplier(jnp.int32(0))) == 1.0
    assert float(multiplier(jnp.int32(34))) == 0.0  # 1020 samples: past the end
    assert float(multiplier(jnp.int32(10))) == pytest.approx(0.5 * (1 + math.cos(0.3 * math.pi)), abs=1e-6)


def test_an_unknown_epoch_length_is_refused_for_epoch_times():
    with pytest.raises(ValueError, match=r"StepScheduler\(step_size='1ep'\): cannot convert epochs to batches"):
        StepScheduler(step_size="1ep").multiplier(ScheduleContext("100ba"))
