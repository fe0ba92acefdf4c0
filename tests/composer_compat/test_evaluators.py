"""Composer's evaluators: labelled loaders, intervals in every unit, end-of-fit eval, batch subsets."""

import numpy as np
import optax
import pytest

from composerjax import Callback, Event, Trainer
from composerjax.core.evaluator import Evaluator, ensure_evaluators
from composerjax.data import ArrayLoader
from composerjax.loggers import InMemoryLogger

E = Event
BATCH = 16  # 64 samples: 4 batches an epoch


class EvalLog(Callback):
    """The batch count of each EVAL_START, with the evaluator's label, and the eval batches run."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.eval_batches = 0

    def eval_start(self, state, logger):
        self.starts.append(int(state.timestamp.batch))

    def eval_batch_end(self, state, logger):
        self.eval_batches += 1


def run(classification_arrays, model, max_duration="2ep", **kwargs):
    x, y = classification_arrays
    log, memory = EvalLog(), InMemoryLogger()
    arguments = dict(optimizers=optax.sgd(0.1), progress_bar=False, run_summary=False, callbacks=[log],
                     loggers=[memory])
    arguments.update(kwargs)
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=BATCH, shuffle=False), max_duration, **arguments)
    trainer.fit()
    return trainer, log, memory


def val(classification_arrays, batch_size=32):
    return ArrayLoader(classification_arrays, batch_size=batch_size, shuffle=False)


def test_a_dict_of_loaders_is_evaluated_per_label(classification_arrays, make_tiny_classifier):
    trainer, _, memory = run(classification_arrays, make_tiny_classifier(), "1ep",
                             eval_dataloader={"val": val(classification_arrays), "test": val(classification_arrays, 8)})
    for label in ("val", "test"):
        assert set(trainer.state.metrics[label]) == {"MulticlassAccuracy", "CrossEntropy"}
        assert f"metrics/{label}/MulticlassAccuracy" in memory.data
    # The same data in other batch sizes: the same metrics.
    assert trainer.state.metrics["val"]["MulticlassAccuracy"] == trainer.state.metrics["test"]["MulticlassAccuracy"]
    np.testing.assert_allclose(trainer.state.metrics["val"]["CrossEntropy"],
                               trainer.state.metrics["test"]["CrossEntropy"], rtol=1e-6)


def test_a_list_of_evaluators_each_with_its_interval_and_metrics(classification_arrays, make_tiny_classifier):
    every_batch = Evaluator("fast", val(classification_arrays), metric_names=["MulticlassAccuracy"],
                            eval_interval="1ba")
    per_epoch = Evaluator("slow", val(classification_arrays))
    trainer, log, memory = run(classification_arrays, make_tiny_classifier(), "2ep",
                               eval_dataloader=[every_batch, per_epoch])
    assert len(memory.data["metrics/fast/MulticlassAccuracy"]) == 8
    assert "metrics/fast/CrossEntropy" not in memory.data  # only the metrics it names
    assert len(memory.data["metrics/slow/CrossEntropy"]) == 2
    assert log.starts == [1, 2, 3, 4, 4, 5, 6, 7, 8, 8]


@pytest.mark.parametrize(("interval", "expected"), [
    ("40sp", [3, 5, 8]),  # 16 samples a batch: 48, 80 and 128 cross multiples of 40
    ("0.25dur", [2, 4, 6, 8]),  # ceil(2 epochs * 4 batches * 0.25) = every 2 batches
    ("3ba", [3, 6, 8]),  # and at the end of fit: the last evaluation was not on the last batch
    ("1ep", [4, 8]),
    (2, [8]),  # an int counts epochs
    (0, []),  # 0 disables
])
def test_eval_interval_in_every_unit_and_at_the_end_of_fit(classification_arrays, make_tiny_classifier, interval,
                                                           expected):
    _, log, _ = run(classification_arrays, make_tiny_classifier(), "2ep", eval_dataloader=val(classification_arrays),
                    eval_interval=interval)
    assert log.starts == expected


def test_token_interval_counts_tokens(classification_arrays, make_tiny_classifier):
    # 4 tokens a sample: 64 a batch; every 100 tokens crosses a multiple at batches 2, 4, 5, 7 and 8.
    _, log, _ = run(classification_arrays, make_tiny_classifier(), "2ep", eval_dataloader=val(classification_arrays),
                    eval_interval="100tok", tokens_per_batch=lambda batch: batch[0].size)
    assert log.starts == [b for b in range(1, 9) if (64 * b) // 100 != (64 * (b - 1)) // 100]


def test_a_callable_interval_is_asked_at_batch_end_epoch_end_and_fit_end(classification_arrays,
                                                                         make_tiny_classifier):
    asked = []

    def rule(state, event):
        asked.append((event, int(state.timestamp.batch)))
        return event is E.BATCH_END and int(state.timestamp.batch) == 3

    _, log, _ = run(classification_arrays, make_tiny_classifier(), "1ep", eval_dataloader=val(classification_arrays),
                    eval_interval=rule)
    assert log.starts == [3]
    assert asked == [(E.BATCH_END, 1), (E.BATCH_END, 2), (E.BATCH_END, 3), (E.BATCH_END, 4), (E.EPOCH_END, 4),
                     (E.FIT_END, 4)]


def test_subset_num_batches_limits_each_evaluation(classification_arrays, make_tiny_classifier):
    _, log, _ = run(classification_arrays, make_tiny_classifier(), "1ep",
                    eval_dataloader=val(classification_arrays, 8), eval_subset_num_batches=3)
    assert log.eval_batches == 3
    trainer, log, _ = run(classification_arrays, make_tiny_classifier(), "1ep",
                          eval_dataloader=Evaluator("val", val(classification_arrays, 8), subset_num_batches=2))
    assert log.eval_batches == 2
    log.eval_batches = 0
    trainer.eval(subset_num_batches=5)
    assert log.eval_batches == 5


def test_fit_takes_evaluators_and_an_interval(classification_arrays, make_tiny_classifier):
    x, y = classification_arrays
    log = EvalLog()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=BATCH, shuffle=False), "1ep",
                      optimizers=optax.sgd(0.1), callbacks=[log], progress_bar=False, run_summary=False)
    trainer.fit(eval_dataloader={"late": val(classification_arrays)}, eval_interval="2ba")
    assert log.starts == [2, 4]
    assert set(trainer.state.metrics["late"]) == {"MulticlassAccuracy", "CrossEntropy"}


def test_eval_returns_values_by_name_for_one_evaluator_and_by_label_for_several(classification_arrays,
                                                                                make_tiny_classifier):
    trainer, _, _ = run(classification_arrays, make_tiny_classifier(), "1ba")
    one = trainer.eval(val(classification_arrays))
    assert set(one) == {"MulticlassAccuracy", "CrossEntropy"}
    several = trainer.eval({"a": val(classification_arrays), "b": val(classification_arrays, 16)})
    assert set(several) == {"a/MulticlassAccuracy", "a/CrossEntropy", "b/MulticlassAccuracy", "b/CrossEntropy"}
    assert several["a/MulticlassAccuracy"] == one["MulticlassAccuracy"]


class ReadEvalMetrics(Callback):
    """Composer's way to read evaluation results from a callback: ``state.eval_metrics[label][name]``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, float]] = []

    def eval_end(self, state, logger):
        label = state.dataloader_label
        self.seen.append((label, state.eval_metrics[label]["MulticlassAccuracy"]))


def test_state_eval_metrics_is_composers_name_for_the_evaluation_results(classification_arrays,
                                                                          make_tiny_classifier):
    reader = ReadEvalMetrics()
    trainer, _, memory = run(classification_arrays, make_tiny_classifier(), "2ba", callbacks=[reader],
                             eval_dataloader={"val": val(classification_arrays)}, eval_interval="1ba")
    accuracies = [value for _, value in memory.data["metrics/val/MulticlassAccuracy"]]
    assert reader.seen == [("val", accuracies[0]), ("val", accuracies[1])]
    assert trainer.state.eval_metrics is trainer.state.metrics
    assert set(trainer.state.eval_metrics) == {"val"}
    assert set(trainer.state.eval_metrics["val"]) == {"MulticlassAccuracy", "CrossEntropy"}


def test_bad_evaluators_name_the_problem(classification_arrays):
    loader = val(classification_arrays)
    with pytest.raises(ValueError, match=r"eval_dataloader: the label\(s\) \['eval'\] name more than one evaluator"):
        ensure_evaluators([loader, loader])
    with pytest.raises(ValueError, match=r"label=''"):
        Evaluator("", loader)
    with pytest.raises(ValueError, match=r"subset_num_batches=0"):
        Evaluator("val", loader, subset_num_batches=0)
    with pytest.raises(ValueError, match=r"metric_names='MulticlassAccuracy'"):
        Evaluator("val", loader, metric_names="MulticlassAccuracy")
    with pytest.raises(ValueError, match=r"eval_interval='2dur'"):
        Evaluator("val", loader, eval_interval="2dur")
