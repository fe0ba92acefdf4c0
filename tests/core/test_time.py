"""Tests for composerjax.core.time: units, timestrings, Time arithmetic and the Timestamp clock."""

import copy
import dataclasses
import pickle

import pytest

from composerjax.core.time import Time, Timestamp, TimeUnit

# -- TimeUnit ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spelling, unit",
    [
        ("ep", TimeUnit.EPOCH),
        ("EPOCH", TimeUnit.EPOCH),
        ("epoch", TimeUnit.EPOCH),
        ("batch", TimeUnit.BATCH),
        ("Iteration", TimeUnit.ITERATION),
        ("TOK", TimeUnit.TOKEN),
        ("sec", TimeUnit.SECOND),
        ("duration", TimeUnit.DURATION),
        ("sp", TimeUnit.SAMPLE),
    ],
)
def test_time_unit_accepts_values_and_names_in_any_case(spelling, unit):
    assert TimeUnit(spelling) is unit


def test_time_unit_rejects_unknown_with_accepted_list():
    with pytest.raises(ValueError) as excinfo:
        TimeUnit("fortnight")
    message = str(excinfo.value)
    assert "'fortnight'" in message
    for value in ("ep", "iter", "ba", "sp", "tok", "dur", "sec"):
        assert f"'{value}'" in message


# -- timestrings ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "timestring, value, unit",
    [
        ("10ep", 10, TimeUnit.EPOCH),
        ("100ba", 100, TimeUnit.BATCH),
        ("0.5dur", 0.5, TimeUnit.DURATION),
        ("1dur", 1.0, TimeUnit.DURATION),
        ("3e4tok", 30000, TimeUnit.TOKEN),
        ("2iter", 2, TimeUnit.ITERATION),
        ("30sec", 30, TimeUnit.SECOND),
        ("1.5sec", 1.5, TimeUnit.SECOND),
        ("512sp", 512, TimeUnit.SAMPLE),
        ("  10ep\n", 10, TimeUnit.EPOCH),
        ("10%", 0.1, TimeUnit.DURATION),
        ("12.5%", 0.125, TimeUnit.DURATION),
        ("2h30m", 9000, TimeUnit.SECOND),
        ("1h", 3600, TimeUnit.SECOND),
        ("45m", 2700, TimeUnit.SECOND),
        ("90s", 90, TimeUnit.SECOND),
        ("1h30m15s", 5415, TimeUnit.SECOND),
        ("1.5h", 5400, TimeUnit.SECOND),
    ],
)
def test_from_timestring_exact_value_and_unit(timestring, value, unit):
    time = Time.from_timestring(timestring)
    assert time.value == value
    assert type(time.value) is type(value)
    assert time.unit is unit


@pytest.mark.parametrize(
    "bad", ["abc", "", "10", "ep", "10 epochs", "-1ep", "10ep5", "1.5ep", "1e-1ba", "2h30x", "1e400sec"]
)
def test_from_timestring_rejects_bad_strings_naming_them(bad):
    with pytest.raises(ValueError) as excinfo:
        Time.from_timestring(bad)
    message = str(excinfo.value)
    assert repr(bad) in message
    assert "ep" in message


def test_from_timestring_message_lists_accepted_forms():
    with pytest.raises(ValueError) as excinfo:
        Time.from_timestring("abc")
    assert str(excinfo.value) == (
        "invalid time string 'abc': expected a number followed by one of ep, iter, ba, sp, tok, dur, sec "
        "(e.g. '10ep', '100ba', '0.5dur'), a percentage like '10%', or a wall-clock span like '2h30m'"
    )


@pytest.mark.parametrize("timestring", ["10ep", "0.5dur", "30000tok", "1.5sec", "7iter"])
def test_timestring_round_trips(timestring):
    time = Time.from_timestring(timestring)
    assert time.to_timestring() == timestring
    assert str(time) == timestring
    assert Time.from_timestring(str(time)) == time


# -- construction -----------------------------------------------------------------------------------


def test_constructors_and_value_types():
    assert Time.from_epoch(3) == Time(3, "ep")
    assert Time.from_iteration(2) == Time(2, TimeUnit.ITERATION)
    assert Time.from_batch(5) == Time(5, "ba")
    assert Time.from_sample(64) == Time(64, "sp")
    assert Time.from_token(30000) == Time(3e4, "tok")
    assert Time.from_duration(1).value == 1.0 and type(Time.from_duration(1).value) is float
    assert Time.from_second(2.5) == Time(2.5, "sec")
    assert type(Time(3e4, "tok").value) is int


@pytest.mark.parametrize("value, unit", [(-1, "ep"), (1.5, "ba"), (-0.1, "dur"), (float("nan"), "sec")])
def test_invalid_values_raise(value, unit):
    with pytest.raises(ValueError):
        Time(value, unit)


def test_non_numeric_value_raises_type_error():
    with pytest.raises(TypeError):
        Time("10", "ep")
    with pytest.raises(TypeError):
        Time(True, "ep")


def test_from_input():
    epochs = Time(10, "ep")
    assert Time.from_input(epochs) is epochs
    assert Time.from_input("100ba") == Time(100, "ba")
    assert Time.from_input(3, default_unit="ep") == Time(3, "ep")
    assert Time.from_input(0.25, default_unit=TimeUnit.DURATION) == Time(0.25, "dur")
    with pytest.raises(ValueError, match="default_unit"):
        Time.from_input(3)
    with pytest.raises(TypeError):
        Time.from_input([3])


def test_repr_and_immutability():
    time = Time(10, "ep")
    assert repr(time) == "Time(10, TimeUnit.EPOCH)"
    assert repr(Time(0.5, "dur")) == "Time(0.5, TimeUnit.DURATION)"
    with pytest.raises(AttributeError):
        time.value = 11
    with pytest.raises(AttributeError):
        time._value = 11
    assert not hasattr(time, "__dict__")
    assert time.value == 10


def test_pickle_and_copy_preserve_time():
    time = Time(30000, "tok")
    assert pickle.loads(pickle.dumps(time)) == time
    assert copy.deepcopy(time) == time
    assert copy.copy(time) == time


# -- arithmetic and comparison ----------------------------------------------------------------------


def test_same_unit_arithmetic():
    assert Time(10, "ep") + Time(5, "ep") == Time(15, "ep")
    assert Time(10, "ep") + "5ep" == Time(15, "ep")
    assert Time(10, "ba") - Time(4, "ba") == Time(6, "ba")
    assert Time(10, "ba") * 3 == Time(30, "ba")
    assert 3 * Time(10, "ba") == Time(30, "ba")
    assert Time(10, "ba") * Time(2, "ba") == Time(20, "ba")
    assert Time(0.5, "dur") * 0.5 == Time(0.25, "dur")
    assert Time(100, "ba") / Time(400, "ba") == 0.25
    assert Time(100, "ba") / "400ba" == 0.25
    assert Time(100, "ba") / 4 == Time(25, "ba")


def test_scalar_scaling_of_whole_counts_rounds_down():
    # 10 * 0.7 is 7.000000000000001 in floats: that noise must not cost or add a batch.
    assert (Time(10, "ba") * 0.7).value == 7
    assert (Time(10, "ba") * 0.25).value == 2
    assert (Time(10, "ba") / 3).value == 3
    assert type((Time(10, "ba") * 0.5).value) is int


def test_subtraction_below_zero_raises():
    with pytest.raises(ValueError, match="non-negative"):
        Time(1, "ep") - Time(2, "ep")


def test_comparisons():
    assert Time(1, "ep") < Time(2, "ep")
    assert Time(2, "ep") <= Time(2, "ep")
    assert Time(3, "ep") > Time(2, "ep")
    assert Time(2, "ep") >= Time(2, "ep")
    assert Time(2, "ep") == Time(2, "ep")
    assert Time(2, "ep") != Time(3, "ep")
    assert Time(2, "ep") == 2
    assert Time(2, "ep") < 2.5
    assert Time(100, "ba") == "100ba"
    assert Time(100, "ba") < "101ba"
    assert Time(0.5, "dur") >= "50%"


def test_equality_with_unparsable_string_raises():
    with pytest.raises(ValueError, match="'hello'"):
        _ = Time(10, "ep") == "hello"


def test_equal_times_hash_equal():
    assert hash(Time(3, "ep")) == hash(Time(3.0, "ep"))
    assert hash(Time(90, "sec")) == hash(Time(90.0, "sec"))
    assert len({Time(3, "ep"), Time(3, "ep"), Time(3, "ba")}) == 2
    assert {Time(3, "ep"): "a"}[Time.from_timestring("3ep")] == "a"


def test_different_units_are_unequal_not_errors():
    assert Time(10, "ep") != Time(10, "ba")
    assert not (Time(10, "ep") == "10ba")


@pytest.mark.parametrize(
    "operation",
    [
        lambda a, b: a + b,
        lambda a, b: a - b,
        lambda a, b: a * b,
        lambda a, b: a / b,
        lambda a, b: a < b,
        lambda a, b: a <= b,
        lambda a, b: a > b,
        lambda a, b: a >= b,
    ],
)
def test_cross_unit_operations_raise_naming_both_units(operation):
    with pytest.raises(ValueError) as excinfo:
        operation(Time(10, "ep"), Time(10, "ba"))
    assert "'ep'" in str(excinfo.value) and "'ba'" in str(excinfo.value)


def test_adding_a_bare_number_is_a_type_error():
    with pytest.raises(TypeError):
        Time(10, "ep") + 1


# -- Timestamp --------------------------------------------------------------------------------------


def test_timestamp_counters_after_a_run():
    clock = Timestamp()
    for _ in range(3):
        clock = clock.to_next_batch(samples=8, tokens=100, duration=0.5)
    clock = clock.to_next_epoch(duration=0.25)
    clock = clock.to_next_batch(samples=4, tokens=50, duration=1.0)
    assert clock == Timestamp(
        epoch=1,
        iteration=0,
        batch=4,
        sample=28,
        token=350,
        batch_in_epoch=1,
        sample_in_epoch=4,
        token_in_epoch=50,
        epoch_in_iteration=1,
        total_wct=2.75,
        epoch_wct=1.0,
        batch_wct=1.0,
    )


def test_to_next_epoch_resets_epoch_counters():
    clock = Timestamp().to_next_batch(samples=8, tokens=16, duration=2.0).to_next_epoch()
    assert (clock.epoch, clock.epoch_in_iteration) == (1, 1)
    assert (clock.batch_in_epoch, clock.sample_in_epoch, clock.token_in_epoch) == (0, 0, 0)
    assert (clock.epoch_wct, clock.batch_wct, clock.total_wct) == (0.0, 0.0, 2.0)
    assert (clock.batch, clock.sample, clock.token) == (1, 8, 16)


def test_to_next_iteration():
    clock = Timestamp().to_next_epoch().to_next_epoch().to_next_iteration()
    assert (clock.iteration, clock.epoch_in_iteration, clock.epoch) == (1, 0, 2)


def test_timestamp_is_immutable():
    clock = Timestamp()
    with pytest.raises(dataclasses.FrozenInstanceError):
        clock.batch = 3
    advanced = clock.to_next_batch(samples=1)
    assert clock.batch == 0 and advanced.batch == 1


def test_timestamp_get():
    clock = Timestamp(epoch=2, iteration=1, batch=30, sample=960, token=9600, total_wct=12.5)
    assert clock.get("ep") == Time(2, "ep")
    assert clock.get(TimeUnit.ITERATION) == Time(1, "iter")
    assert clock.get("batch") == Time(30, "ba")
    assert clock.get("sp") == Time(960, "sp")
    assert clock.get("tok") == Time(9600, "tok")
    assert clock.get("sec") == Time(12.5, "sec")
    with pytest.raises(ValueError, match="max_duration"):
        clock.get("dur")


def test_copy_and_state_dict_round_trip():
    clock = Timestamp().to_next_batch(samples=8, tokens=64, duration=0.5).to_next_epoch()
    assert clock.copy(batch=7).batch == 7
    assert clock.copy() == clock
    state = clock.state_dict()
    assert state == {
        "epoch": 1,
        "iteration": 0,
        "batch": 1,
        "sample": 8,
        "token": 64,
        "batch_in_epoch": 0,
        "sample_in_epoch": 0,
        "token_in_epoch": 0,
        "epoch_in_iteration": 1,
        "total_wct": 0.5,
        "epoch_wct": 0.0,
        "batch_wct": 0.0,
    }
    assert Timestamp.from_state_dict(state) == clock
    assert Timestamp.from_state_dict(pickle.loads(pickle.dumps(state))) == clock


def test_from_state_dict_casts_numbers_and_rejects_unknown_fields():
    restored = Timestamp.from_state_dict({"batch": 5.0, "total_wct": 3})
    assert restored == Timestamp(batch=5, total_wct=3.0)
    assert type(restored.batch) is int and type(restored.total_wct) is float
    with pytest.raises(ValueError, match="bogus"):
        Timestamp.from_state_dict({"bogus": 1})


def test_get_progress():
    clock = Timestamp(epoch=1, batch=25, sample=800, token=4000, total_wct=30.0)
    assert clock.get_progress(Time(4, "ep")) == 0.25
    assert clock.get_progress(Time(100, "ba")) == 0.25
    assert clock.get_progress("1600sp") == 0.5
    assert clock.get_progress(Time(8000, "tok")) == 0.5
    assert clock.get_progress(Time.from_timestring("1m")) == 0.5
    assert Timestamp(iteration=3).get_progress(Time(4, "iter")) == 0.75
    with pytest.raises(ValueError, match="dur"):
        clock.get_progress(Time(1.0, "dur"))
    with pytest.raises(ValueError, match="positive"):
        clock.get_progress(Time(0, "ba"))


# -- parse_time: the one reader of time arguments ---------------------------------------------------


def test_parse_time_reads_times_strings_and_numbers_in_the_default_unit():
    from composerjax.core.time import parse_time

    assert parse_time("45m", "time_limit") == Time(2700, "sec")
    assert parse_time("2h30m", "time_limit", (TimeUnit.SECOND,)) == Time(9000, "sec")
    assert parse_time("10%", "warmup") == Time(0.1, "dur")
    assert parse_time(3, "interval", default_unit=TimeUnit.EPOCH) == Time(3, "ep")
    given = Time(5, "ba")
    assert parse_time(given, "interval", (TimeUnit.BATCH,)) is given


@pytest.mark.parametrize(
    "value, kwargs, message",
    [
        ("soon", {}, "interval='soon': invalid time string 'soon'"),
        (3, {}, "interval=3: cannot tell the unit of bare number 3"),
        ([1], {}, r"interval=\[1\]: expected a Time, a time string or a number"),
        ("10sp", {"units": (TimeUnit.BATCH, TimeUnit.EPOCH)},
         r"interval='10sp': expected a time in 'ba', 'ep', got 'sp'$"),
        ("0ba", {"units": (TimeUnit.BATCH,), "minimum": 1, "expected": "a positive number of batches"},
         "interval='0ba': expected a positive number of batches$"),
        ("x", {"hint": "expected a time string in 'ba'"}, "interval='x': expected a time string in 'ba': invalid time"),
    ],
)
def test_parse_time_names_the_argument_in_every_error(value, kwargs, message):
    from composerjax.core.time import parse_time

    with pytest.raises(ValueError, match=message):
        parse_time(value, "interval", **kwargs)
