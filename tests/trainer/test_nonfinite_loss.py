"""A NaN loss does not pass silently: one line naming its batch, the run summary, and the skipped-update count."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import Algorithm, ArrayLoader, Event, Trainer
from composerjax.callbacks.nan_monitor import NaNMonitor
from composerjax.loggers import InMemoryLogger
from composerjax.step.summary import format_summary
from composerjax.trainer.nonfinite_loss import NAN_MONITOR_ADVICE


class NaNFrom(Algorithm):
    """A third-party algorithm gone wrong: the loss is NaN from step ``from_step`` on (batch ``from_step + 1``)."""

    def __init__(self, from_step: int) -> None:
        self.from_step = from_step

    def match(self, event, state):
        return event == Event.AFTER_LOSS

    def apply(self, event, state, logger):
        state.loss = jnp.where(state.step >= self.from_step, jnp.nan, state.loss)


def make_trainer(arrays, make_model, algorithms, duration="30ba", **kwargs):
    x, y = arrays  # 64 samples: 8 batches of 8 per epoch
    return Trainer(make_model(), ArrayLoader((x, y), batch_size=8), max_duration=duration,
                   optimizers=optax.sgd(0.1), algorithms=algorithms, progress_bar=False, run_summary=False, **kwargs)


def ran_grouped(trainer) -> bool:
    """Whether a compiled step took stacked batches (steps_per_call > 1 grouped them)."""
    return any(len(step.batch_shapes[0]) == 3 for step in trainer.state.compiled_steps)


def reported(stderr: str) -> list[str]:
    """The lines the trainer printed about the run (its lines start with 'composerjax: ')."""
    return [line for line in stderr.splitlines() if line.startswith("composerjax: ")]


@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_the_first_nan_prints_one_line_with_its_batch_from_the_logged_losses(
        classification_arrays, make_tiny_classifier, capsys, steps_per_call):
    memory = InMemoryLogger()
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [NaNFrom(4)], loggers=[memory],
                           log_interval=3, steps_per_call=steps_per_call)
    trainer.fit()
    assert int(trainer.state.timestamp.batch) == 30  # it trains on, as Composer does
    assert ran_grouped(trainer) == (steps_per_call > 1)
    # 26 NaN losses, one line: the exact batch is known from the rows the loggers got (grouped ones too).
    assert reported(capsys.readouterr().err) == [
        f"composerjax: the training loss became nan at batch 5; {NAN_MONITOR_ADVICE}"]
    assert trainer.state.run_summary["nonfinite_loss"] == {
        "loss": "nan", "first_batch": 5, "last_batch": 5, "message": "the training loss became nan at batch 5"}
    assert "  non-finite loss: the training loss became nan at batch 5" in format_summary(trainer.state.run_summary)
    assert [step for step, value in memory.data["loss/train/total"] if np.isnan(value)] == list(range(5, 31))
    trainer.fit("3ba")  # still NaN: said once per trainer
    assert reported(capsys.readouterr().err) == []
    trainer.close()


def test_without_loggers_the_last_loss_is_checked_when_it_is_read(classification_arrays, make_tiny_classifier,
                                                                  capsys):
    """No logger fetches a loss, and fit fetches none (no host sync): the final loss is checked where it is read."""
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [NaNFrom(14)], duration="10ba")
    trainer.fit()
    trainer.nonfinite_loss.last(float(trainer.state.loss))  # batches 1-10 are finite: nothing to say
    assert reported(capsys.readouterr().err) == []
    assert "nonfinite_loss" not in trainer.state.run_summary
    trainer.fit("10ba")  # NaN from batch 15: nobody has read a loss of this fit yet
    assert reported(capsys.readouterr().err) == [] and "nonfinite_loss" not in trainer.state.run_summary
    trainer.nonfinite_loss.last(float(trainer.state.loss))  # as `composerjax train` does for its results
    message = "the training loss became non-finite between batch 11 and 20 (nan at batch 20)"
    assert reported(capsys.readouterr().err) == [f"composerjax: {message}; {NAN_MONITOR_ADVICE}"]
    assert trainer.state.run_summary["nonfinite_loss"] == {
        "loss": "nan", "first_batch": 11, "last_batch": 20, "message": message}
    trainer.close()


def test_allow_nonfinite_loss_prints_nothing_and_the_summary_still_records_it(
        classification_arrays, make_tiny_classifier, capsys):
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [NaNFrom(4)], allow_nonfinite_loss=True,
                           loggers=[InMemoryLogger()])
    trainer.fit()
    assert reported(capsys.readouterr().err) == []
    assert trainer.state.run_summary["nonfinite_loss"]["message"] == "the training loss became nan at batch 5"
    trainer.close()


def test_a_finite_run_says_nothing(classification_arrays, make_tiny_classifier, capsys):
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [], duration="6ba")
    trainer.fit()
    assert reported(capsys.readouterr().err) == []
    assert "nonfinite_loss" not in trainer.state.run_summary
    assert "skipped_nonfinite_updates" not in trainer.state.run_summary  # no guard, nothing counted
    trainer.close()


def test_allow_nonfinite_loss_must_be_a_bool(classification_arrays, make_tiny_classifier):
    with pytest.raises(ValueError, match=r"allow_nonfinite_loss='yes': expected True or False"):
        make_trainer(classification_arrays, make_tiny_classifier, [], allow_nonfinite_loss="yes")


# -- skip_nonfinite_updates: how many it skipped -----------------------------------------------------
@pytest.mark.parametrize(("from_step", "steps_per_call", "skipped"), [(0, 1, 30), (4, 1, 26), (4, 5, 26), (30, 5, 0)])
def test_skip_nonfinite_updates_counts_the_skipped_updates(classification_arrays, make_tiny_classifier, capsys,
                                                           from_step, steps_per_call, skipped):
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [NaNFrom(from_step)],
                           skip_nonfinite_updates=True, steps_per_call=steps_per_call)
    trainer.fit()
    assert ran_grouped(trainer) == (steps_per_call > 1)
    assert trainer.state.run_summary["skipped_nonfinite_updates"] == {"skipped": skipped, "updates": 30}
    lines = [line for line in reported(capsys.readouterr().err) if "skip_nonfinite_updates" in line]
    if skipped:
        assert lines == [f"composerjax: skip_nonfinite_updates skipped {skipped} of 30 updates (NaN or infinite "
                         "loss or gradients); their batches still count"]
        assert (f"  skip_nonfinite_updates skipped {skipped} of 30 updates"
                in format_summary(trainer.state.run_summary))
    else:
        assert lines == []
    trainer.close()


def test_the_count_goes_on_over_fits_and_with_nan_monitors_skip_policy(classification_arrays, make_tiny_classifier,
                                                                       capsys):
    trainer = make_trainer(classification_arrays, make_tiny_classifier, [NaNFrom(8)], duration="10ba",
                           callbacks=[NaNMonitor(policy="skip")], loggers=[InMemoryLogger()])
    with pytest.warns(UserWarning, match="NaNMonitor: the loss is nan at batch 9"):
        trainer.fit()
    trainer.fit("5ba")
    assert trainer.state.run_summary["skipped_nonfinite_updates"] == {"skipped": 7, "updates": 15}
    # NaNMonitor reports the loss itself: no advice to add it; the skip count is said at each fit end.
    assert reported(capsys.readouterr().err) == [
        "composerjax: skip_nonfinite_updates skipped 2 of 10 updates (NaN or infinite loss or gradients); their "
        "batches still count",
        "composerjax: skip_nonfinite_updates skipped 7 of 15 updates (NaN or infinite loss or gradients); their "
        "batches still count"]
    assert trainer.state.run_summary["nonfinite_loss"]["first_batch"] == 9
    trainer.close()
