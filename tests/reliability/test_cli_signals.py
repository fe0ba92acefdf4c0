"""A real SIGTERM / SIGINT reaches a running ``composerjax train``: it saves, exits 143 / 130, and autoresume continues.

The installed ``composerjax`` script trains a recipe with a save folder; once its metrics file shows
training under way, the test sends the signal to the process. Then the same recipe with
``--set autoresume=true`` trains two batches more from the checkpoint the signal left.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

COMPOSERJAX = Path(sys.executable).with_name("composerjax")  # the console script next to this python
ENV = dict(os.environ, JAX_PLATFORMS="cpu")

RECIPE = {
    "run_name": "signalled",
    "model": {"name": "mlp", "sizes": [64, 16, 10]},
    "data": {"name": "digits", "batch_size": 16},
    "max_duration": "1000000ba",  # runs until the signal
    "eval_interval": "1000000ba",
    "log_interval": 1,
    "progress_bar": False,
    "run_summary": False,
    "save_folder": "checkpoints",
    "save_interval": "1000000ba",  # only the signal saves
    "loggers": [{"file": {"path": "first.jsonl"}}],
}


def loss_steps(path: Path) -> list[int]:
    """The steps with a train loss in a metrics file (a line still being written is skipped)."""
    steps = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "loss/train/total" in row:
                assert math.isfinite(row["loss/train/total"]), row
                steps.append(row["step"])
    return steps


def checkpoints(folder: Path) -> list[int]:
    """The batch counts of the checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    if not folder.exists():
        return []
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_saves_exits_with_its_status_and_autoresume_continues(tmp_path, signum, status):
    assert COMPOSERJAX.exists(), f"{COMPOSERJAX}: the composerjax script is not installed next to {sys.executable}"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(RECIPE, sort_keys=False))
    with open(tmp_path / "out.txt", "w") as out:
        process = subprocess.Popen([str(COMPOSERJAX), "train", str(recipe)], cwd=tmp_path, env=ENV, stdout=out,
                                   stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while max(loss_steps(tmp_path / "first.jsonl"), default=0) < 3:  # training is under way
                assert process.poll() is None, (tmp_path / "out.txt").read_text()[-3000:]
                assert time.monotonic() < deadline, "no training after 300 s"
                time.sleep(0.05)
            assert checkpoints(tmp_path / "checkpoints") == []
            process.send_signal(signum)
            process.wait(timeout=120)
        finally:
            if process.poll() is None:
                process.kill()
    output = (tmp_path / "out.txt").read_text()
    assert process.returncode == status, output[-3000:]
    assert signal.Signals(signum).name in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    (saved,) = checkpoints(tmp_path / "checkpoints")  # the signal's checkpoint, and only it
    logged = loss_steps(tmp_path / "first.jsonl")
    assert saved >= 3 and logged == list(range(1, saved + 1))  # every step up to the checkpoint was logged

    resumed = subprocess.run(
        [str(COMPOSERJAX), "train", str(recipe), "--set", "autoresume=true", "--set", f"max_duration={saved + 2}ba",
         "--set", "loggers[0].file.path=resumed.jsonl"],
        cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert f"run signalled: {saved + 2} batches" in resumed.stdout, resumed.stdout
    assert loss_steps(tmp_path / "resumed.jsonl") == [saved + 1, saved + 2]  # it started from the checkpoint
    assert checkpoints(tmp_path / "checkpoints") == [saved, saved + 2]
