"""RuntimeEstimator: with a fake clock the remaining-time estimate is exact at every batch."""

from __future__ import annotations

import optax
import pytest

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.callbacks import runtime_estimator
from composerjax.callbacks.runtime_estimator import RuntimeEstimator
from composerjax.loggers import InMemoryLogger

KEY = "time/remaining_estimate"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class AdvanceClock(Callback):
    """Listed before the estimator: batch 1 (the compile) takes 5 s, every other batch 0.5 s, an eval 1 s."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def batch_end(self, state, logger):
        self.clock.now += 5.0 if state.timestamp.batch == 1 else 0.5

    def eval_end(self, state, logger):
        self.clock.now += 1.0


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(runtime_estimator, "perf_counter", fake)
    return fake


def fit(clock, arrays, make_model, estimator, **kwargs) -> dict[int, float]:
    x, y = arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_model(), ArrayLoader((x, y), batch_size=16), max_duration="2ep", optimizers=optax.sgd(0.1),
                      callbacks=[AdvanceClock(clock), estimator], loggers=[memory], progress_bar=False,
                      run_summary=False, **kwargs)
    trainer.fit()
    return dict(memory.data[KEY])


def test_estimate_leaves_out_the_compiling_batch(clock, classification_arrays, make_tiny_classifier):
    logged = fit(clock, classification_arrays, make_tiny_classifier, RuntimeEstimator(time_unit="seconds"))
    # From batch 2 on, 0.5 s per batch: 8 - n batches are left after batch n.
    assert logged == {n: 0.5 * (8 - n) for n in range(2, 9)}


def test_skip_more_batches_and_minutes(clock, classification_arrays, make_tiny_classifier):
    logged = fit(clock, classification_arrays, make_tiny_classifier,
                 RuntimeEstimator(skip_batches=3, time_unit="minutes"))
    assert sorted(logged) == [4, 5, 6, 7, 8]
    assert [logged[n] for n in sorted(logged)] == pytest.approx([0.5 * (8 - n) / 60 for n in range(4, 9)], rel=1e-12)


def test_evaluation_time_is_estimated_separately_as_composer(clock, classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    logged = fit(clock, classification_arrays, make_tiny_classifier, RuntimeEstimator(time_unit="seconds"),
                 eval_dataloader=ArrayLoader((x, y), batch_size=32))
    assert logged[4] == 2.0
    # Composer's formula after the eval at the end of epoch 1 (progress 4/8, 1 s): training took
    # 3 s - 1 s of eval for 4/8 of the run, so 2 / (4/8) * 3/8 = 1.5 s of training is left; the eval
    # came every 3/8 of progress since the measured start (1/8), so (1 - 1/8) / (3/8) = 7/3 evals
    # are expected in all, 4/3 more, at 1 s each.
    assert logged[5] == pytest.approx(1.5 + 4 / 3, rel=1e-12)
    assert logged[8] == pytest.approx(0.0 + (7 / 3 - 1) * 1.0, rel=1e-12)


def test_default_unit_is_hours_and_logged_at_init(clock, classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="2ep",
                      optimizers=optax.sgd(0.1), callbacks=[AdvanceClock(clock), RuntimeEstimator()],
                      loggers=[memory], progress_bar=False, run_summary=False)
    assert memory.hyperparameters["time/remaining_estimate_unit"] == "hours"
    trainer.fit()
    assert dict(memory.data[KEY])[2] == pytest.approx(0.5 * 6 / 3600, rel=1e-12)


@pytest.mark.parametrize("kwargs, message", [
    ({"skip_batches": -1}, "skip_batches=-1"),
    ({"time_unit": "weeks"}, "time_unit='weeks'"),
])
def test_invalid_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RuntimeEstimator(**kwargs)
