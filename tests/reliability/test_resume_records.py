"""A killed ``composerjax train`` resumed with autoresume keeps metrics.jsonl and traces.jsonl whole, each batch once.

The recipe saves every 4 batches and records traces (``trace_recorder``, a traced LabelSmoothing
at every step) and metrics (the ``file`` logger). A callback of the recipe (``killer:KillOnce``)
signals its own process at the end of batch 11, once: SIGKILL after checkpoint 8 is on disk (the
records of batches 9-11 are then on disk too, and are trained again after the resume), or SIGTERM
(the trainer saves checkpoint 11 and exits 143). The same command then resumes and finishes at
batch 16. Every file is read back by this process after the writers exited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.core.state import ResumePoint

COMPOSERJAX = Path(sys.executable).with_name("composerjax")  # the console script next to this python

RECIPE = {
    "run_name": "resumed",
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 16},
    "max_duration": "16ba",
    "eval_interval": "1000ba",
    "log_interval": 1,
    "progress_bar": False,
    "run_summary": False,
    "save_folder": "checkpoints",
    "save_interval": "4ba",
    "autoresume": True,
    "algorithms": [{"label_smoothing": {"smoothing": 0.1}}],
    "callbacks": [{"trace_recorder": {}}, {"killer:KillOnce": {"at": 11}}],
    "loggers": [{"file": {}}],
}

KILLER = textwrap.dedent('''
    """KillOnce: at the end of batch ``at``, the first time only, send this process ``signal``."""
    import os
    import signal as signals
    import time

    from composerjax import Callback


    class KillOnce(Callback):
        def __init__(self, at: int) -> None:
            self.at = at

        def batch_end(self, state, logger) -> None:
            if int(state.timestamp.batch) != self.at or os.path.exists("killed"):
                return
            name = os.environ["KILL_WITH"]
            if name == "SIGKILL":  # die with checkpoint 8 (complete: orbax renames it into place) the newest
                while not os.path.isdir(os.path.join("checkpoints", "ep0-ba8")):
                    time.sleep(0.01)
            open("killed", "w").close()
            os.kill(os.getpid(), getattr(signals, name))
''')


def train(folder: Path, kill_with: str, *overrides: str) -> subprocess.CompletedProcess:
    command = [str(COMPOSERJAX), "train", "recipe.yaml"]
    for override in overrides:
        command += ["--set", override]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(folder), KILL_WITH=kill_with)
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=300)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def markers(records: list[dict]) -> list[dict]:
    return [record for record in records if "resumed_from" in record]


@pytest.mark.parametrize(("kill_with", "status", "resumed_at"), [("SIGKILL", -signal.SIGKILL, 8),
                                                                 ("SIGTERM", 128 + signal.SIGTERM, 11)])
def test_a_killed_run_resumed_records_every_batch_once_with_one_resume_marker(tmp_path, kill_with, status,
                                                                              resumed_at):
    assert COMPOSERJAX.exists(), f"{COMPOSERJAX}: the composerjax script is not installed next to {sys.executable}"
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    (tmp_path / "killer.py").write_text(KILLER)
    killed = train(tmp_path, kill_with)
    assert killed.returncode == status, killed.stdout[-2000:] + killed.stderr[-3000:]
    run_dir = tmp_path / "runs" / "resumed"
    metrics_path, traces_path = run_dir / "metrics.jsonl", run_dir / "traces.jsonl"
    losses = [row["step"] for row in read_jsonl(metrics_path) if "loss/train/total" in row]
    # SIGKILL: rows reach the disk a batch or two late, but the ones after checkpoint 8 are there (and
    # those batches are trained again); SIGTERM: every row is flushed.
    assert losses == list(range(1, len(losses) + 1)) and (len(losses) > 8 if kill_with == "SIGKILL" else
                                                          len(losses) == 11)

    resumed = train(tmp_path, kill_with)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    checkpoint = f"checkpoints/ep0-ba{resumed_at}"
    said = [line for line in resumed.stdout.splitlines() if line.startswith("autoresume:")]
    assert said == [f"autoresume: resumed from {checkpoint} at batch {resumed_at}"]
    marker = {"resumed_from": str(tmp_path / checkpoint), "batch": resumed_at}

    rows = read_jsonl(metrics_path)
    assert markers(rows) == [marker]
    at = rows.index(marker)
    assert [row["step"] for row in rows[:at] if "loss/train/total" in row] == list(range(1, resumed_at + 1))
    assert [row["step"] for row in rows[at:] if "loss/train/total" in row] == list(range(resumed_at + 1, 17))
    assert all(row["step"] <= resumed_at for row in rows[:at] if "step" in row)

    traces = read_jsonl(traces_path)
    assert markers(traces) == [marker]
    at = traces.index(marker)
    steps = [[(trace["batch"], trace["event"]) for trace in part if trace.get("name") == "LabelSmoothing"]
             for part in (traces[:at], traces[at:])]
    # Traced into every step, where the batch counts the batches before it: 0-15.
    assert steps == [[(batch, event) for batch in batches for event in ("before_loss", "after_loss")]
                     for batches in (range(resumed_at), range(resumed_at, 16))]
    saves = [trace["batch"] for trace in traces if trace.get("name") == "CheckpointSaver"]
    assert saves == sorted(set(saves)) and {4, 8, 12, 16} <= set(saves)

    summary = subprocess.run([str(COMPOSERJAX), "traces", str(run_dir)], capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert summary.returncode == 0, summary.stderr  # the marker line is not read as a trace
    assert "LabelSmoothing" in summary.stdout


def test_autoresume_of_a_finished_run_says_that_a_shorter_max_duration_trains_nothing(tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    (tmp_path / "killer.py").write_text(KILLER)
    (tmp_path / "killed").touch()  # no kill: the run finishes at batch 16
    finished = train(tmp_path, "SIGKILL", "max_duration=8ba")
    assert finished.returncode == 0, finished.stdout[-2000:] + finished.stderr[-3000:]
    assert "autoresume:" not in finished.stdout  # nothing to resume from

    # max_duration counts the whole run: 4ba after a checkpoint at batch 8 is not 4 more batches.
    again = train(tmp_path, "SIGKILL", "max_duration=4ba")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    said = [line for line in again.stdout.splitlines() if line.startswith("autoresume:")]
    assert said == [
        "autoresume: resumed from checkpoints/ep0-ba8 at batch 8",
        "autoresume: max_duration=4ba is already reached (8ba at this checkpoint), so fit() trains no batch: "
        "max_duration is the length of the whole run, counted from its first batch, not more training after the "
        "checkpoint; set it above 8ba to train more"]
    assert "run resumed: 8 batches" in again.stdout
    assert sorted(name for name in os.listdir(tmp_path / "checkpoints") if name.startswith("ep")) == [
        "ep0-ba4", "ep0-ba8"]  # no batch trained, nothing saved

    longer = train(tmp_path, "SIGKILL", "max_duration=10ba")
    assert longer.returncode == 0, longer.stdout[-2000:] + longer.stderr[-3000:]
    said = [line for line in longer.stdout.splitlines() if line.startswith("autoresume:")]
    assert said == ["autoresume: resumed from checkpoints/ep0-ba8 at batch 8"]  # and it trains on
    assert "run resumed: 10 batches" in longer.stdout
    rows = read_jsonl(tmp_path / "runs" / "resumed" / "metrics.jsonl")
    assert [row["step"] for row in rows if "loss/train/total" in row] == list(range(1, 11))
    assert [row["batch"] for row in markers(rows)] == [8, 8]


def small_trainer(duration: str = "4ba", **arguments) -> Trainer:
    x = np.random.default_rng(0).normal(size=(48, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), ArrayLoader((x, y), batch_size=8),
                   duration, progress_bar=False, run_summary=False, **arguments)


@pytest.mark.parametrize("how", ["load_path", "load_path_one_checkpoint", "load_weights_only"])
def test_load_path_in_full_says_where_the_run_resumes_and_sets_state_resumed_from(tmp_path, capfd, how):
    folder = tmp_path / "checkpoints"
    saved = small_trainer(save_folder=str(folder), save_interval="2ba")
    saved.fit()
    saved.close()
    capfd.readouterr()
    load_path = folder / "ep0-ba2" if how == "load_path_one_checkpoint" else folder
    trainer = small_trainer("6ba", load_path=str(load_path), load_weights_only=how == "load_weights_only")
    printed = capfd.readouterr().out
    batch = 2 if how == "load_path_one_checkpoint" else 4
    if how == "load_weights_only":  # the run starts at batch 0: nothing resumed
        assert trainer.state.resumed_from is None and "load_path:" not in printed
    else:
        checkpoint = str(folder / f"ep0-ba{batch}")
        assert trainer.state.resumed_from == ResumePoint(checkpoint, batch)
        assert printed == f"load_path: resumed from {checkpoint} at batch {batch}\n"
    trainer.close()
