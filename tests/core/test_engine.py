"""Tests for composerjax.core.engine: dispatch order, traces, callbacks, plans, passes and shutdown."""

import logging
import warnings
from collections import OrderedDict

import pytest

from composerjax.core import DEFAULT_PASSES, Algorithm, Callback, Engine, Event, State, Timestamp, Trace
from composerjax.core.callback import overridden_events
from composerjax.core.engine import UndeclaredEventWarning
from composerjax.loggers import Logger, LoggerDestination


class Recorder(Algorithm):
    """Matches the given events (all when None), logs ``(tag, event)`` and returns ``exit_code``."""

    def __init__(self, tag, log, events=None, exit_code=None):
        self.tag = tag
        self.log = log
        self.events = events
        self.exit_code = exit_code

    def match(self, event, state):
        return self.events is None or event in self.events

    def apply(self, event, state, logger):
        self.log.append((self.tag, event))
        return self.exit_code


class Other(Recorder):
    pass


class Failing(Algorithm):
    def match(self, event, state):
        return True

    def apply(self, event, state, logger):
        raise ValueError("boom")


class EveryEvent(Callback):
    """Logs ``(tag, event)`` for every event through an overridden ``run_event``."""

    def __init__(self, tag, log):
        self.tag = tag
        self.log = log

    def run_event(self, event, state, logger):
        self.log.append((self.tag, event))


class EveryEventDestination(LoggerDestination):
    def __init__(self, tag, log):
        self.tag = tag
        self.log = log

    def run_event(self, event, state, logger):
        self.log.append((self.tag, event))


class BatchEndOnly(Callback):
    def __init__(self):
        self.calls = []

    def batch_end(self, state, logger):
        self.calls.append(state.timestamp.batch)


def make_engine(algorithms=(), callbacks=(), destinations=(), **kwargs):
    state = State(model=None, algorithms=algorithms, callbacks=callbacks)
    return Engine(state, Logger(state, destinations), **kwargs)


# -- run_event: events and traces -------------------------------------------------------------------


@pytest.mark.parametrize("spelling", [Event.BEFORE_LOSS, "before_loss", "BEFORE_LOSS"])
def test_run_event_accepts_member_and_both_string_cases(spelling):
    log = []
    engine = make_engine([Recorder("a", log)])
    traces = engine.run_event(spelling)
    assert log == [("a", Event.BEFORE_LOSS)]
    assert list(traces) == ["Recorder/BEFORE_LOSS"]
    assert traces["Recorder/BEFORE_LOSS"].event is Event.BEFORE_LOSS


def test_run_event_rejects_unknown_names():
    engine = make_engine([Recorder("a", [])])
    with pytest.raises(ValueError, match="before_loss"):
        engine.run_event("befor_loss")


def test_run_event_without_algorithms_returns_empty_ordered_dict():
    traces = make_engine().run_event("batch_start")
    assert traces == OrderedDict()
    assert isinstance(traces, OrderedDict)


def test_traces_are_keyed_by_class_and_event_in_run_order_with_all_fields():
    log = []
    engine = make_engine([Recorder("a", log, exit_code=3), Other("b", log), Recorder("c", log, exit_code=0)])
    engine.state.timestamp = Timestamp(batch=7)

    traces = engine.run_event(Event.BATCH_START)

    assert isinstance(traces, OrderedDict)
    assert list(traces) == ["Recorder/BATCH_START", "Other/BATCH_START", "Recorder#1/BATCH_START"]
    assert log == [("a", Event.BATCH_START), ("b", Event.BATCH_START), ("c", Event.BATCH_START)]
    first, second, third = traces.values()
    assert (first.name, first.event, first.exit_code, first.order, first.run, first.traced, first.batch) == (
        "Recorder", Event.BATCH_START, 3, 0, True, False, 7,
    )  # fmt: skip
    assert (second.name, second.exit_code, second.order, second.run, second.traced, second.batch) == (
        "Other", None, 1, True, False, 7,
    )  # fmt: skip
    assert (third.name, third.exit_code, third.order, third.run, third.batch) == ("Recorder#1", 0, 2, True, 7)
    for key, trace in traces.items():
        assert trace.key == key


def test_only_matching_algorithms_run_and_get_traces():
    log = []
    engine = make_engine([Recorder("a", log, events={Event.BATCH_END}), Other("b", log, events={Event.FIT_START})])
    traces = engine.run_event(Event.BATCH_END)
    assert list(traces) == ["Recorder/BATCH_END"]
    assert log == [("a", Event.BATCH_END)]
    assert engine.run_event(Event.EPOCH_END) == OrderedDict()


def test_duration_is_a_float_on_host_events_and_none_on_traced_events():
    engine = make_engine([Recorder("a", [])])
    host = engine.run_event(Event.BATCH_END)["Recorder/BATCH_END"]
    assert type(host.duration_s) is float
    assert host.duration_s >= 0.0
    assert host.traced is False
    traced = engine.run_event(Event.AFTER_LOSS)["Recorder/AFTER_LOSS"]
    assert traced.duration_s is None
    assert traced.traced is True


# -- run_event: who runs when -----------------------------------------------------------------------


def test_algorithms_run_before_callbacks_then_destinations_at_normal_events():
    log = []
    engine = make_engine(
        [Recorder("algorithm", log)], [EveryEvent("callback", log)], [EveryEventDestination("destination", log)]
    )
    engine.run_event(Event.BATCH_END)
    assert [tag for tag, _ in log] == ["algorithm", "callback", "destination"]


def test_callbacks_and_destinations_run_before_algorithms_at_init():
    log = []
    engine = make_engine(
        [Recorder("algorithm", log)], [EveryEvent("callback", log)], [EveryEventDestination("destination", log)]
    )
    engine.run_event(Event.INIT)
    assert log == [("callback", Event.INIT), ("destination", Event.INIT), ("algorithm", Event.INIT)]


def test_callbacks_run_in_list_order_and_destinations_after_all_of_them():
    log = []
    engine = make_engine(
        callbacks=[EveryEvent("c1", log), EveryEvent("c2", log)],
        destinations=[EveryEventDestination("d1", log), EveryEventDestination("d2", log)],
    )
    engine.run_event(Event.FIT_START)
    assert [tag for tag, _ in log] == ["c1", "c2", "d1", "d2"]


def test_callback_overriding_run_event_receives_every_event():
    log = []
    engine = make_engine(callbacks=[EveryEvent("c", log)])
    for event in Event:
        engine.run_event(event)
    assert log == [("c", event) for event in Event]


def test_callback_is_called_only_for_the_methods_it_overrides(monkeypatch):
    # Replace every base-class event method with a spy: a dispatcher that called non-overridden methods
    # would hit it.
    base_calls = []
    for event in Event:
        monkeypatch.setattr(Callback, event.value, lambda self, state, logger, _e=event: base_calls.append(_e))
    callback = BatchEndOnly()
    engine = make_engine(callbacks=[callback])
    engine.state.timestamp = Timestamp(batch=4)

    for event in Event:
        engine.run_event(event)

    assert base_calls == []
    assert callback.calls == [4]


def test_overridden_events_are_worked_out_from_the_class():
    assert overridden_events(BatchEndOnly()) == frozenset({Event.BATCH_END})
    assert overridden_events(EveryEvent("c", [])) == frozenset(Event)
    assert overridden_events(Callback()) == frozenset()


def test_callback_added_after_the_first_event_is_picked_up():
    log = []
    engine = make_engine(callbacks=[EveryEvent("c1", log)])
    engine.run_event(Event.BATCH_START)
    engine.state.callbacks.append(EveryEvent("c2", log))
    engine.run_event(Event.BATCH_END)
    assert log == [("c1", Event.BATCH_START), ("c1", Event.BATCH_END), ("c2", Event.BATCH_END)]


def test_destination_added_after_the_first_event_is_picked_up():
    log = []
    engine = make_engine()
    engine.run_event(Event.BATCH_START)
    engine.logger.destinations.append(EveryEventDestination("d", log))
    engine.run_event(Event.BATCH_END)
    assert log == [("d", Event.BATCH_END)]


# -- errors -----------------------------------------------------------------------------------------


def test_exception_in_apply_names_algorithm_and_event_and_chains_the_original():
    engine = make_engine([Failing()])
    with pytest.raises(ValueError) as excinfo:
        engine.run_event(Event.BEFORE_LOSS)
    message = str(excinfo.value)
    assert "Failing" in message
    assert "BEFORE_LOSS" in message
    assert "boom" in message
    cause = excinfo.value.__cause__
    assert type(cause) is ValueError
    assert str(cause) == "boom"


def test_exception_that_cannot_be_rebuilt_is_still_reported_with_context():
    class NeedsTwoArgs(Exception):
        def __init__(self, a, b):
            super().__init__(a, b)

    class Broken(Failing):
        def apply(self, event, state, logger):
            raise NeedsTwoArgs(1, 2)

    engine = make_engine([Broken()])
    with pytest.raises(Exception) as excinfo:
        engine.run_event(Event.BATCH_END)
    assert "Broken" in str(excinfo.value)
    assert "BATCH_END" in str(excinfo.value)
    assert isinstance(excinfo.value.__cause__, NeedsTwoArgs)


# -- trace_log --------------------------------------------------------------------------------------


def test_trace_log_records_every_host_trace_in_order():
    engine = make_engine([Recorder("a", []), Other("b", [])])
    first = engine.run_event(Event.BATCH_START)
    second = engine.run_event(Event.BATCH_END)
    assert list(engine.trace_log) == [*first.values(), *second.values()]
    assert [t.key for t in engine.trace_log] == [
        "Recorder/BATCH_START", "Other/BATCH_START", "Recorder/BATCH_END", "Other/BATCH_END",
    ]  # fmt: skip


def test_trace_log_is_bounded_by_trace_log_size():
    engine = make_engine([Recorder("a", [])], trace_log_size=3)
    events = [Event.EPOCH_START, Event.BATCH_START, Event.BATCH_END, Event.EPOCH_END, Event.FIT_END]
    for event in events:
        engine.run_event(event)
    assert engine.trace_log.maxlen == 3
    assert [t.event for t in engine.trace_log] == events[-3:]


def test_trace_log_default_size_is_ten_thousand():
    assert make_engine().trace_log.maxlen == 10_000


# -- plan and record_plan ---------------------------------------------------------------------------


def test_plan_is_empty_without_algorithms():
    engine = make_engine()
    assert engine.plan([Event.BEFORE_FORWARD, Event.AFTER_LOSS]) == ()


def test_plan_lists_matching_events_with_ordered_algorithms():
    class First(Recorder):
        run_first = True

    plain = Recorder("plain", [], events={Event.BEFORE_LOSS, Event.AFTER_LOSS})
    first = First("first", [], events={Event.BEFORE_LOSS, Event.AFTER_LOSS})
    only_forward = Other("fwd", [], events={Event.BEFORE_FORWARD})
    engine = make_engine([plain, first, only_forward])

    plan = engine.plan([Event.BEFORE_FORWARD, Event.AFTER_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS])

    assert plan == (
        (Event.BEFORE_FORWARD, (only_forward,)),
        (Event.BEFORE_LOSS, (first, plain)),
        (Event.AFTER_LOSS, (plain, first)),
    )
    assert type(plan) is tuple
    assert all(type(algorithms) is tuple for _, algorithms in plan)


def test_plan_of_the_same_matches_is_equal_and_hashable():
    engine = make_engine([Recorder("a", [], events={Event.BEFORE_LOSS})])
    first = engine.plan([Event.BEFORE_LOSS])
    second = engine.plan([Event.BEFORE_LOSS])
    assert first == second
    assert hash(first) == hash(second)


def test_record_plan_appends_traced_traces():
    plain, other, repeat = Recorder("a", []), Other("b", []), Recorder("c", [])
    engine = make_engine([plain, other, repeat])
    plan = engine.plan([Event.BEFORE_LOSS, Event.AFTER_LOSS])

    engine.record_plan(plan, batch=5)
    engine.record_plan(plan, batch=6)

    keys = ["Recorder/BEFORE_LOSS", "Other/BEFORE_LOSS", "Recorder#1/BEFORE_LOSS",
            "Recorder/AFTER_LOSS", "Other/AFTER_LOSS", "Recorder#1/AFTER_LOSS"]  # fmt: skip
    assert [t.key for t in engine.trace_log] == keys + keys
    assert [t.batch for t in engine.trace_log] == [5] * 6 + [6] * 6
    assert [t.order for t in engine.trace_log] == [0, 1, 2, 0, 1, 2] * 2
    assert all(t.traced and t.run and t.exit_code is None and t.duration_s is None for t in engine.trace_log)
    assert engine.trace_log[0] == Trace("Recorder", Event.BEFORE_LOSS, None, 0, True, True, 5, None)


def test_apply_planned_runs_planned_algorithms_then_callbacks():
    log = []
    engine = make_engine([Recorder("a", log, events={Event.BEFORE_LOSS})], [EveryEvent("c", log)])
    plan = engine.plan([Event.BEFORE_LOSS, Event.AFTER_LOSS])
    engine.apply_planned(plan, Event.BEFORE_LOSS, engine.state)
    engine.apply_planned(plan, Event.AFTER_LOSS, engine.state)
    assert log == [("a", Event.BEFORE_LOSS), ("c", Event.BEFORE_LOSS), ("c", Event.AFTER_LOSS)]


# -- passes -----------------------------------------------------------------------------------------


def drop_other(algorithms, event):
    return [a for a in algorithms if not isinstance(a, Other)]


def keep_order(algorithms, event):
    return list(algorithms)


def test_default_passes_come_first():
    assert make_engine().algorithm_passes == list(DEFAULT_PASSES)


def test_register_pass_appends_by_default_and_inserts_at_index():
    engine = make_engine()
    defaults = list(engine.algorithm_passes)
    engine.register_pass(drop_other)
    assert engine.algorithm_passes == [*defaults, drop_other]
    engine.register_pass(keep_order, index=0)
    assert engine.algorithm_passes == [keep_order, *defaults, drop_other]
    engine.register_pass(keep_order, index=2)
    assert engine.algorithm_passes == [keep_order, defaults[0], keep_order, *defaults[1:], drop_other]


def test_constructor_passes_are_registered_after_defaults_and_pairs_at_their_index():
    engine = make_engine(algorithm_passes=[drop_other, (keep_order, 1)])
    assert engine.algorithm_passes == [DEFAULT_PASSES[0], keep_order, *DEFAULT_PASSES[1:], drop_other]


def test_constructor_pass_takes_effect_at_run_event():
    log = []
    engine = make_engine([Recorder("a", log), Other("b", log)], algorithm_passes=[drop_other])
    assert list(engine.run_event(Event.BATCH_END)) == ["Recorder/BATCH_END"]
    assert log == [("a", Event.BATCH_END)]


def test_a_pass_that_drops_an_algorithm_prevents_it_from_running():
    log = []
    engine = make_engine([Recorder("a", log), Other("b", log)])
    engine.register_pass(drop_other)
    traces = engine.run_event(Event.BATCH_END)
    assert log == [("a", Event.BATCH_END)]
    assert list(traces) == ["Recorder/BATCH_END"]
    assert engine.plan([Event.BEFORE_LOSS]) == ((Event.BEFORE_LOSS, (engine.state.algorithms[0],)),)


def test_pass_registered_after_an_event_applies_to_later_events():
    log = []
    engine = make_engine([Recorder("a", log), Other("b", log)])
    engine.run_event(Event.BATCH_END)
    engine.register_pass(drop_other)
    engine.run_event(Event.BATCH_END)
    assert log == [("a", Event.BATCH_END), ("b", Event.BATCH_END), ("a", Event.BATCH_END)]


def test_a_pass_may_reverse_the_order():
    log = []
    engine = make_engine([Recorder("a", log), Other("b", log)])
    engine.register_pass(lambda algorithms, event: list(algorithms)[::-1])
    traces = engine.run_event(Event.BATCH_END)
    assert log == [("b", Event.BATCH_END), ("a", Event.BATCH_END)]
    assert list(traces) == ["Other/BATCH_END", "Recorder/BATCH_END"]


# -- close ------------------------------------------------------------------------------------------


class Closing(Callback):
    def __init__(self, tag, log, fail=False):
        self.tag = tag
        self.log = log
        self.fail = fail

    def close(self, state, logger):
        self.log.append(("close", self.tag))
        if self.fail:
            raise OSError(f"cannot close {self.tag}")

    def post_close(self):
        self.log.append(("post_close", self.tag))


class ClosingDestination(LoggerDestination):
    def __init__(self, log):
        self.log = log

    def close(self, state, logger):
        self.log.append(("close", "destination"))

    def post_close(self):
        self.log.append(("post_close", "destination"))


def test_close_calls_close_on_all_then_post_close_on_those_that_closed(caplog):
    log = []
    engine = make_engine(
        callbacks=[Closing("ok", log), Closing("bad", log, fail=True), Closing("ok2", log)],
        destinations=[ClosingDestination(log)],
    )
    with caplog.at_level(logging.ERROR, logger="composerjax.core.engine"):
        engine.close()

    assert log == [
        ("close", "ok"), ("close", "bad"), ("close", "ok2"), ("close", "destination"),
        ("post_close", "ok"), ("post_close", "ok2"), ("post_close", "destination"),
    ]  # fmt: skip
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert "Closing" in errors[0].getMessage()
    assert errors[0].exc_info is not None
    assert str(errors[0].exc_info[1]) == "cannot close bad"
    assert engine.closed is True


def test_close_is_idempotent():
    log = []
    engine = make_engine(callbacks=[Closing("ok", log)])
    engine.close()
    engine.close()
    assert log == [("close", "ok"), ("post_close", "ok")]


def test_run_event_after_close_raises():
    engine = make_engine([Recorder("a", [])])
    engine.close()
    with pytest.raises(RuntimeError, match="close"):
        engine.run_event(Event.BATCH_END)


def test_is_quiet_follows_algorithms_and_listeners():
    from composerjax.core.algorithm import Algorithm as _Algorithm

    state = State(model=None)
    engine = Engine(state, Logger(state))
    events = (Event.BATCH_START, Event.BATCH_END)
    assert engine.is_quiet(events)

    class Listens(Callback):
        def batch_end(self, state, logger):
            pass

    state.callbacks.append(Listens())
    assert not engine.is_quiet(events)
    assert engine.is_quiet((Event.BATCH_START,))
    state.callbacks.clear()
    assert engine.is_quiet(events)

    class Never(_Algorithm):
        def match(self, event, state):
            return False

    state.algorithms.append(Never())
    assert not engine.is_quiet(events)  # no declared events: matched at every event


# -- declared events --------------------------------------------------------------------------------


class Counting(Algorithm):
    """Declares ``events``; counts every ``match`` call and matches ``matches`` (the declared ones by default)."""

    def __init__(self, declared, matches=None):
        self.events = frozenset(declared) if declared is not None else None
        self.matches = self.events if matches is None else frozenset(matches)
        self.asked = []

    def match(self, event, state):
        self.asked.append(event)
        return event in self.matches

    def apply(self, event, state, logger):
        return None


def test_declared_events_are_the_only_ones_match_is_asked_about(monkeypatch):
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "0")
    declared = Counting({Event.BEFORE_LOSS, Event.BATCH_END})
    undeclared = Counting(None, matches={Event.BEFORE_LOSS})
    engine = make_engine([declared, undeclared])

    for event in (Event.BATCH_START, Event.BATCH_END):
        engine.run_event(event)
    plan = engine.plan([Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.AFTER_LOSS])

    assert declared.asked == [Event.BATCH_END, Event.BEFORE_LOSS]
    assert undeclared.asked == [Event.BATCH_START, Event.BATCH_END, Event.BEFORE_FORWARD, Event.BEFORE_LOSS,
                                Event.AFTER_LOSS]
    assert plan == ((Event.BEFORE_LOSS, (declared, undeclared)),)
    assert engine.candidates(Event.BATCH_START) == (undeclared,)


def test_candidates_follow_changes_to_the_algorithm_list(monkeypatch):
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "0")
    engine = make_engine([Counting({Event.BATCH_END})])
    assert engine.candidates(Event.BATCH_START) == ()
    replacement = Counting({Event.BATCH_START})
    engine.state.algorithms[0] = replacement  # same length: still noticed
    assert engine.candidates(Event.BATCH_START) == (replacement,)


def test_is_quiet_when_no_algorithm_declares_the_events(monkeypatch):
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "0")
    engine = make_engine([Counting({Event.BEFORE_LOSS})])
    assert engine.is_quiet((Event.BATCH_START, Event.BATCH_END))
    engine.state.algorithms.append(Counting({Event.BATCH_END}, matches=()))
    assert not engine.is_quiet((Event.BATCH_START, Event.BATCH_END))


def test_check_mode_reports_a_match_outside_the_declared_events(monkeypatch):
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "1")
    wrong = Counting({Event.BEFORE_LOSS}, matches={Event.BEFORE_LOSS, Event.BATCH_END})
    engine = make_engine([wrong])
    engine.run_event(Event.BATCH_START)  # matches nowhere: fine
    with pytest.raises(RuntimeError, match=r"Counting\.match returned True at BATCH_END.*\['BEFORE_LOSS'\]"):
        engine.run_event(Event.BATCH_END)
    traced = make_engine([Counting({Event.BEFORE_LOSS}, matches={Event.BEFORE_FORWARD})])
    with pytest.raises(RuntimeError, match="at BEFORE_FORWARD"):
        traced.plan([Event.BEFORE_FORWARD, Event.BEFORE_LOSS])


FORGETFUL_WARNING = (
    "Counting.match accepts BATCH_END, PREDICT_END (asked at INIT), which its events=['BEFORE_LOSS'] leave out, so "
    "it never runs there: add Event.BATCH_END, Event.PREDICT_END to Counting.events "
    "(COMPOSERJAX_CHECK_EVENTS=0 turns this check off, =1 makes it an error)")


def test_init_warns_by_default_about_events_match_accepts_but_events_leave_out(monkeypatch):
    monkeypatch.delenv("COMPOSERJAX_CHECK_EVENTS")  # the default a user gets (the suite sets it to 1)
    forgetful = Counting({Event.BEFORE_LOSS}, matches={Event.BEFORE_LOSS, Event.BATCH_END, Event.PREDICT_END})
    engine = make_engine([forgetful])
    with pytest.warns(UndeclaredEventWarning) as caught:
        engine.run_event(Event.INIT)
    assert [str(warning.message) for warning in caught] == [FORGETFUL_WARNING]
    # Asked once about every undeclared event at INIT, then never again outside its events.
    assert sorted(forgetful.asked, key=list(Event).index) == [e for e in Event if e is not Event.BEFORE_LOSS]
    forgetful.asked.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.run_event(Event.BATCH_END)
    assert forgetful.asked == []


def test_a_correct_declaration_or_a_match_that_cannot_answer_at_init_gives_no_warning(monkeypatch):
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "warn")

    class NeedsABatch(Algorithm):
        events = frozenset({Event.BEFORE_LOSS})

        def match(self, event, state):
            return state.batch[0] is not None  # no batch at INIT: raises there, so it is skipped

    correct = Counting({Event.BEFORE_LOSS, Event.BATCH_END}, matches={Event.BEFORE_LOSS, Event.BATCH_END})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine([correct, NeedsABatch(), Counting(None, matches=set(Event))]).run_event(Event.INIT)


def test_the_init_events_check_is_off_with_0_and_an_error_with_1(monkeypatch):
    forgetful = Counting({Event.BEFORE_LOSS}, matches={Event.BEFORE_LOSS, Event.BATCH_END, Event.PREDICT_END})
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make_engine([forgetful]).run_event(Event.INIT)
    assert forgetful.asked == []
    monkeypatch.setenv("COMPOSERJAX_CHECK_EVENTS", "1")
    with pytest.raises(RuntimeError) as error:
        make_engine([forgetful]).run_event(Event.INIT)
    assert str(error.value) == FORGETFUL_WARNING


# -- the default match -------------------------------------------------------------------------------


def test_default_match_runs_an_algorithm_at_every_event_it_declares():
    log = []

    class Declared(Algorithm):
        events = frozenset({Event.BATCH_START, Event.BATCH_END})

        def apply(self, event, state, logger):
            log.append(event)

    engine = make_engine([Declared()])
    for event in (Event.FIT_START, Event.BATCH_START, Event.AFTER_DATALOADER, Event.BATCH_END):
        engine.run_event(event)
    assert log == [Event.BATCH_START, Event.BATCH_END]
    assert [Declared().match(event, None) for event in Event] == [event in Declared.events for event in Event]


def test_an_algorithm_without_events_must_define_match():
    class Undeclared(Algorithm):
        def apply(self, event, state, logger):
            pass

    with pytest.raises(NotImplementedError, match="Undeclared must implement match.*or declare `events`"):
        Undeclared().match(Event.INIT, None)


def test_a_logger_implements_the_core_logger_protocol():
    from composerjax.core.logger import Logger as LoggerProtocol

    assert isinstance(Logger(State(model=None)), LoggerProtocol)
    assert not isinstance(object(), LoggerProtocol)
