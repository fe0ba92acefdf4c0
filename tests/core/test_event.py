"""Tests for composerjax.core.event: the lifecycle order, name lookup and event properties."""

import pytest

from composerjax.core import Event

LIFECYCLE = [
    "INIT", "BEFORE_LOAD", "AFTER_LOAD", "FIT_START", "ITERATION_START", "EPOCH_START", "BEFORE_DATALOADER",
    "AFTER_DATALOADER", "BATCH_START", "BEFORE_TRAIN_BATCH", "BEFORE_FORWARD", "AFTER_FORWARD", "BEFORE_LOSS",
    "AFTER_LOSS", "BEFORE_BACKWARD", "AFTER_BACKWARD", "AFTER_TRAIN_BATCH", "AFTER_OPTIMIZER_STEP", "BATCH_END",
    "BATCH_CHECKPOINT", "EPOCH_END", "EPOCH_CHECKPOINT", "ITERATION_END", "ITERATION_CHECKPOINT", "FIT_END",
    "EVAL_BEFORE_ALL", "EVAL_START", "EVAL_BATCH_START", "EVAL_BEFORE_FORWARD", "EVAL_AFTER_FORWARD",
    "EVAL_BATCH_END", "EVAL_END", "EVAL_AFTER_ALL", "EVAL_STANDALONE_START", "EVAL_STANDALONE_END",
    "PREDICT_START", "PREDICT_BATCH_START", "PREDICT_BEFORE_FORWARD", "PREDICT_AFTER_FORWARD",
    "PREDICT_BATCH_END", "PREDICT_END",
]  # fmt: skip

TRACED = {
    "BEFORE_TRAIN_BATCH", "BEFORE_FORWARD", "AFTER_FORWARD", "BEFORE_LOSS", "AFTER_LOSS", "BEFORE_BACKWARD",
    "AFTER_BACKWARD", "AFTER_TRAIN_BATCH", "AFTER_OPTIMIZER_STEP", "EVAL_BEFORE_FORWARD", "EVAL_AFTER_FORWARD",
    "PREDICT_BEFORE_FORWARD", "PREDICT_AFTER_FORWARD",
}  # fmt: skip


# -- members and lookup -----------------------------------------------------------------------------


def test_members_follow_the_lifecycle_order_of_the_design():
    assert [event.name for event in Event] == LIFECYCLE
    assert len(Event) == 41


def test_values_are_the_lower_case_names():
    assert [event.value for event in Event] == [name.lower() for name in LIFECYCLE]
    assert Event.BEFORE_LOSS == "before_loss"
    assert isinstance(Event.BEFORE_LOSS, str)


@pytest.mark.parametrize("name", LIFECYCLE)
def test_lower_and_upper_case_strings_give_the_same_member(name):
    member = Event[name]
    assert Event(name.lower()) is member
    assert Event(name) is member
    assert Event(member) is member


def test_mixed_case_and_padded_strings_are_accepted():
    assert Event("Before_Loss") is Event.BEFORE_LOSS
    assert Event(" batch_end ") is Event.BATCH_END


def test_unknown_name_raises_value_error_with_close_matches():
    with pytest.raises(ValueError) as excinfo:
        Event("befor_loss")
    message = str(excinfo.value)
    assert "'befor_loss'" in message
    assert "Did you mean" in message
    assert "before_loss" in message


def test_unknown_name_without_close_match_has_no_suggestion():
    with pytest.raises(ValueError) as excinfo:
        Event("zzzzzzzz")
    assert "'zzzzzzzz'" in str(excinfo.value)
    assert "Did you mean" not in str(excinfo.value)


def test_non_string_raises_value_error():
    with pytest.raises(ValueError, match="expected an Event or its name"):
        Event(3)


# -- properties -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "event, is_before, is_after",
    [
        (Event.INIT, False, False),
        (Event.BEFORE_LOSS, True, False),
        (Event.AFTER_LOSS, False, True),
        (Event.BATCH_START, True, False),
        (Event.BATCH_END, False, True),
        (Event.FIT_START, True, False),
        (Event.FIT_END, False, True),
        (Event.BEFORE_TRAIN_BATCH, True, False),
        (Event.AFTER_TRAIN_BATCH, False, True),
        (Event.BATCH_CHECKPOINT, False, False),
        (Event.EVAL_BEFORE_ALL, True, False),
        (Event.EVAL_AFTER_ALL, False, True),
        (Event.EVAL_BATCH_START, True, False),
        (Event.EVAL_BATCH_END, False, True),
        (Event.PREDICT_START, True, False),
        (Event.PREDICT_END, False, True),
    ],
)
def test_is_before_and_is_after_event(event, is_before, is_after):
    assert event.is_before_event is is_before
    assert event.is_after_event is is_after


@pytest.mark.parametrize(
    "before, after",
    [
        (Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD),
        (Event.PREDICT_BEFORE_FORWARD, Event.PREDICT_AFTER_FORWARD),
        (Event.EVAL_BEFORE_ALL, Event.EVAL_AFTER_ALL),
    ],
)
def test_eval_and_predict_pairs_open_and_close_and_share_a_canonical_name(before, after):
    # As in Composer, the eval/predict pairs open and close like BEFORE_/AFTER_FORWARD and share a canonical name.
    assert before.is_before_event is True
    assert after.is_after_event is True
    assert before.canonical_name == after.canonical_name


@pytest.mark.parametrize(
    "event, canonical",
    [
        (Event.INIT, "init"),
        (Event.BEFORE_FORWARD, "forward"),
        (Event.AFTER_FORWARD, "forward"),
        (Event.BEFORE_TRAIN_BATCH, "train_batch"),
        (Event.AFTER_TRAIN_BATCH, "train_batch"),
        (Event.BATCH_START, "batch"),
        (Event.BATCH_END, "batch"),
        (Event.FIT_START, "fit"),
        (Event.EVAL_BATCH_START, "eval_batch"),
        (Event.PREDICT_END, "predict"),
        (Event.BATCH_CHECKPOINT, "batch_checkpoint"),
    ],
)
def test_canonical_name_strips_before_after_and_start_end(event, canonical):
    assert event.canonical_name == canonical


def test_is_eval_and_is_predict_select_exactly_their_loops():
    assert {e.name for e in Event if e.is_eval} == {
        "EVAL_BEFORE_ALL", "EVAL_START", "EVAL_BATCH_START", "EVAL_BEFORE_FORWARD", "EVAL_AFTER_FORWARD",
        "EVAL_BATCH_END", "EVAL_END", "EVAL_AFTER_ALL", "EVAL_STANDALONE_START", "EVAL_STANDALONE_END",
    }  # fmt: skip
    assert {e.name for e in Event if e.is_predict} == {
        "PREDICT_START", "PREDICT_BATCH_START", "PREDICT_BEFORE_FORWARD", "PREDICT_AFTER_FORWARD",
        "PREDICT_BATCH_END", "PREDICT_END",
    }  # fmt: skip
    assert Event.BEFORE_FORWARD.is_eval is False
    assert Event.BEFORE_FORWARD.is_predict is False


def test_traced_events_are_exactly_the_compiled_step_events():
    assert {e.name for e in Event if e.is_traced} == TRACED


@pytest.mark.parametrize("event", [Event.INIT, Event.BATCH_START, Event.BATCH_END, Event.EVAL_START, Event.FIT_END])
def test_host_events_are_not_traced(event):
    assert event.is_traced is False
