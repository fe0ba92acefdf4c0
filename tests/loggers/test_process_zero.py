"""Only process 0 writes: with jax.process_index() == 1, no file, event file, line or bar appears."""

import io

import jax
import jax.numpy as jnp
import optax

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.loggers import (
    ConsoleLogger,
    FileLogger,
    InMemoryLogger,
    ProgressBarLogger,
    TensorboardLogger,
)


class ImagesAndTable(Callback):
    def batch_end(self, state, logger):
        logger.log_images(jnp.zeros((2, 4, 4, 3)), name="samples")
        logger.log_table(["batch"], [[state.timestamp.batch.value]], name="batches")
        logger.log_hyperparameters({"seen": state.timestamp.batch.value})


def test_processes_other_than_zero_write_nothing(classification_arrays, make_tiny_classifier, tmp_path, monkeypatch):
    x, y = classification_arrays
    loader = ArrayLoader((x, y), batch_size=16)  # resolves its own process index now, as process 0
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    console_stream, bar_stream = io.StringIO(), io.StringIO()
    memory = InMemoryLogger()
    bar = ProgressBarLogger(stream=bar_stream, force=True)
    run_dir = tmp_path / "run"
    trainer = Trainer(make_tiny_classifier(), loader, max_duration="4ba", optimizers=optax.sgd(0.1),
                      callbacks=[ImagesAndTable()],
                      loggers=[FileLogger(), TensorboardLogger(), FileLogger(tmp_path / "explicit.jsonl"),
                               ConsoleLogger(stream=console_stream), bar, memory],
                      log_interval=2, progress_bar=False, run_summary=True, run_dir=str(run_dir))
    trainer.fit()
    trainer.close()
    assert bar.disable is True
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []
    assert console_stream.getvalue() == "" and bar_stream.getvalue() == ""
    # The in-memory destination keeps values on every process.
    assert [step for step, _ in memory.data["loss/train/total"]] == [1, 2, 3, 4]
    assert len(memory.images["samples"]) == 4 and memory.hyperparameters["seen"] == 4
