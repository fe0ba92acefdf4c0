"""Tests for ProgressBarLogger: drawn on a terminal (a pseudo-terminal here), quiet otherwise."""

import io
import os
import pty
import re
import threading

import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.loggers import InMemoryLogger, ProgressBarLogger

LOSS = "loss/train/total"


class PseudoTerminal:
    """A pty whose slave side is a text stream; everything written to it is collected from the master side."""

    def __init__(self):
        self._master, slave = pty.openpty()
        self.stream = os.fdopen(slave, "w")
        self._chunks = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        while True:
            try:
                chunk = os.read(self._master, 4096)
            except OSError:  # EIO once the slave side is closed
                return
            if not chunk:
                return
            self._chunks.append(chunk)

    def output(self) -> str:
        """Close the terminal and return what was drawn on it."""
        self.stream.close()
        self._reader.join(timeout=10)
        os.close(self._master)
        return b"".join(self._chunks).decode()


def train(classification_arrays, make_tiny_classifier, bar, eval_loader=True):
    x, y = classification_arrays
    memory = InMemoryLogger()
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
                      eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False) if eval_loader else None,
                      optimizers=optax.sgd(0.1), loggers=[bar, memory], log_interval=2, progress_bar=False,
                      run_summary=False)
    trainer.fit()
    trainer.close()
    return memory


def test_on_a_terminal_the_bars_show_loss_eval_metrics_rate_and_eta(classification_arrays, make_tiny_classifier):
    terminal = PseudoTerminal()
    bar = ProgressBarLogger(stream=terminal.stream)
    assert bar.disable is False  # a terminal: shown without force
    memory = train(classification_arrays, make_tiny_classifier, bar)
    output = terminal.output()
    final_loss = memory.latest(LOSS)
    accuracy = memory.latest("metrics/eval/MulticlassAccuracy")
    # The run bar's last state: 6 of 6 batches, elapsed<remaining, batches/s, then the latest values.
    last_run_line = [line for line in re.split(r"[\r\n]+", output) if line.startswith("fit:")][-1]
    assert re.search(r"\| 6/6 \[\d\d:\d\d<\d\d:\d\d, +\d+(\.\d+)?ba/s, ", last_run_line), last_run_line
    assert f"loss={final_loss:.4g}" in last_run_line
    assert f"MulticlassAccuracy={accuracy:.4g}" in last_run_line
    # Each epoch bar: epoch 0 ran all 4 batches, epoch 1 ran 2 of 4 (with a remaining-time field).
    assert re.search(r"epoch 0: 100%\|[^|]*\| 4/4 \[\d\d:\d\d<\d\d:\d\d", output)
    assert re.search(r"epoch 1:  50%\|[^|]*\| 2/4 \[\d\d:\d\d<\d\d:\d\d", output)


def test_a_stream_that_is_not_a_terminal_gets_nothing(classification_arrays, make_tiny_classifier):
    stream = io.StringIO()
    bar = ProgressBarLogger(stream=stream)
    assert bar.disable is True
    train(classification_arrays, make_tiny_classifier, bar, eval_loader=False)
    assert stream.getvalue() == ""
    assert bar.run_bar is None and bar.epoch_bar is None


def test_force_draws_on_any_stream(classification_arrays, make_tiny_classifier):
    stream = io.StringIO()
    memory = train(classification_arrays, make_tiny_classifier, ProgressBarLogger(stream=stream, force=True),
                   eval_loader=False)
    assert f"loss={memory.latest(LOSS):.4g}" in stream.getvalue()
    assert "6/6" in stream.getvalue()


def test_disable_true_wins_over_a_terminal(classification_arrays, make_tiny_classifier):
    terminal = PseudoTerminal()
    bar = ProgressBarLogger(stream=terminal.stream, disable=True)
    train(classification_arrays, make_tiny_classifier, bar, eval_loader=False)
    assert terminal.output() == ""


@pytest.mark.parametrize("on_terminal", [False, True])
def test_the_trainer_adds_its_default_bar_only_when_stderr_is_a_terminal(
    classification_arrays, make_tiny_classifier, monkeypatch, on_terminal
):
    terminal = PseudoTerminal()
    monkeypatch.setattr("sys.stderr", terminal.stream if on_terminal else io.StringIO())
    x, y = classification_arrays
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="1ba")
    bars = [d for d in trainer.logger.destinations if isinstance(d, ProgressBarLogger)]
    assert len(bars) == int(on_terminal)
    terminal.output()


def test_constructor_validation_names_the_argument():
    with pytest.raises(TypeError, match=r"disable='no'"):
        ProgressBarLogger(disable="no")
    with pytest.raises(TypeError, match=r"force=1"):
        ProgressBarLogger(force=1)
    with pytest.raises(TypeError, match=r"stream=3"):
        ProgressBarLogger(stream=3)
