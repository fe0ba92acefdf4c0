"""Every process of a multi-process job takes the same stop decision at the same batch.

A signal reaching one rank, or a time limit reached on one rank first, used to leave that rank in
orbax's save barrier and the other in its next train step: a hang. Now the ranks agree (through
``jax.distributed``'s coordination service) after every batch. Real processes under ``composerjax
launch``, real signals.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).with_name("train_script.py")


def start_job(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "composerjax", "launch", "-n", "2", "--devices-per-process", "1",
               "--grace-period", "20", str(SCRIPT), "--save-folder", str(tmp_path / "ck"),
               "--out", str(tmp_path / "out-RANK.json"), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def outcome(tmp_path: Path) -> list[dict]:
    return [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in (0, 1)]


def steps_in(folder: Path) -> list[int]:
    """The batch counts of the checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_batch_with_a_checkpoint(tmp_path):
    job = start_job(tmp_path, "--max-duration", "100000ba", "--save-interval", "100000ba", "--ready-at", "3",
                    "--sleep-per-batch", "0.01")
    lines = []
    try:
        pids = {}
        while len(pids) < 2:
            line = job.stdout.readline()
            assert line, "".join(lines)
            lines.append(line)
            if "READY" in line:
                _, rank, pid = line.split("] ", 1)[1].split()
                pids[int(rank)] = int(pid)
        os.kill(pids[1], signal.SIGTERM)
        rest, _ = job.communicate(timeout=300)  # a hang guard: 100,000 batches of 10 ms would take 1,000 s
    finally:
        job.kill()
    output = "".join(lines) + rest
    assert job.returncode == 143, output  # every rank exits as the signalled one does
    ranks = outcome(tmp_path)
    assert ranks[0]["batch"] == ranks[1]["batch"] >= 3, ranks
    assert ranks[0]["stop_reason"] == ranks[1]["stop_reason"] == "SIGTERM"
    assert steps_in(tmp_path / "ck") == [ranks[0]["batch"]]


def test_a_time_limit_reached_on_one_rank_first_stops_both_at_the_same_batch(tmp_path):
    job = start_job(tmp_path, "--max-duration", "100000ba", "--save-interval", "100000ba",
                    "--time-limit", "3s", "--time-limit-rank", "1", "--sleep-per-batch", "0.01")
    output, _ = job.communicate(timeout=180)
    assert job.returncode == 0, output
    ranks = outcome(tmp_path)
    assert ranks[0]["batch"] == ranks[1]["batch"] > 0, ranks
    assert ranks[0]["stop_reason"] == ranks[1]["stop_reason"] == "time_limit"
    assert steps_in(tmp_path / "ck") == [ranks[0]["batch"]]
