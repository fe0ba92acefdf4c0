"""Profiler: a jax.profiler trace of the chosen batches, always stopped."""

import glob
import os

import jax
import optax
import pytest

from composerjax import ArrayLoader, Callback, State, Trainer
from composerjax.callbacks import profiler as profiler_module
from composerjax.callbacks.profiler import Profiler


class BatchClock(Callback):
    """Expose the current batch to the profiler spies."""

    batch = None

    def batch_start(self, state, logger):
        BatchClock.batch = ("start", state.timestamp.batch)

    def batch_end(self, state, logger):
        BatchClock.batch = ("end", state.timestamp.batch)

    def fit_end(self, state, logger):
        BatchClock.batch = ("fit_end", state.timestamp.batch)


@pytest.fixture
def profiler_calls(monkeypatch):
    """Record when start_trace / stop_trace are called (still calling the real ones)."""
    calls = []
    real_start, real_stop = jax.profiler.start_trace, jax.profiler.stop_trace

    def start_trace(log_dir, **kwargs):
        calls.append(("start_trace", BatchClock.batch))
        real_start(log_dir, **kwargs)

    def stop_trace():
        calls.append(("stop_trace", BatchClock.batch))
        real_stop()

    monkeypatch.setattr(profiler_module.jax.profiler, "start_trace", start_trace)
    monkeypatch.setattr(profiler_module.jax.profiler, "stop_trace", stop_trace)
    return calls


def train(profiler, max_duration, arrays, make_model, **kwargs):
    x, y = arrays
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration=max_duration,
                      optimizers=optax.sgd(0.1), callbacks=[BatchClock(), profiler], progress_bar=False,
                      run_summary=False, **kwargs)
    trainer.fit()
    return trainer


def test_traces_the_chosen_batches_into_an_xplane_file(tmp_path, profiler_calls, classification_arrays,
                                                       make_tiny_classifier):
    profiler = Profiler(skip_first=1, active=2, trace_dir=str(tmp_path / "trace"))
    train(profiler, "6ba", classification_arrays, make_tiny_classifier)
    # Callbacks run in order: BatchClock has already seen the event the profiler acts on.
    assert profiler_calls == [("start_trace", ("start", 1)), ("stop_trace", ("end", 3))]
    assert profiler.traced_batches == [1, 2] and not profiler.tracing
    files = glob.glob(str(tmp_path / "trace" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(files) == 1 and os.path.getsize(files[0]) > 0


def test_a_run_that_ends_early_stops_the_trace_at_fit_end(tmp_path, profiler_calls, classification_arrays,
                                                         make_tiny_classifier):
    profiler = Profiler(skip_first=1, active=5)
    train(profiler, "2ba", classification_arrays, make_tiny_classifier, run_dir=str(tmp_path / "run"))
    assert profiler_calls == [("start_trace", ("start", 1)), ("stop_trace", ("fit_end", 2))]
    assert profiler.traced_batches == [1]
    assert profiler.trace_dir == str(tmp_path / "run" / "profiler")
    assert glob.glob(str(tmp_path / "run" / "profiler" / "plugins" / "profile" / "*" / "*.xplane.pb"))


def test_close_stops_a_running_trace(tmp_path, profiler_calls):
    profiler = Profiler(skip_first=0, active=3, trace_dir=str(tmp_path))
    state = State(model=None)
    profiler.batch_start(state, None)
    assert profiler.tracing
    profiler.close(state, None)
    profiler.close(state, None)
    assert [name for name, _ in profiler_calls] == ["start_trace", "stop_trace"] and not profiler.tracing


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"skip_first": -1}, "skip_first=-1"), ({"active": 0}, "active=0"), ({"active": 1.5}, "active=1.5"),
     ({"trace_dir": 3}, "trace_dir=3")],
)
def test_invalid_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Profiler(**kwargs)
