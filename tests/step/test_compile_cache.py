"""The persistent compilation cache: a second run in a fresh process loads its compiled steps from the folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from composerjax.step import compile_cache
from composerjax.step.compile_cache import default_cache_folder

SCRIPT = os.path.join(os.path.dirname(__file__), "cache_script.py")


def run(folder, *args: str, **environment: str) -> tuple[dict, str]:
    env = {name: value for name, value in os.environ.items() if name != "COMPOSERJAX_COMPILATION_CACHE"}
    env.update(COMPOSERJAX_CACHE_DIR=str(folder), JAX_PLATFORMS="cpu", **environment)
    done = subprocess.run([sys.executable, SCRIPT, *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stdout


def entries(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith("-cache")) if os.path.isdir(folder) else []


def test_the_second_of_two_runs_loads_its_steps_from_the_cache_folder(tmp_path):
    folder = tmp_path / "cache"
    first, first_output = run(folder)
    written = entries(folder)
    assert first["cache"] == {"folder": str(folder), "steps_loaded": 0, "steps_compiled": 2}  # train and eval
    assert first["records"] == [False, False] and len(written) >= 2
    assert f"compilation cache: {folder}" in first_output
    second, second_output = run(folder)
    assert second["cache"] == {"folder": str(folder), "steps_loaded": 2, "steps_compiled": 0}
    assert second["records"] == [True, True]
    assert "loaded from the compilation cache train step at batch 0" in second_output
    assert entries(folder) == written  # nothing new to write
    assert not [name for name in os.listdir(folder) if name.endswith(".tmp")]


def test_building_the_model_is_cached_too_since_import_switches_the_cache_on(tmp_path):
    folder = tmp_path / "cache"
    first, _ = run(folder)
    assert first["before_trainer"]["entries"] >= 1 and first["before_trainer"]["hits"] == 0
    second, _ = run(folder)
    assert second["before_trainer"]["hits"] == first["before_trainer"]["entries"]  # every init compile loaded


def test_the_off_switch_writes_nothing(tmp_path):
    folder = tmp_path / "cache"
    off, output = run(folder, "--off", COMPOSERJAX_COMPILATION_CACHE="0")
    assert off["cache"] is None and off["records"] == [False, False]
    assert entries(folder) == [] and "compilation cache: off" in output


def test_a_trainer_told_false_compiles_its_steps_without_the_cache(tmp_path):
    """Import switched it on (the model's compiles are cached); ``compilation_cache=False`` stops it there."""
    folder = tmp_path / "cache"
    off, output = run(folder, "--off")
    assert off["cache"] is None and off["records"] == [False, False] and "compilation cache: off" in output
    assert off["before_trainer"]["entries"] >= 1 and off["entries"] == off["before_trainer"]["entries"]


def test_an_entry_whose_write_dies_midway_is_never_seen(tmp_path, monkeypatch):
    """A process killed while writing leaves a temporary file, not a torn entry that every later run would read."""
    from jax._src.lru_cache import LRUCache

    cache = compile_cache._whole_entry_cache(LRUCache)(str(tmp_path), max_size=-1)
    cache.put("whole", b"x" * 1000)
    assert cache.get("whole") == b"x" * 1000

    real_open = open

    class Dies:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()

        def write(self, data):
            self.handle.write(data[: len(data) // 2])
            raise OSError("killed mid-write")

    monkeypatch.setattr(compile_cache, "open", lambda path, mode: Dies(real_open(path, mode)), raising=False)
    with pytest.raises(OSError, match="killed mid-write"):
        cache.put("torn", b"y" * 1000)
    assert cache.get("torn") is None  # no entry: the next run compiles and writes it whole


def test_the_default_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("COMPOSERJAX_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_folder() == os.path.join(str(tmp_path), "composerjax", "jax")
    monkeypatch.setenv("COMPOSERJAX_CACHE_DIR", str(tmp_path / "mine"))
    assert default_cache_folder() == str(tmp_path / "mine")
