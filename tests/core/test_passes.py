"""Tests for composerjax.core.passes: run-first/last sorting, FILO order and the loss-interpolation warning."""

import warnings

import pytest

from composerjax.core import (
    DEFAULT_PASSES,
    Algorithm,
    Engine,
    Event,
    State,
    set_filo_order,
    sort_run_first_and_last,
    warn_if_multiple_loss_interpolation,
)
from composerjax.loggers import Logger


class Tagged(Algorithm):
    """An algorithm that matches every event and records its tag in a shared log when applied."""

    def __init__(self, tag, log=None):
        self.tag = tag
        self.log = log if log is not None else []

    def match(self, event, state):
        return True

    def apply(self, event, state, logger):
        self.log.append(self.tag)


class First(Tagged):
    run_first = True


class Last(Tagged):
    run_last = True


class Interpolating(Tagged):
    interpolates_loss = True


class OtherInterpolating(Tagged):
    interpolates_loss = True


def tags(algorithms):
    return [a.tag for a in algorithms]


# -- sort_run_first_and_last ------------------------------------------------------------------------


def test_sort_moves_run_first_to_front_and_run_last_to_back_stably():
    given = [Tagged("p1"), Last("l1"), First("f1"), Tagged("p2"), Last("l2"), First("f2"), Tagged("p3")]
    ordered = sort_run_first_and_last(given, Event.BEFORE_LOSS)
    assert tags(ordered) == ["f1", "f2", "p1", "p2", "p3", "l1", "l2"]


def test_sort_keeps_plain_algorithms_in_given_order_and_returns_a_new_list():
    given = [Tagged("c"), Tagged("a"), Tagged("b")]
    ordered = sort_run_first_and_last(given, Event.AFTER_LOSS)
    assert tags(ordered) == ["c", "a", "b"]
    assert isinstance(ordered, list)
    assert ordered is not given


def test_sort_of_nothing_is_empty():
    assert sort_run_first_and_last([], Event.BATCH_END) == []


# -- set_filo_order ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event, expected",
    [
        (Event.AFTER_LOSS, ["c", "b", "a"]),
        (Event.AFTER_FORWARD, ["c", "b", "a"]),
        (Event.AFTER_TRAIN_BATCH, ["c", "b", "a"]),
        (Event.AFTER_DATALOADER, ["c", "b", "a"]),
        (Event.BEFORE_LOSS, ["a", "b", "c"]),
        (Event.BATCH_END, ["a", "b", "c"]),
        (Event.EVAL_AFTER_FORWARD, ["a", "b", "c"]),
        (Event.EVAL_AFTER_ALL, ["a", "b", "c"]),
        (Event.INIT, ["a", "b", "c"]),
    ],
)
def test_filo_reverses_only_events_whose_name_starts_with_after(event, expected):
    given = [Tagged("a"), Tagged("b"), Tagged("c")]
    assert tags(set_filo_order(given, event)) == expected
    assert tags(given) == ["a", "b", "c"]


# -- warn_if_multiple_loss_interpolation ------------------------------------------------------------


def test_two_loss_interpolating_algorithms_warn_naming_both_classes():
    given = [Interpolating("a"), Tagged("b"), OtherInterpolating("c")]
    with pytest.warns(UserWarning) as record:
        result = warn_if_multiple_loss_interpolation(given, Event.BEFORE_LOSS)
    assert len(record) == 1
    message = str(record[0].message)
    assert "Interpolating" in message
    assert "OtherInterpolating" in message
    assert "BEFORE_LOSS" in message
    assert message.startswith("2 algorithms interpolate the loss")
    assert tags(result) == ["a", "b", "c"]


@pytest.mark.parametrize("given", [[Interpolating("a"), Tagged("b")], [Tagged("a")], []])
def test_at_most_one_loss_interpolating_algorithm_does_not_warn(given):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = warn_if_multiple_loss_interpolation(given, Event.BEFORE_LOSS)
    assert tags(result) == tags(given)


# -- the default passes, through the engine ---------------------------------------------------------


def test_default_passes_are_sort_then_filo_then_warning():
    assert DEFAULT_PASSES == (sort_run_first_and_last, set_filo_order, warn_if_multiple_loss_interpolation)


@pytest.mark.parametrize(
    "event, expected",
    [
        (Event.BEFORE_LOSS, ["first", "plain", "last"]),
        (Event.AFTER_LOSS, ["last", "plain", "first"]),
        (Event.BATCH_END, ["first", "plain", "last"]),
    ],
)
def test_engine_applies_default_pass_order_to_a_first_plain_last_trio(event, expected):
    log = []
    state = State(model=None, algorithms=[Last("last", log), Tagged("plain", log), First("first", log)])
    engine = Engine(state, Logger(state))

    traces = engine.run_event(event)

    assert log == expected
    names = {"first": "First", "plain": "Tagged", "last": "Last"}
    assert list(traces) == [f"{names[tag]}/{event.name}" for tag in expected]
    assert [trace.order for trace in traces.values()] == [0, 1, 2]


def test_engine_warns_for_two_loss_interpolating_algorithms():
    state = State(model=None, algorithms=[Interpolating("a"), OtherInterpolating("b")])
    engine = Engine(state, Logger(state))
    with pytest.warns(UserWarning, match="Interpolating, OtherInterpolating"):
        engine.run_event(Event.BEFORE_LOSS)
