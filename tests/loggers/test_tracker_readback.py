"""Nothing lost after fit: what a script logged is in every tracker once its process has gone.

A training script logs to MLflow (SQLite), W&B (offline), TensorBoard and a JSON-lines file at
``log_interval=1`` and never calls ``trainer.close()``. Each tracker is then read back, with its own
client, by a second process started after the writer exited (this test process never imports a
tracker): every step of ``loss/train/total`` must be there, with the values the file logger wrote.

* Ending normally: ``fit()``, a second ``fit()``, then ``eval()``, and the script just ends. While the
  script waits after the first ``fit`` (on a line from this test, not on time), a reader process sees
  the first fit's steps already in MLflow, TensorBoard and the file: they are flushed at FIT_END,
  and the MLflow run is still open. What ``eval()`` logged after the last fit arrives only through
  the exit hook that closes the Trainer.
* SIGTERM mid-run: once the script has printed that batch 5 is done, it gets SIGTERM; it must exit
  with 143, and every step up to the batch it stopped at is read back; the trackers record the run
  as interrupted (MLflow ``KILLED``, W&B exit code 143). This run gives MLflow no ``tracking_uri``:
  the default is ``mlflow.db`` in the working directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

LOSS = "loss/train/total"
ACCURACY = "metrics/eval/MulticlassAccuracy"
STEPS_PER_FIT = 10  # mid-epoch (4 batches per epoch): only FIT_END flushes the last steps
SIGNAL_AFTER_BATCH = 5
WATCHDOG_S = 300  # only ends a hung process, so a hang fails instead of blocking the suite

TRAIN = '''
import os, sys
import numpy as np, optax
from flax import nnx
from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.loggers import FileLogger, MLFlowLogger, TensorboardLogger, WandBLogger

out, mode, steps, signal_after = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


class Progress(Callback):
    """Tells the test (on stdout) that training is under way, and where fit ended."""

    def batch_end(self, state, logger):
        if state.timestamp.batch.value == signal_after:
            print("TRAINING", flush=True)

    def fit_end(self, state, logger):
        print(f"FIT_END {state.timestamp.batch.value}", flush=True)


x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
# The exit run names its SQLite store; the signal run leaves tracking_uri to the default (./mlflow.db).
uri = f"sqlite:///{out}/mlflow.db" if mode == "exit" else None
loggers = [MLFlowLogger(experiment_name="readback", tracking_uri=uri, log_system_metrics=False,
                        log_duplicated_metric_every_n_steps=1),
           WandBLogger(project="readback", init_kwargs={"dir": out}),
           TensorboardLogger(log_dir=os.path.join(out, "tensorboard")),
           FileLogger(os.path.join(out, "metrics.jsonl"))]
trainer = Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), num_classes=2),
                  ArrayLoader((x, y), batch_size=16), optimizers=optax.sgd(0.1),
                  max_duration=f"{steps}ba" if mode == "exit" else "1000000ba",
                  eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False), eval_interval=0,
                  callbacks=[Progress()], loggers=loggers, log_interval=1, progress_bar=False, run_summary=False,
                  run_dir=os.path.join(out, "run"))
trainer.fit()
if mode == "exit":
    sys.stdin.readline()  # the test reads the trackers back meanwhile
    trainer.fit(f"{steps}ba")
    trainer.eval()
# No trainer.close(): the script just ends.
'''

READ = '''
import glob, json, os, struct, sys

out, trackers = sys.argv[1], sys.argv[2].split(",")
LOSS, ACCURACY = "loss/train/total", "metrics/eval/MulticlassAccuracy"
found = {}

if "mlflow" in trackers:
    from mlflow import MlflowClient

    client = MlflowClient("sqlite:///" + os.path.join(out, "mlflow.db"))
    (run,) = client.search_runs([client.get_experiment_by_name("readback").experiment_id])
    history = {name: sorted([m.step, m.value] for m in client.get_metric_history(run.info.run_id, name))
               for name in (LOSS, ACCURACY)}
    found["mlflow"] = {"status": run.info.status, **history}

if "wandb" in trackers:
    sys.path.insert(0, sys.argv[3])  # tests/loggers: the .wandb reader the W&B tests use
    from wandb_records import records_in

    (path,) = glob.glob(os.path.join(out, "wandb", "offline-run-*", "run-*.wandb"))
    rows, exit_codes = [], []
    for record in records_in(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item})
        elif kind == "exit":
            exit_codes.append(record.exit.exit_code)
    found["wandb"] = {"exit_codes": exit_codes,
                      **{name: [[row["_step"], row[name]] for row in rows if name in row] for name in (LOSS, ACCURACY)}}

if "tensorboard" in trackers:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(os.path.join(out, "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    found["tensorboard"] = {name: [[e.step, e.value] for e in events.Scalars(name)] if name in tags else []
                            for name in (LOSS, ACCURACY)}

if "file" in trackers:
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    found["file"] = {name: [[row["step"], row[name]] for row in rows if name in row] for name in (LOSS, ACCURACY)}

print(json.dumps(found))
'''


def environment(folder: Path) -> dict[str, str]:
    """CPU JAX; W&B offline and quiet with every folder under ``folder``; no MLflow settings from outside."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("MLFLOW_", "WANDB_"))}
    env.pop("DATABRICKS_TOKEN", None)
    env.update(JAX_PLATFORMS="cpu", MLFLOW_DISABLE_TELEMETRY="true", WANDB_MODE="offline", WANDB_SILENT="true",
               WANDB_CONSOLE="off", WANDB_DATA_DIR=str(folder / "wandb-data"), WANDB_CACHE_DIR=str(folder / "cache"),
               WANDB_CONFIG_DIR=str(folder / "config"), WANDB_ARTIFACT_DIR=str(folder / "artifacts"))
    return env


def start_training(folder: Path, mode: str) -> subprocess.Popen:
    (folder / "train.py").write_text(TRAIN)
    arguments = [str(folder), mode, str(STEPS_PER_FIT), str(SIGNAL_AFTER_BATCH)]
    process = subprocess.Popen([sys.executable, str(folder / "train.py"), *arguments], cwd=folder,
                               env=environment(folder), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=open(folder / "stderr.txt", "w"), text=True)
    watchdog = threading.Timer(WATCHDOG_S, process.kill)
    watchdog.daemon = True
    watchdog.start()
    return process


def wait_for_line(process: subprocess.Popen, folder: Path, prefix: str) -> str:
    """Block until the script prints a line starting with ``prefix`` (the script decides when, not a clock)."""
    for line in process.stdout:
        if line.startswith(prefix):
            return line.strip()
    process.wait()
    pytest.fail(f"the script ended (status {process.returncode}) before printing {prefix!r}:\n"
                + (folder / "stderr.txt").read_text()[-4000:])


def read_back(folder: Path, trackers: str = "mlflow,wandb,tensorboard,file") -> dict:
    """What each tracker holds, read by a fresh process with the tracker's own client."""
    script = folder.parent / "read.py"
    script.write_text(READ)
    result = subprocess.run([sys.executable, str(script), str(folder), trackers, str(Path(__file__).parent)],
                            env=environment(folder / "reader"),
                            capture_output=True, text=True, timeout=WATCHDOG_S)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def exited(tmp_path_factory):
    """Two fits and an eval, never closed; read back while paused after the first fit, and after exit."""
    folder = tmp_path_factory.mktemp("exited")
    process = start_training(folder, "exit")
    try:
        first_fit = wait_for_line(process, folder, "FIT_END")
        paused = read_back(folder, "mlflow,tensorboard,file")  # W&B writes its file at finish (see WandBLogger)
        process.stdin.write("go on\n")
        process.stdin.close()
        output = first_fit + "\n" + process.stdout.read()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    stderr = (folder / "stderr.txt").read_text()
    return SimpleNamespace(returncode=process.returncode, output=output, stderr=stderr, paused=paused,
                           found=read_back(folder))


@pytest.fixture(scope="module")
def terminated(tmp_path_factory):
    """Trained until SIGTERM (sent once batch 5 is done), never closed; read back after the process exited."""
    folder = tmp_path_factory.mktemp("terminated")
    process = start_training(folder, "signal")
    try:
        wait_for_line(process, folder, "TRAINING")
        process.send_signal(signal.SIGTERM)
        output = process.stdout.read()
        process.wait()
    finally:
        if process.poll() is None:
            process.kill()
    stderr = (folder / "stderr.txt").read_text()
    return SimpleNamespace(returncode=process.returncode, output=output, stderr=stderr, found=read_back(folder))


TRACKERS = ["mlflow", "wandb", "tensorboard", "file"]


def steps(history: list) -> list[int]:
    return [step for step, _ in history]


def test_the_script_that_never_closes_ends_cleanly(exited):
    assert exited.returncode == 0, exited.stderr[-4000:]
    assert exited.output.split() == ["FIT_END", str(STEPS_PER_FIT), "FIT_END", str(2 * STEPS_PER_FIT)]
    assert "cannot schedule new futures" not in exited.stderr, exited.stderr[-4000:]
    assert "Traceback" not in exited.stderr, exited.stderr[-4000:]


@pytest.mark.parametrize("tracker", ["mlflow", "tensorboard", "file"])
def test_what_fit_logged_is_flushed_when_fit_returns(exited, tracker):
    """Read while the writer still runs, paused after its first fit: FIT_END flushed everything."""
    assert steps(exited.paused[tracker][LOSS]) == list(range(1, STEPS_PER_FIT + 1))
    assert exited.paused[tracker][LOSS] == exited.paused["file"][LOSS]  # the same values everywhere


def test_fit_end_leaves_the_mlflow_run_open_for_the_next_fit(exited):
    assert exited.paused["mlflow"]["status"] == "RUNNING"


@pytest.mark.parametrize("tracker", TRACKERS)
def test_every_step_of_both_fits_and_the_final_eval_is_read_back_after_exit(exited, tracker):
    found, written = exited.found[tracker], exited.found["file"]
    assert steps(found[LOSS]) == list(range(1, 2 * STEPS_PER_FIT + 1))
    assert steps(found[ACCURACY]) == [2 * STEPS_PER_FIT]  # eval() after the last fit, at its last step
    assert found[LOSS] == written[LOSS] and found[ACCURACY] == written[ACCURACY]  # the same values everywhere


def test_the_runs_end_finished_at_exit(exited):
    assert exited.found["mlflow"]["status"] == "FINISHED"
    assert exited.found["wandb"]["exit_codes"] == [0]


def test_sigterm_exits_143_after_the_batch_it_arrived_in(terminated):
    assert terminated.returncode == 143, terminated.stderr[-4000:]
    stopped = int(terminated.output.split("FIT_END ")[1].split()[0])
    assert stopped >= SIGNAL_AFTER_BATCH
    assert "SIGTERM: no save_folder, so no checkpoint; exiting with status 143" in terminated.output
    assert "cannot schedule new futures" not in terminated.stderr, terminated.stderr[-4000:]


@pytest.mark.parametrize("tracker", TRACKERS)
def test_every_step_before_sigterm_is_read_back(terminated, tracker):
    stopped = int(terminated.output.split("FIT_END ")[1].split()[0])
    assert steps(terminated.found[tracker][LOSS]) == list(range(1, stopped + 1))
    assert terminated.found[tracker][LOSS] == terminated.found["file"][LOSS]  # the same values everywhere


def test_the_runs_are_marked_interrupted_by_sigterm(terminated):
    assert terminated.found["mlflow"]["status"] == "KILLED"
    assert terminated.found["wandb"]["exit_codes"] == [128 + signal.SIGTERM]
