"""Tests for composerjax.core.time: units, timestrings, Time arithmetic and the Timestamp clock."""

import copy
import datetime
import pickle

import pytest

from composerjax.core.time import Time, Timestamp, TimestampCounts, TimeUnit, TimeUnitError

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
        ("10EP", 10, TimeUnit.EPOCH),
        ("0.5Dur", 0.5, TimeUnit.DURATION),
        ("2H30M", 9000, TimeUnit.SECOND),
        ("4_000tok", 4000, TimeUnit.TOKEN),
        ("-3ba", -3, TimeUnit.BATCH),
    ],
)
def test_from_timestring_exact_value_and_unit(timestring, value, unit):
    time = Time.from_timestring(timestring)
    assert time.value == value
    assert type(time.value) is type(value)
    assert time.unit is unit


@pytest.mark.parametrize(
    "bad", ["abc", "", "10", "ep", "10 epochs", "--1ep", "10ep5", "1.5ep", "1e-1ba", "2h30x", "1e400sec", "4__0tok"]
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


@pytest.mark.parametrize("timestring", ["10ep", "0.5dur", "30000tok", "1.5sec", "7iter", "-2ba"])
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


@pytest.mark.parametrize("value, unit", [(1.5, "ba"), (-2.5, "ep"), (float("nan"), "sec"), (float("inf"), "dur"),
                                         (2**63, "tok"), (-(2**63), "sp")])
def test_invalid_values_raise(value, unit):
    with pytest.raises(ValueError):
        Time(value, unit)


def test_negative_amounts_are_times():
    # Needed for -Time and for Time - Time below zero; the trainer refuses them where it reads arguments.
    assert Time(-1, "ep").value == -1
    assert Time(-0.25, "dur").value == -0.25
    assert Time(1, "ep") - Time(2, "ep") == Time(-1, "ep")


def test_non_numeric_value_raises_type_error():
    with pytest.raises(TypeError):
        Time("10", "ep")
    with pytest.raises(TypeError):
        Time(True, "ep")


def test_from_input():
    epochs = Time(10, "ep")
    assert Time.from_input(epochs) is epochs
    assert Time.from_input("100ba") == Time(100, "ba")
    assert Time.from_input(3, default_int_unit="ep") == Time(3, "ep")
    assert Time.from_input(3, "BA") == Time(3, "ba")
    assert Time.from_input(0.25, default_int_unit=TimeUnit.DURATION) == Time(0.25, "dur")
    # The former keyword still works.
    assert Time.from_input(3, default_unit="ep") == Time(3, "ep")
    with pytest.raises(TimeUnitError, match="default_int_unit"):
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
    assert Time(0.5, "dur") * 0.5 == Time(0.25, "dur")
    assert Time(100, "ba") / 4 == Time(25, "ba")


def test_numbers_are_read_in_the_times_unit():
    assert Time(10, "ep") + 5 == Time(15, "ep")
    assert 5 + Time(10, "ep") == Time(15, "ep")
    assert Time(10, "ep") - 3 == Time(7, "ep")
    assert 3 - Time(10, "ep") == Time(-7, "ep")
    assert "12ep" - Time(10, "ep") == Time(2, "ep")
    assert Time(10, "ba") % 4 == Time(2, "ba")
    assert Time(10, "ba") // 4 == Time(2, "ba")
    with pytest.raises(ValueError, match="whole numbers"):
        Time(10, "ba") + 0.5
    assert Time(1, "sec") + 0.5 == Time(1.5, "sec")
    with pytest.raises(ValueError, match="64 bits"):
        Time(2**63 - 1, "tok") + 1
    with pytest.raises(ValueError, match="64 bits"):
        -Time(2**63 - 1, "tok") - 2


def test_duration_products_and_ratios():
    assert Time(10, "ep") * Time(0.5, "dur") == Time(5, "ep")
    assert Time(0.5, "dur") * Time(10, "ep") == Time(5, "ep")
    assert Time(10, "ep") * "25%" == Time(2, "ep")
    assert Time(0.5, "dur") * Time(0.5, "dur") == Time(0.25, "dur")
    ratio = Time(100, "ba") / Time(400, "ba")
    assert (ratio.value, ratio.unit) == (0.25, TimeUnit.DURATION)
    assert Time(100, "ba") / "400ba" == Time(0.25, "dur")
    with pytest.raises(TimeUnitError, match="'dur'"):
        Time(10, "ba") * Time(2, "ba")


def test_unary_conversions_and_truth():
    assert -Time(3, "ba") == Time(-3, "ba")
    time = Time(3, "ba")
    assert +time is time
    assert int(Time(7, "sp")) == 7 and type(int(Time(7, "sp"))) is int
    assert float(Time(7, "sp")) == 7.0 and type(float(Time(7, "sp"))) is float
    assert int(Time(0.75, "dur")) == 0
    assert bool(Time(0, "ba")) is False and bool(Time(1, "ba")) is True


def test_scalar_scaling_of_whole_counts_rounds_down():
    # 10 * 0.7 is 7.000000000000001 in floats: that noise must not cost or add a batch.
    assert (Time(10, "ba") * 0.7).value == 7
    assert (Time(10, "ba") * 0.25).value == 2
    assert (Time(10, "ba") / 3).value == 3
    assert (Time(100, "ba") * 0.29).value == 29  # 28.999999999999996 in floats
    assert (Time(-7, "ba") / 2).value == -3  # toward zero, as Composer's int()
    assert type((Time(10, "ba") * 0.5).value) is int


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


def test_comparing_with_other_objects_is_not_an_error():
    assert Time(10, "ep") != None  # noqa: E711
    assert Time(10, "ep") != [10]
    assert Time(1, "ep") != True  # noqa: E712 (a bool is not an amount)
    with pytest.raises(TypeError):
        _ = Time(10, "ep") < None


@pytest.mark.parametrize(
    "operation",
    [
        lambda a, b: a + b,
        lambda a, b: a - b,
        lambda a, b: a * b,
        lambda a, b: a / b,
        lambda a, b: a % b,
        lambda a, b: a // b,
        lambda a, b: a < b,
        lambda a, b: a <= b,
        lambda a, b: a > b,
        lambda a, b: a >= b,
        lambda a, b: a == b,
        lambda a, b: a != b,
        lambda a, b: a + str(b),
    ],
)
def test_cross_unit_operations_raise_naming_both_units(operation):
    # A ValueError like every bad time here, and a RuntimeError as in Composer.
    with pytest.raises(TimeUnitError) as excinfo:
        operation(Time(10, "ep"), Time(10, "ba"))
    assert isinstance(excinfo.value, ValueError) and isinstance(excinfo.value, RuntimeError)
    assert "'ep'" in str(excinfo.value) and "'ba'" in str(excinfo.value)


def test_operations_with_unsupported_types_are_type_errors():
    with pytest.raises(TypeError):
        Time(10, "ep") + [1]
    with pytest.raises(TypeError):
        Time(10, "ep") * None


# -- Timestamp --------------------------------------------------------------------------------------


def test_timestamp_counters_after_a_run():
    clock = Timestamp()
    for _ in range(3):
        clock = clock.to_next_batch(samples=8, tokens=100, duration=0.5)
    clock = clock.to_next_epoch(duration=0.25)
    clock = clock.to_next_batch(samples=4, tokens=50, duration=datetime.timedelta(seconds=1))
    assert clock.counts == TimestampCounts(
        iteration=0,
        epoch=1,
        batch=4,
        sample=28,
        token=350,
        epoch_in_iteration=1,
        token_in_iteration=350,
        batch_in_epoch=1,
        sample_in_epoch=4,
        token_in_epoch=50,
        total_wct=2.75,
        iteration_wct=2.75,
        epoch_wct=1.0,
        batch_wct=1.0,
    )
    assert clock == Timestamp(epoch=1, batch=4, sample=28, token=350, epoch_in_iteration=1, token_in_iteration=350,
                              batch_in_epoch=1, sample_in_epoch=4, token_in_epoch=50, total_wct=2.75,
                              iteration_wct=2.75, epoch_wct=1.0, batch_wct=1.0)


def test_fields_are_times_and_wall_clock_fields_timedeltas():
    clock = Timestamp().to_next_batch(samples=8, tokens=16, duration=0.5)
    assert repr(clock.batch) == "Time(1, TimeUnit.BATCH)"
    assert repr(clock.sample_in_epoch) == "Time(8, TimeUnit.SAMPLE)"
    assert repr(clock.token_in_iteration) == "Time(16, TimeUnit.TOKEN)"
    assert repr(clock.epoch_in_iteration) == "Time(0, TimeUnit.EPOCH)"
    assert clock.batch.value == 1 and type(clock.batch.value) is int
    assert clock.total_wct == datetime.timedelta(milliseconds=500)
    assert clock.batch_wct.total_seconds() == 0.5
    assert type(clock.counts.total_wct) is float and clock.counts.batch == 1


def test_to_next_batch_takes_times_timedeltas_and_seconds():
    clock = Timestamp().to_next_batch(Time(4, "sp"), Time(9, "tok"), datetime.timedelta(seconds=2))
    assert clock.counts[:5] == (0, 0, 1, 4, 9)
    assert clock.to_next_batch(duration=1.5).counts.total_wct == 3.5
    assert clock.to_next_batch().counts.batch_wct == 0.0
    with pytest.raises(ValueError, match="'sp'"):
        clock.to_next_batch(samples=Time(4, "tok"))
    with pytest.raises(TypeError, match="timedelta"):
        clock.to_next_batch(duration="2s")


def test_to_next_batches_is_batches_times_to_next_batch():
    grouped = Timestamp().to_next_batches(4, samples=32, tokens=8, duration=2.0)
    one_by_one = Timestamp()
    for _ in range(4):
        one_by_one = one_by_one.to_next_batch(samples=8, tokens=2, duration=0.5)
    assert grouped == one_by_one
    assert grouped.counts.batch_wct == 0.5


def test_to_next_epoch_resets_epoch_counters():
    clock = Timestamp().to_next_batch(samples=8, tokens=16, duration=2.0).to_next_epoch(duration=1.0)
    assert (clock.epoch, clock.epoch_in_iteration) == (1, 1)
    assert (clock.batch_in_epoch, clock.sample_in_epoch, clock.token_in_epoch) == (0, 0, 0)
    assert clock.counts[10:] == (3.0, 3.0, 0.0, 0.0)  # total, iteration, epoch, batch wct
    assert (clock.batch, clock.sample, clock.token, clock.token_in_iteration) == (1, 8, 16, 16)


def test_to_next_iteration_restarts_iteration_and_epoch_counters():
    clock = Timestamp().to_next_batch(samples=8, tokens=16, duration=2.0).to_next_epoch()
    clock = clock.to_next_batch(samples=4, tokens=4, duration=1.0).to_next_iteration(duration=0.5)
    assert clock.counts == TimestampCounts(iteration=1, epoch=1, batch=2, sample=12, token=20, total_wct=3.5)


def test_timestamp_is_immutable():
    clock = Timestamp()
    with pytest.raises(AttributeError, match="immutable"):
        clock.batch = 3
    with pytest.raises(AttributeError, match="immutable"):
        clock.counts = TimestampCounts()
    advanced = clock.to_next_batch(samples=1)
    assert clock.batch == 0 and advanced.batch == 1


def test_constructor_checks_counter_units():
    assert Timestamp(batch=Time(3, "ba"), epoch=2).counts[:3] == (0, 2, 3)
    with pytest.raises(ValueError, match="batch_in_epoch"):
        Timestamp(batch_in_epoch=Time(3, "ep"))
    with pytest.raises(ValueError, match="whole numbers"):
        Timestamp(sample=1.5)


def test_timestamp_get():
    clock = Timestamp(epoch=2, iteration=1, batch=30, sample=960, token=9600, total_wct=12.5)
    assert clock.get("ep") == Time(2, "ep")
    assert clock.get(TimeUnit.ITERATION) == Time(1, "iter")
    assert clock.get("batch") == Time(30, "ba")
    assert clock.get("SP") == Time(960, "sp")
    assert clock.get("tok") == Time(9600, "tok")
    assert clock.get("sec") == Time(12.5, "sec")
    with pytest.raises(ValueError, match="max_duration"):
        clock.get("dur")


def test_timestamp_compares_with_times_in_their_unit():
    clock = Timestamp(epoch=3, batch=30)
    assert clock >= "3ep" and not clock > "3ep" and clock < Time(31, "ba") and clock <= "30BA"
    assert clock == "30ba" and clock != "31ba"
    assert Time(10, "ep") > clock  # reflected
    assert clock != Timestamp(epoch=3)
    with pytest.raises(TypeError):
        _ = clock < 3
    with pytest.raises(ValueError, match="max_duration"):
        _ = clock < "0.5dur"


def test_copy_and_state_dict_round_trip():
    clock = Timestamp().to_next_batch(samples=8, tokens=64, duration=0.5).to_next_epoch()
    assert clock.copy(batch=7).batch == 7
    assert clock.copy(batch_wct=datetime.timedelta(seconds=2)).counts.batch_wct == 2.0
    assert clock.copy() == clock
    with pytest.raises(TypeError, match="bogus"):
        clock.copy(bogus=1)
    state = clock.state_dict()
    assert state == {
        "iteration": 0,
        "epoch": 1,
        "batch": 1,
        "sample": 8,
        "token": 64,
        "epoch_in_iteration": 1,
        "token_in_iteration": 64,
        "batch_in_epoch": 0,
        "sample_in_epoch": 0,
        "token_in_epoch": 0,
        "total_wct": 0.5,
        "iteration_wct": 0.5,
        "epoch_wct": 0.0,
        "batch_wct": 0.0,
    }
    assert all(type(value) in (int, float) for value in state.values())
    assert Timestamp.from_state_dict(state) == clock
    assert Timestamp.from_state_dict(pickle.loads(pickle.dumps(state))) == clock


def test_state_dicts_written_before_the_iteration_fields_still_load():
    old = {"epoch": 1, "iteration": 0, "batch": 5, "sample": 40, "token": 0, "batch_in_epoch": 1,
           "sample_in_epoch": 8, "token_in_epoch": 0, "epoch_in_iteration": 1, "total_wct": 2.5,
           "epoch_wct": 0.5, "batch_wct": 0.5}
    restored = Timestamp.from_state_dict(old)
    assert restored.counts == TimestampCounts(epoch=1, batch=5, sample=40, batch_in_epoch=1, sample_in_epoch=8,
                                              epoch_in_iteration=1, total_wct=2.5, epoch_wct=0.5, batch_wct=0.5)


def test_from_state_dict_casts_numbers_and_rejects_unknown_fields():
    restored = Timestamp.from_state_dict({"batch": 5.0, "total_wct": 3, "epoch_wct": datetime.timedelta(seconds=2)})
    assert restored == Timestamp(batch=5, total_wct=3.0, epoch_wct=2.0)
    assert type(restored.counts.batch) is int and type(restored.counts.total_wct) is float
    with pytest.raises(ValueError, match="bogus"):
        Timestamp.from_state_dict({"bogus": 1})


def test_timestamp_pickles_copies_hashes_and_reprs():
    clock = Timestamp().to_next_batch(samples=3, tokens=4, duration=1.5)
    assert pickle.loads(pickle.dumps(clock)) == clock
    assert copy.deepcopy(clock) == clock and copy.copy(clock) == clock
    assert hash(clock) == hash(Timestamp.from_state_dict(clock.state_dict()))
    assert repr(Timestamp(batch=2, total_wct=1.5)) == (
        "Timestamp(iteration=0, epoch=0, batch=2, sample=0, token=0, epoch_in_iteration=0, token_in_iteration=0, "
        "batch_in_epoch=0, sample_in_epoch=0, token_in_epoch=0, total_wct=datetime.timedelta(seconds=1, "
        "microseconds=500000), iteration_wct=datetime.timedelta(0), epoch_wct=datetime.timedelta(0), "
        "batch_wct=datetime.timedelta(0))")
    assert eval(repr(clock), {"Timestamp": Timestamp, "datetime": datetime}) == clock


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
        (-2, {"default_unit": "ba"}, "interval=-2: expected a non-negative time$"),
        ("-1ep", {}, "interval='-1ep': expected a non-negative time$"),
        ("1ep", {"minimum": 2}, "interval='1ep': expected at least 2ep$"),
    ],
)
def test_parse_time_names_the_argument_in_every_error(value, kwargs, message):
    from composerjax.core.time import parse_time

    with pytest.raises(ValueError, match=message):
        parse_time(value, "interval", **kwargs)


def test_parse_time_with_no_minimum_accepts_negative_times():
    from composerjax.core.time import parse_time

    assert parse_time("-2ba", "offset", minimum=None) == Time(-2, "ba")


# -- negative times are refused where the trainer reads its arguments -------------------------------


@pytest.mark.parametrize("value, shown", [(-1, "'-1'"), ("-2ba", "'-2ba'"), (Time(-3, "ep"), "'-3ep'")])
def test_trainer_time_arguments_refuse_negative_times_naming_the_field(value, shown):
    from composerjax.core.validation import to_time

    with pytest.raises(ValueError, match=f"^max_duration={shown}: expected a non-negative time$"):
        to_time(value, "max_duration")
    assert to_time(0, "max_duration") == Time(0, "ep")


def test_max_duration_refuses_negative_times():
    from composerjax.core.state import State, as_max_duration

    with pytest.raises(ValueError, match="^max_duration='-5ba': expected a non-negative time$"):
        as_max_duration(Time(-5, "ba"))
    state = State(model=None, max_duration="2ep")
    with pytest.raises(ValueError, match="non-negative"):
        state.max_duration = -Time(2, "ep")
    assert state.max_duration == Time(2, "ep")
