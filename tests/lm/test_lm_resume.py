"""An LM recipe run with ``composerjax train``, SIGKILLed mid-run and run again, ends bit-identical to an unbroken run.

The recipe trains a tiny GPT-2 with dropout (so the step RNG matters) on the stdlib corpus read by two
grain worker processes (so grain's per-worker iterator state must come back from the checkpoint), saving
every 3 batches with ``autoresume``. The killed run is stopped at a point the test controls: the
``PauseForKill`` callback holds batch 7 until checkpoint 6 is complete and says so in a marker file; only
then does the test send SIGKILL. The very same command then resumes from checkpoint 6 (mid-epoch) and
finishes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

HERE = Path(__file__).parent
ENV = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
           PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
KILL_AT, SAVED, LAST = 7, 6, 12


def write_recipe(folder: Path) -> Path:
    recipe = {
        "run_name": "lm-resume",
        "run_dir": str(folder / "run"),
        "seed": 17,
        "model": {"name": "gpt2", "config": "gpt2-tiny", "vocab_size": 320, "n_positions": 32, "n_embd": 32,
                  "n_layer": 1, "n_head": 2, "dropout": 0.1, "attention_dropout": 0.1},
        "data": {"name": "stdlib_lm", "seq_len": 32, "batch_size": 8, "vocab_size": 320, "max_files": 8,
                 "validation_fraction": 0.0, "worker_count": 2, "seed": 3},
        "optimizer": {"name": "adamw", "lr": 3.0e-3, "weight_decay": 0.01},
        "max_duration": f"{LAST}ba",
        "save_folder": str(folder / "checkpoints"),
        "save_interval": "3ba",
        "autoresume": True,
        "progress_bar": False,
        "run_summary": False,
        "callbacks": [
            {"name": "lm_callbacks:PauseForKill", "at_batch": KILL_AT,
             "checkpoint": str(folder / "checkpoints" / f"ep0-ba{SAVED}"), "marker": str(folder / "paused.json")},
            {"name": "lm_callbacks:DumpTrainState", "path": str(folder / "final.npz")},
        ],
    }
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def start(recipe: Path, log: Path, cache: Path) -> subprocess.Popen:
    """``composerjax train RECIPE`` in its own session (its grain workers with it), output to ``log``.

    The runs share a persistent compilation cache: the resumed run loads the executables the first runs
    compiled (the same programs, so the same results) instead of compiling them again.
    """
    env = dict(ENV, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    with open(log, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "composerjax", "train", str(recipe)], env=env, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen) -> None:
    """SIGKILL whatever is left of ``process``'s session (it, or the grain workers of a killed trainer)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def finish(process: subprocess.Popen, timeout: float = 240) -> int:
    """Wait for ``process`` and return its status; then :func:`stop` its session."""
    try:
        return process.wait(timeout=timeout)
    finally:
        stop(process)


def leaves(path: Path) -> list[np.ndarray]:
    with np.load(path) as data:
        return [data[f"arr_{index}"] for index in range(len(data.files))]


def saved_batches(folder: Path) -> list[int]:
    return sorted(int(name.split("-ba")[1]) for name in os.listdir(folder) if name.startswith("ep")
                  and name.split("-ba")[1].isdigit())


def test_sigkill_then_the_same_command_resumes_bit_identical_with_grain_workers(tmp_path):
    reference_dir, broken_dir, cache = tmp_path / "reference", tmp_path / "broken", tmp_path / "jax-cache"
    for folder in (reference_dir, broken_dir):
        folder.mkdir()
    (reference_dir / "paused.json").write_text("{}")  # the same recipe, its pause disarmed
    reference = start(write_recipe(reference_dir), reference_dir / "log.txt", cache)
    broken = start(write_recipe(broken_dir), broken_dir / "log.txt", cache)
    try:
        marker = broken_dir / "paused.json"
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert broken.poll() is None, (broken_dir / "log.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never reached its pause"
            time.sleep(0.05)
        assert json.loads(marker.read_text()) == {"pid": broken.pid, "batch": KILL_AT}
        os.kill(broken.pid, signal.SIGKILL)  # the trainer alone, a real signal
        assert finish(broken, timeout=60) == -signal.SIGKILL
        # Killed mid-run: no final state, and no checkpoint after the one the pause waited for.
        assert not (broken_dir / "final.npz").exists()
        assert saved_batches(broken_dir / "checkpoints") == [3, SAVED]
        tokenizer_file = broken_dir / "run" / "tokenizer.json"
        tokenizer_bytes, tokenizer_mtime = tokenizer_file.read_bytes(), tokenizer_file.stat().st_mtime_ns

        resumed = start(write_recipe(broken_dir), broken_dir / "log-resumed.txt", cache)  # the very same command
        assert finish(resumed) == 0, (broken_dir / "log-resumed.txt").read_text()[-3000:]
        assert finish(reference) == 0, (reference_dir / "log.txt").read_text()[-3000:]
    finally:
        for process in (broken, reference):  # a failed test leaves nothing running
            stop(process)

    assert json.loads((broken_dir / "final.npz.json").read_text()) == {"started_at": SAVED, "batch": LAST}
    assert json.loads((reference_dir / "final.npz.json").read_text()) == {"started_at": 0, "batch": LAST}
    # The resumed run reloaded the run's tokenizer (not retrained, not rewritten) and it is the reference's.
    assert tokenizer_file.read_bytes() == tokenizer_bytes == (reference_dir / "run" / "tokenizer.json").read_bytes()
    assert tokenizer_file.stat().st_mtime_ns == tokenizer_mtime
    expected, resumed = leaves(reference_dir / "final.npz"), leaves(broken_dir / "final.npz")
    assert len(expected) == len(resumed) > 20  # params, adamw moments, rng keys, clock
    for want, got in zip(expected, resumed, strict=True):
        assert want.dtype == got.dtype and want.shape == got.shape
        assert np.array_equal(want, got)
    assert saved_batches(broken_dir / "checkpoints") == saved_batches(reference_dir / "checkpoints") == [3, 6, 9, 12]
