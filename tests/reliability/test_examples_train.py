"""``make demo`` (examples/digits.py) and every examples/*.yaml recipe train, briefly, as real processes.

Each recipe goes through the installed ``composerjax train`` script with only ``--set
max_duration=2ba`` changed (and the language-model recipes made CPU-sized: ``LM_RECIPE_OVERRIDES``);
the demo runs with ``--max-duration 2ba``. All of them start at once
(they are independent), each in its own folder, since their loggers write to relative paths.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import LM_RECIPE_OVERRIDES, prepare_example

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))
COMPOSERJAX = Path(sys.executable).with_name("composerjax")  # the console script next to this python
BATCHES = 2


def metric_rows(path: Path) -> list[dict]:
    with open(path) as handle:
        return [row for row in map(json.loads, handle) if "loss/train/total" in row]


def assert_finite_losses(path: Path) -> None:
    rows = metric_rows(path)
    assert [row["step"] for row in rows] == list(range(1, BATCHES + 1)), rows
    assert all(math.isfinite(row["loss/train/total"]) and row["loss/train/total"] > 0 for row in rows), rows


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, Path]]:
    """``{name: (exit status, folder with stdout.txt and stderr.txt)}`` for the demo and each recipe, run at once."""
    assert COMPOSERJAX.exists(), f"{COMPOSERJAX}: the composerjax script is not installed next to {sys.executable}"
    commands = {"digits.py": [sys.executable, str(EXAMPLES / "digits.py"), "--max-duration", f"{BATCHES}ba"]}
    for recipe in RECIPES:
        cpu_sized = [word for override in LM_RECIPE_OVERRIDES.get(recipe.name, []) for word in ("--set", override)]
        commands[recipe.name] = [str(COMPOSERJAX), "train", str(recipe), "--set", f"max_duration={BATCHES}ba",
                                 *cpu_sized]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    started = {}
    try:
        for name, command in commands.items():
            folder = tmp_path_factory.mktemp(name.replace(".", "_"))
            prepare_example(name, folder)
            with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
                started[name] = (subprocess.Popen(command, cwd=folder, env=env, stdout=out, stderr=err), folder)
        for process, _ in started.values():
            process.wait(timeout=600)
    finally:
        for process, _ in started.values():
            if process.poll() is None:
                process.kill()
    return {name: (process.returncode, folder) for name, (process, folder) in started.items()}


def finished(runs, name: str) -> tuple[str, Path]:
    """The stdout and folder of a run that exited 0."""
    status, folder = runs[name]
    stdout = (folder / "stdout.txt").read_text()
    assert status == 0, f"{name}: exit {status}\n{stdout[-2000:]}\n{(folder / 'stderr.txt').read_text()[-3000:]}"
    return stdout, folder


def test_make_demo_runs_examples_digits():
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe is not None and recipe.group(1).split() == ["$(PY)", "examples/digits.py"]


def test_the_demo_trains_both_runs_and_prints_the_table(runs):
    stdout, folder = finished(runs, "digits.py")
    for name in ("baseline", "recipe"):
        assert_finite_losses(folder / "runs" / f"digits-{name}" / "metrics.jsonl")
        row = re.search(rf"^{name}\s+{BATCHES}ba\s+{BATCHES}\s+(\S+)\s+(\S+)", stdout, re.MULTILINE)
        assert row is not None, stdout
        accuracy, cross_entropy = map(float, row.groups())
        assert 0.0 <= accuracy <= 1.0 and math.isfinite(cross_entropy)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda path: path.stem)
def test_each_recipe_trains_through_composerjax_train(runs, recipe):
    stdout, folder = finished(runs, recipe.name)
    values = yaml.safe_load(recipe.read_text())
    assert f"run {values['run_name']}: {BATCHES} batches" in stdout, stdout
    loss = re.search(r"final train loss\s+(\S+)", stdout)
    assert loss is not None and math.isfinite(float(loss.group(1))), stdout
    accuracy = re.search(r"^\s+\w*Accuracy\s+(\S+)$", stdout, re.MULTILINE)  # Multiclass/Masked
    assert accuracy is not None and 0.0 <= float(accuracy.group(1)) <= 1.0, stdout
    (path,) = [logger["file"]["path"] for logger in values["loggers"] if "file" in logger]
    assert_finite_losses(folder / path)
