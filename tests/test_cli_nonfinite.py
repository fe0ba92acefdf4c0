"""``composerjax train`` on a recipe whose third-party algorithm makes the loss NaN: the line, the results, exit 3.

Each run is a real ``python -m composerjax train`` process; what it wrote (traces.jsonl, metrics.jsonl)
is read back by a fresh process (``composerjax traces``) or by this one after it exited.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from composerjax.cli import NONFINITE_LOSS_STATUS, main
from composerjax.trainer.nonfinite_loss import NAN_MONITOR_ADVICE

# A plugin module of the user's own, named in the recipe by its import path.
NAN_ALGORITHMS = '''
import jax.numpy as jnp

from composerjax import Algorithm, Event


class NaNFrom(Algorithm):
    """The loss is NaN from optimizer step ``from_step`` on (timestamp.batch from_step + 1)."""

    def __init__(self, from_step: int = 4) -> None:
        self.from_step = from_step

    def match(self, event, state):
        return event == Event.BEFORE_BACKWARD

    def apply(self, event, state, logger):
        state.loss = jnp.where(state.step >= self.from_step, jnp.nan, state.loss)
'''

RECIPE = {
    "run_name": "nan-run",
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 16},
    "max_duration": "30ba",
    "progress_bar": False,
    "run_summary": False,
    "algorithms": [{"name": "nan_algorithms:NaNFrom", "from_step": 4}],
}


def train(folder: Path, recipe: dict, *overrides: str) -> subprocess.CompletedProcess:
    folder.mkdir()
    (folder / "nan_algorithms.py").write_text(NAN_ALGORITHMS)
    (folder / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    sets = [word for override in overrides for word in ("--set", override)]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [str(folder),
                                                                                          os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "composerjax", "train", "recipe.yaml", *sets], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=300)


def reported(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("composerjax: ")]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    """The recipe with a FileLogger and the TraceRecorder callback: the exact batch is known."""
    folder = tmp_path_factory.mktemp("logged") / "run"
    recipe = {**RECIPE, "callbacks": ["trace_recorder"], "loggers": [{"file": {"path": "metrics.jsonl"}}]}
    return folder, train(folder, recipe)


def test_a_nan_loss_is_one_line_a_results_line_and_exit_status_3(logged_run):
    folder, result = logged_run
    assert result.returncode == NONFINITE_LOSS_STATUS == 3, result.stderr
    assert reported(result.stderr) == [f"composerjax: the training loss became nan at batch 5; {NAN_MONITOR_ADVICE}"]
    assert ("composerjax train: the final training loss is nan: exit status 3 (allow_nonfinite_loss: true in the "
            "recipe, or --set allow_nonfinite_loss=true, accepts it)") in result.stderr.splitlines()
    assert "run nan-run: 30 batches" in result.stdout  # it trained on, as Composer does
    assert "  final train loss  nan" in result.stdout.splitlines()
    assert "  non-finite loss   the training loss became nan at batch 5" in result.stdout.splitlines()
    with open(folder / "metrics.jsonl") as file:
        losses = [row["loss/train/total"] for row in map(json.loads, file) if "loss/train/total" in row]
    assert [math.isnan(loss) for loss in losses] == [False] * 4 + [True] * 26


def test_the_recipes_trace_recorder_callback_lists_the_algorithm(logged_run):
    folder, _ = logged_run
    listing = subprocess.run([sys.executable, "-m", "composerjax", "traces", str(folder / "runs" / "nan-run")],
                             env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0] == (f"traces of {folder / 'runs' / 'nan-run'}: 30 algorithm runs and 1 callback action at "
                        "2 events, batches 0-30")
    assert lines[lines.index("BEFORE_BACKWARD") + 2].split() == ["0", "NaNFrom", "30", "traced", "0-29", "-", "-"]
    # The trainer's evaluation at fit end (the digits data has an eval split), labelled as a callback.
    assert lines[lines.index("FIT_END") + 2].split()[:6] == ["0", "EvalRunner", "1", "callback", "30", "-"]


def test_allow_nonfinite_loss_in_the_recipe_exits_0_without_the_line(tmp_path):
    result = train(tmp_path / "run", RECIPE, "allow_nonfinite_loss=true")
    assert result.returncode == 0, result.stderr
    assert reported(result.stderr) == []
    # No logger fetched the losses: only the last one was looked at.
    assert ("  non-finite loss   the training loss became non-finite between batch 1 and 30 (nan at batch 30)"
            in result.stdout.splitlines())


def test_skip_nonfinite_updates_says_how_many_it_skipped(tmp_path):
    recipe = {**RECIPE, "algorithms": [{"name": "nan_algorithms:NaNFrom", "from_step": 0}],
              "skip_nonfinite_updates": True, "allow_nonfinite_loss": True}
    result = train(tmp_path / "run", recipe)
    assert result.returncode == 0, result.stderr
    assert reported(result.stderr) == ["composerjax: skip_nonfinite_updates skipped 30 of 30 updates (NaN or infinite "
                                       "loss or gradients); their batches still count"]
    assert ("  skipped updates   30 of 30 (skip_nonfinite_updates: NaN or infinite loss or gradients)"
            in result.stdout.splitlines())


@pytest.mark.parametrize(("command", "status_line"), [
    ("train", "  3    the final training loss is NaN or infinite (the recipe's allow_nonfinite_loss: true accepts it)"),
    ("traces", "  1    with --diff: the runs differ; without it: an unexpected error (one line; --debug shows the"),
])
def test_help_documents_the_answering_exit_statuses(command, status_line, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert status_line in capsys.readouterr().out.splitlines()
