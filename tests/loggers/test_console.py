"""Tests for ConsoleLogger: printed lines, the training-value interval, tables."""

import io
import re

import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.loggers import ConsoleLogger, InMemoryLogger


def test_metrics_line_format():
    stream = io.StringIO()
    ConsoleLogger(stream=stream).log_metrics({"loss/train/total": 0.123456789, "train/grad_norm": 2}, step=3)
    assert stream.getvalue() == "[batch 3] loss/train/total: 0.123457, train/grad_norm: 2\n"


def test_training_values_wait_for_the_interval_and_other_values_do_not():
    stream = io.StringIO()
    console = ConsoleLogger(interval=3, stream=stream)
    for step in range(1, 7):
        console.log_metrics({"loss/train/total": step / 8, "metrics/eval/accuracy": 0.5}, step=step)
    assert stream.getvalue().splitlines() == [
        "[batch 1] metrics/eval/accuracy: 0.5",
        "[batch 2] metrics/eval/accuracy: 0.5",
        "[batch 3] loss/train/total: 0.375, metrics/eval/accuracy: 0.5",
        "[batch 4] metrics/eval/accuracy: 0.5",
        "[batch 5] metrics/eval/accuracy: 0.5",
        "[batch 6] loss/train/total: 0.75, metrics/eval/accuracy: 0.5",
    ]


def test_tables_are_aligned_columns():
    stream = io.StringIO()
    ConsoleLogger(stream=stream).log_table(["name", "score"], [["alpha", 0.5], ["b", 12.25]], name="scores", step=2)
    assert stream.getvalue() == "[batch 2] table scores:\nname  | score\nalpha | 0.5\nb     | 12.25\n"


def test_hyperparameters_are_printed_on_one_line():
    stream = io.StringIO()
    ConsoleLogger(stream=stream).log_hyperparameters({"lr": 0.1, "schedule": "cosine"})
    assert stream.getvalue() == "hyperparameters: {'lr': 0.1, 'schedule': 'cosine'}\n"


def test_prints_to_stdout_by_default(capsys):
    ConsoleLogger().log_metrics({"loss": 0.5}, step=1)
    assert capsys.readouterr().out == "[batch 1] loss: 0.5\n"


def test_in_a_trainer_training_losses_print_every_interval_and_eval_metrics_at_each_eval(
    classification_arrays, make_tiny_classifier
):
    x, y = classification_arrays
    stream, memory = io.StringIO(), InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="8ba",
                      eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False), optimizers=optax.sgd(0.1),
                      loggers=[ConsoleLogger(interval=4, stream=stream), memory], log_interval=2, progress_bar=False,
                      run_summary=False)
    trainer.fit()
    lines = stream.getvalue().splitlines()
    losses = dict(memory.data["loss/train/total"])
    accuracies = [value for _, value in memory.data["metrics/eval/MulticlassAccuracy"]]
    assert lines[0] == f"[batch 4] loss/train/total: {losses[4]:.6g}"
    assert re.fullmatch(rf"\[batch 4\] metrics/eval/CrossEntropy: \S+, "
                        rf"metrics/eval/MulticlassAccuracy: {accuracies[0]:.6g}", lines[1])
    assert lines[2] == f"[batch 8] loss/train/total: {losses[8]:.6g}"
    assert lines[3].startswith("[batch 8] metrics/eval/CrossEntropy: ")
    assert lines[3].endswith(f"metrics/eval/MulticlassAccuracy: {accuracies[1]:.6g}")
    assert len(lines) == 4


def test_constructor_validation_names_the_argument():
    with pytest.raises(ValueError, match=r"ConsoleLogger\(interval=0\): expected a positive integer"):
        ConsoleLogger(interval=0)
    with pytest.raises(ValueError, match=r"interval=True"):
        ConsoleLogger(interval=True)
    with pytest.raises(TypeError, match=r"stream='out'"):
        ConsoleLogger(stream="out")
