"""Tests for FileLogger: JSON lines from a real Trainer run, its default path, traces and tables."""

import json
import math
import subprocess
import sys
from types import SimpleNamespace

import jax.numpy as jnp
import optax
import pytest

from composerjax import Algorithm, ArrayLoader, Callback, Event, Trainer
from composerjax.loggers import FileLogger, InMemoryLogger

LOSS = "loss/train/total"


class CountBatchStarts(Algorithm):
    """A host-event algorithm, so every batch leaves a trace."""

    def match(self, event, state):
        return event == Event.BATCH_START

    def apply(self, event, state, logger):
        return 3


class TableAtEpochEnd(Callback):
    def epoch_end(self, state, logger):
        logger.log_table(["epoch", "loss"], [[state.timestamp.epoch.value, jnp.float32(0.5)]], name="epochs")


def read_rows(path):
    with open(path, encoding="utf-8") as file:
        return [json.loads(line) for line in file]


@pytest.fixture(scope="module")
def file_run(classification_arrays, make_tiny_classifier, tmp_path_factory):
    """6 batches (4 per epoch) with log_interval=2 into FileLogger() at its default path, with traces."""
    x, y = classification_arrays
    run_dir = tmp_path_factory.mktemp("run")
    memory = InMemoryLogger()
    destination = FileLogger(traces=True)
    trainer = Trainer(make_tiny_classifier(), ArrayLoader((x, y), batch_size=16), max_duration="6ba",
                      optimizers=optax.sgd(0.1), algorithms=[CountBatchStarts()], callbacks=[TableAtEpochEnd()],
                      loggers=[memory, destination], log_interval=2, progress_bar=False, run_dir=str(run_dir))
    trainer.fit()
    rows_before_close = read_rows(run_dir / "metrics.jsonl")
    trainer.close()
    return SimpleNamespace(trainer=trainer, memory=memory, destination=destination, run_dir=run_dir,
                           rows=read_rows(run_dir / "metrics.jsonl"), rows_before_close=rows_before_close)


def test_default_path_is_metrics_jsonl_in_the_run_folder(file_run):
    assert file_run.destination.path == str(file_run.run_dir / "metrics.jsonl")


def test_every_step_has_one_line_with_a_finite_training_loss_equal_to_the_logged_one(file_run):
    train_rows = [row for row in file_run.rows if LOSS in row]
    assert [row["step"] for row in train_rows] == [1, 2, 3, 4, 5, 6]
    assert all(set(row) == {"step", LOSS} for row in train_rows)
    assert all(math.isfinite(row[LOSS]) for row in train_rows)
    assert [row[LOSS] for row in train_rows] == [value for _, value in file_run.memory.data[LOSS]]


def test_rows_are_on_disk_when_fit_returns(file_run):
    assert file_run.rows_before_close == file_run.rows


def test_run_summary_is_written_as_hyperparameters(file_run):
    hyperparameters = [row["hyperparameters"] for row in file_run.rows if "hyperparameters" in row]
    summary = hyperparameters[0]
    assert summary["run_summary/run_name"] == file_run.trainer.state.run_name
    assert summary["run_summary/algorithms"] == ["CountBatchStarts"]
    assert summary["run_summary/parameters"] == 4 * 2 + 2  # nnx.Linear(4, 2)


def test_traces_of_host_events_are_written_per_batch(file_run):
    trace_rows = [row for row in file_run.rows if "traces" in row]
    assert [row["step"] for row in trace_rows] == [0, 1, 2, 3, 4, 5]
    assert trace_rows[2]["traces"] == [{"name": "CountBatchStarts", "event": "batch_start", "exit_code": 3,
                                        "order": 0, "run": True, "traced": False, "batch": 2,
                                        "duration_s": trace_rows[2]["traces"][0]["duration_s"], "kind": "algorithm"}]


def test_tables_are_written_with_columns_and_plain_rows(file_run):
    tables = [row for row in file_run.rows if "table" in row]
    assert tables == [{"step": 4, "table": "epochs", "columns": ["epoch", "loss"], "rows": [[1, 0.5]]}]


def test_an_explicit_path_is_appended_to(tmp_path):
    path = tmp_path / "sub" / "log.jsonl"
    for step in (1, 2):
        destination = FileLogger(path)
        destination.log_metrics({"loss": step / 4}, step=step)
        destination.close(None, None)
    assert read_rows(path) == [{"step": 1, "loss": 0.25}, {"step": 2, "loss": 0.5}]


def test_without_a_path_or_a_run_folder_writing_says_what_to_pass():
    with pytest.raises(RuntimeError, match=r"pass FileLogger\(path=\.\.\.\)"):
        FileLogger().log_metrics({"loss": 1.0}, step=1)


def test_constructor_validation_names_the_argument():
    with pytest.raises(TypeError, match="FileLogger\\(path=3\\)"):
        FileLogger(3)
    with pytest.raises(TypeError, match="traces='yes'"):
        FileLogger(traces="yes")


def test_composers_filename_argument_with_its_name_fields_writes_where_it_says(tmp_path):
    # Composer's spelling, FileLogger(filename='{run_name}/logs-rank{rank}...'), in a run of its own;
    # the file is read here, after that process exited.
    script = (
        "import numpy as np\n"
        "from flax import nnx\n"
        "from composerjax import ArrayLoader, ComposerClassifier, Trainer\n"
        "from composerjax.loggers import FileLogger\n"
        "x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)\n"
        "y = (x[:, 0] > 0).astype(np.int32)\n"
        "destination = FileLogger(filename='{run_name}/logs-rank{rank}-of-{world_size}.jsonl')\n"
        "trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), 16),\n"
        "                  max_duration='2ba', loggers=[destination], run_name='my-run', log_interval=1,\n"
        "                  progress_bar=False)\n"
        "trainer.fit()\n"
        "trainer.close()\n"
        "print(destination.path)\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "my-run/logs-rank0-of-1.jsonl"
    rows = read_rows(tmp_path / "my-run" / "logs-rank0-of-1.jsonl")
    assert [row["step"] for row in rows if LOSS in row] == [1, 2]


def test_filename_is_paths_composer_name_and_its_fields_are_checked(tmp_path):
    assert FileLogger(filename=str(tmp_path / "a.jsonl")).path == str(tmp_path / "a.jsonl")
    with pytest.raises(TypeError, match=r"filename is Composer's name for path; give one of them"):
        FileLogger("a.jsonl", filename="b.jsonl")
    with pytest.raises(TypeError, match=r"FileLogger\(filename=3\): expected a file path"):
        FileLogger(filename=3)
    with pytest.raises(ValueError, match=r"FileLogger\(filename='\{run\}/x.jsonl'\): unknown field \{run\}; the fields "
                                         r"are \{run_name\}, \{rank\}, \{local_rank\}, \{node_rank\}, \{world_size\}"):
        FileLogger(filename="{run}/x.jsonl")
    with pytest.raises(RuntimeError, match=r"learns \{run_name\} at INIT; outside a Trainer, pass a path without it"):
        FileLogger(str(tmp_path / "{run_name}.jsonl")).log_metrics({"loss": 1.0}, step=1)
