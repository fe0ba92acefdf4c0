"""Composer's documented Time / Timestamp semantics (``composer/core/time.py`` and its ``tests/test_time.py``).

Each test states a behaviour a Composer user relies on, with the exact values Composer gives.
"""

import datetime

import pytest

from composerjax.core.time import Time, Timestamp, TimeUnit, ensure_time

# -- parsing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timestring, value, unit",
    [
        ("2iter", 2, TimeUnit.ITERATION),
        ("1ep", 1, TimeUnit.EPOCH),
        ("2ba", 2, TimeUnit.BATCH),
        ("3e10sp", 3 * 10**10, TimeUnit.SAMPLE),
        ("3_0e10sp", 30 * 10**10, TimeUnit.SAMPLE),
        ("4tok", 4, TimeUnit.TOKEN),
        ("4_000tok", 4000, TimeUnit.TOKEN),
        ("4_00_0tok", 4000, TimeUnit.TOKEN),
        ("0.5dur", 0.5, TimeUnit.DURATION),
        ("1h20m40s", 4840, TimeUnit.SECOND),
        ("10EP", 10, TimeUnit.EPOCH),
        ("10Ba", 10, TimeUnit.BATCH),
        ("-1ep", -1, TimeUnit.EPOCH),
        ("1.0iter", 1, TimeUnit.ITERATION),
        ("030.0sp", 30, TimeUnit.SAMPLE),
    ],
)
def test_time_parse(timestring, value, unit):
    time = Time.from_timestring(timestring)
    assert (time.value, time.unit) == (value, unit)
    assert type(time.value) is type(value)


@pytest.mark.parametrize(
    "timestring, time",
    [("2iter", Time(2, TimeUnit.ITERATION)), ("1ep", Time(1, TimeUnit.EPOCH)), ("2ba", Time(2, TimeUnit.BATCH)),
     ("3sp", Time(3, TimeUnit.SAMPLE)), ("4tok", Time(4, TimeUnit.TOKEN)), ("0.5dur", Time(0.5, TimeUnit.DURATION)),
     ("6sec", Time(6, TimeUnit.SECOND))],
)
def test_to_timestring(timestring, time):
    assert time.to_timestring() == timestring
    assert str(time) == timestring


@pytest.mark.parametrize("timestring", ["1.1iter", "1.5ep", "2.1ba", "3.2sp", "3.4tok"])
def test_fractional_counts_are_refused(timestring):
    with pytest.raises(ValueError, match="whole numbers"):
        Time.from_timestring(timestring)


def test_units_are_case_insensitive():
    assert Time(10, "EP") == Time(10, TimeUnit.EPOCH)
    assert Time.from_timestring("10EP") == Time(10, "ep")
    assert TimeUnit("TOK") is TimeUnit.TOKEN


def test_time_repr_evaluates_back():
    time = Time(1, "tok")
    assert repr(time) == "Time(1, TimeUnit.TOKEN)"
    assert eval(repr(time)) == time


# -- arithmetic and comparison ----------------------------------------------------------------------


def test_time_math():
    t1, t2, t3 = Time.from_timestring("1ep"), Time.from_timestring("2ep"), Time.from_timestring("3ep")
    t4 = Time.from_timestring("0.5dur")
    assert t1 + t2 == t3
    assert t2 - t1 == t1
    assert t1 - t2 == -t1
    assert t1 < t2 and t1 <= t2 and t2 > t1 and t2 >= t1 and t3 >= t3 and t3 <= t3
    assert t4 * t2 == t1
    assert 0.5 * t2 == t1
    assert t4 * 2 == Time.from_timestring("1dur")
    assert t1 / t2 == t4
    assert t2 / 2 == t1
    assert t3 % t3 == Time.from_timestring("0ep")
    assert t3 % t2 == t1


@pytest.mark.parametrize(
    "expression, value, unit",
    [
        (lambda: Time(10, "ep") + 5, 15, TimeUnit.EPOCH),
        (lambda: 5 + Time(10, "ep"), 15, TimeUnit.EPOCH),
        (lambda: Time(10, "ep") + "5ep", 15, TimeUnit.EPOCH),
        (lambda: Time(10, "ep") - 15, -5, TimeUnit.EPOCH),
        (lambda: 15 - Time(10, "ep"), 5, TimeUnit.EPOCH),
        (lambda: -Time(10, "ba"), -10, TimeUnit.BATCH),
        (lambda: +Time(10, "ba"), 10, TimeUnit.BATCH),
        (lambda: Time(10, "ep") * Time(0.5, "dur"), 5, TimeUnit.EPOCH),
        (lambda: Time(0.5, "dur") * Time(10, "ep"), 5, TimeUnit.EPOCH),
        (lambda: Time(10, "ep") * 0.25, 2, TimeUnit.EPOCH),
        (lambda: Time(4, "ep") / Time(2, "ep"), 2.0, TimeUnit.DURATION),
        (lambda: Time(3, "ba") / Time(4, "ba"), 0.75, TimeUnit.DURATION),
        (lambda: Time(4, "ep") / 2, 2, TimeUnit.EPOCH),
        (lambda: Time(7, "ba") / 2, 3, TimeUnit.BATCH),
        (lambda: Time(10, "sp") % Time(4, "sp"), 2, TimeUnit.SAMPLE),
        (lambda: Time(10, "sp") % 4, 2, TimeUnit.SAMPLE),
    ],
)
def test_arithmetic_table(expression, value, unit):
    result = expression()
    assert (result.value, result.unit) == (value, unit)
    assert type(result.value) is type(value)


def test_int_and_float_read_the_amount():
    assert int(Time(7, "ba")) == 7
    assert float(Time(7, "ba")) == 7.0
    assert int(Time(0.5, "dur")) == 0


def test_comparisons_with_numbers_and_strings_use_the_times_unit():
    assert Time(42, "ba") > 41 and Time(42, "ba") == 42 and Time(42, "ba") < "43ba"
    assert Time(0.5, "dur") == 0.5


@pytest.mark.parametrize(
    "operation",
    [
        lambda a, b: a > b, lambda a, b: a < b, lambda a, b: a >= b, lambda a, b: a <= b, lambda a, b: a == b,
        lambda a, b: a != b, lambda a, b: a + b, lambda a, b: a - b, lambda a, b: a / b, lambda a, b: a % b,
        lambda a, b: a * b,
    ],
)
def test_cross_unit_math_raises_runtime_error(operation):
    with pytest.raises(RuntimeError):
        operation(Time.from_timestring("1ep"), Time.from_timestring("1ba"))


def test_equal_times_hash_equal():
    assert hash(Time(3, "ep")) == hash(Time.from_timestring("3ep"))
    assert {Time(3, "ep"): "three"}[Time(3, "ep")] == "three"


# -- from_input, ensure_time, from_timedelta --------------------------------------------------------


def test_time_from_input():
    expected = Time(1, TimeUnit.EPOCH)
    assert Time.from_input(expected) is expected
    assert Time.from_input("1ep") == expected
    assert Time.from_input(1, TimeUnit.EPOCH) == expected
    assert Time.from_input(1, "ep") == expected
    assert Time.from_input(1, default_int_unit="ep") == expected
    with pytest.raises(RuntimeError, match="default_int_unit"):
        Time.from_input(1)


def test_ensure_time():
    assert ensure_time(5, TimeUnit.BATCH) == Time(5, "ba")
    assert ensure_time("2ep", "ba") == Time(2, "ep")
    given = Time(0.5, "dur")
    assert ensure_time(given, "ba") is given


def test_from_timedelta():
    assert Time.from_timedelta("1h20m40s") == Time(4840, "sec")
    assert Time.from_timedelta("20m") == Time(1200, "sec")
    assert Time.from_timedelta("45s") == Time(45, "sec")
    assert Time.from_timedelta(datetime.timedelta(hours=1, seconds=5)) == Time(3605, "sec")
    assert Time.from_timedelta(datetime.timedelta(milliseconds=1500)).value == 1.5
    with pytest.raises(ValueError, match="'10ep'"):
        Time.from_timedelta("10ep")


# -- Timestamp --------------------------------------------------------------------------------------


def test_timestamp():
    timestamp = Timestamp()
    time = Time(10, "ep")
    assert timestamp < time
    assert timestamp.get(time.unit) == Time.from_epoch(0)


def test_timestamp_compares_with_timestrings():
    timestamp = Timestamp(epoch=10, batch=120)
    assert timestamp >= "10ep" and not timestamp >= "11ep"
    assert timestamp > "119ba" and timestamp <= "120ba" and timestamp == "120ba"
    assert timestamp < Time(121, "ba")


def test_timestamp_fields_are_times():
    timestamp = Timestamp(epoch=3, batch=40)
    assert isinstance(timestamp.epoch, Time) and timestamp.epoch.unit is TimeUnit.EPOCH
    assert timestamp.epoch == "3ep"
    assert timestamp.batch.value == 40
    assert timestamp.batch_in_epoch.unit is TimeUnit.BATCH
    assert timestamp.sample_in_epoch.unit is TimeUnit.SAMPLE
    assert timestamp.token_in_epoch.unit is TimeUnit.TOKEN
    assert timestamp.epoch_in_iteration.unit is TimeUnit.EPOCH
    assert timestamp.token_in_iteration.unit is TimeUnit.TOKEN


def test_timestamp_update():
    timestamp = Timestamp(epoch=1)
    timestamp_2 = timestamp.copy(batch=2)
    assert timestamp_2.epoch == 1
    assert timestamp_2.batch == 2
    assert timestamp_2.sample == 0
    assert timestamp is not timestamp_2


def test_timestamp_to_next_batch_epoch_iteration():
    seconds = datetime.timedelta(seconds=1)
    timestamp = Timestamp().to_next_batch(10, 20, 5 * seconds)
    assert (timestamp.batch, timestamp.token_in_iteration, timestamp.batch_in_epoch) == (1, 20, 1)
    assert (timestamp.sample, timestamp.sample_in_epoch, timestamp.token, timestamp.token_in_epoch) == (10, 10, 20, 20)
    assert timestamp.total_wct == timestamp.iteration_wct == timestamp.epoch_wct == timestamp.batch_wct == 5 * seconds

    timestamp = timestamp.to_next_epoch(duration=5 * seconds)
    assert (timestamp.epoch, timestamp.batch, timestamp.token_in_iteration, timestamp.batch_in_epoch) == (1, 1, 20, 0)
    assert (timestamp.sample, timestamp.sample_in_epoch, timestamp.token, timestamp.token_in_epoch) == (10, 0, 20, 0)
    assert (timestamp.total_wct, timestamp.iteration_wct) == (10 * seconds, 10 * seconds)
    assert (timestamp.epoch_wct, timestamp.batch_wct) == (0 * seconds, 0 * seconds)

    timestamp = timestamp.to_next_batch(5, 0, 10 * seconds)
    assert (timestamp.epoch, timestamp.batch, timestamp.epoch_in_iteration) == (1, 2, 1)
    assert timestamp.token_in_iteration == 20
    assert (timestamp.batch_in_epoch, timestamp.sample, timestamp.sample_in_epoch) == (1, 15, 5)
    assert (timestamp.total_wct, timestamp.iteration_wct) == (20 * seconds, 20 * seconds)
    assert (timestamp.epoch_wct, timestamp.batch_wct) == (10 * seconds, 10 * seconds)

    timestamp = timestamp.to_next_batch(5, 1, 10 * seconds)
    assert (timestamp.batch, timestamp.token_in_iteration, timestamp.batch_in_epoch) == (3, 21, 2)
    assert (timestamp.sample, timestamp.sample_in_epoch, timestamp.token, timestamp.token_in_epoch) == (20, 10, 21, 1)
    assert (timestamp.total_wct, timestamp.epoch_wct, timestamp.batch_wct) == (30 * seconds, 20 * seconds, 10 * seconds)

    timestamp = timestamp.to_next_epoch().to_next_batch(5, 1, 10 * seconds)
    assert (timestamp.epoch, timestamp.batch, timestamp.epoch_in_iteration) == (2, 4, 2)
    assert timestamp.token_in_iteration == 22
    assert (timestamp.total_wct, timestamp.epoch_wct) == (40 * seconds, 10 * seconds)

    timestamp = timestamp.to_next_iteration()
    assert (timestamp.iteration, timestamp.epoch, timestamp.batch) == (1, 2, 4)
    assert (timestamp.epoch_in_iteration, timestamp.token_in_iteration, timestamp.batch_in_epoch) == (0, 0, 0)
    assert (timestamp.sample, timestamp.sample_in_epoch, timestamp.token, timestamp.token_in_epoch) == (25, 0, 22, 0)
    assert timestamp.total_wct == 40 * seconds
    assert timestamp.iteration_wct == timestamp.epoch_wct == timestamp.batch_wct == 0 * seconds


def test_timestamp_repr_evaluates_back():
    timestamp = Timestamp().to_next_batch(3, 4, datetime.timedelta(seconds=2.5))
    assert timestamp == eval(repr(timestamp))


def test_timestamp_state_dict_round_trip_keeps_plain_numbers():
    timestamp = Timestamp().to_next_batch(8, 16, datetime.timedelta(seconds=2)).to_next_epoch()
    state = timestamp.state_dict()
    assert state["batch"] == 1 and type(state["batch"]) is int
    assert state["total_wct"] == 2.0 and type(state["total_wct"]) is float
    assert Timestamp.from_state_dict(state) == timestamp
