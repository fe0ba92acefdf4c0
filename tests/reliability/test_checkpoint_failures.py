"""Nothing lost: refused, failed and interrupted saves, shared folders, corrupt checkpoints.

Real folders throughout; real processes where the behaviour is about a process (its exit, its
threads, its death); a real full disk (a small tmpfs, mounted and removed by the test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Trainer
from composerjax.checkpoint.checkpointer import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointSaveError,
    checksums,
)
from composerjax.trainer import Checkpointer

SCRIPT = Path(__file__).with_name("train_script.py")


def make_trainer(folder, duration="6ba", seed=0, optimizer=None, **kwargs) -> Trainer:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    y = rng.normal(size=(48, 1)).astype(np.float32)
    model = nnx.Sequential(nnx.Linear(6, 8, rngs=nnx.Rngs(seed)), nnx.relu, nnx.Linear(8, 1, rngs=nnx.Rngs(seed + 1)))
    return Trainer(model, ArrayLoader((x, y), batch_size=8, seed=1), duration, optimizer or optax.adam(1e-2),
                   loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), progress_bar=False, run_summary=False,
                   save_folder=None if folder is None else str(folder), **kwargs)


def params_of(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state.params))]


def steps_in(folder) -> list[int]:
    """The batch counts of the checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


def checkpoint_at(folder, step) -> Path:
    """The folder of the checkpoint of batch ``step`` (``ep{epoch}-ba{step}``)."""
    (name,) = [name for name in os.listdir(folder) if re.fullmatch(rf"ep\d+-ba{step}", name)]
    return Path(folder) / name


def run_script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)


# -- 1. a save that did not happen is never reported as done --------------------------------------
def test_a_new_run_into_a_folder_with_checkpoints_is_refused_before_it_trains(tmp_path):
    first = make_trainer(tmp_path, save_interval="3ba")
    first.fit()
    first.close()
    with pytest.raises(ValueError) as error:
        make_trainer(tmp_path, save_interval="3ba")
    message = str(error.value)
    assert f"save_folder={str(tmp_path)!r} already holds checkpoints ['ep0-ba3', 'ep1-ba6']" in message
    assert "autoresume=True" in message and "save_overwrite=True" in message
    assert steps_in(tmp_path) == [3, 6]


def test_save_overwrite_replaces_the_old_runs_checkpoints_and_autoresume_loads_the_new_run(tmp_path):
    old = make_trainer(tmp_path, save_interval="3ba", seed=0)
    old.fit()
    old.close()
    new = make_trainer(tmp_path, save_interval="3ba", seed=5, save_overwrite=True)
    new.fit()
    new.close()
    resumed = make_trainer(tmp_path, save_interval="3ba", seed=9, autoresume=True)
    assert resumed.resumed_from == 6
    for saved, loaded in zip(params_of(new), params_of(resumed)):
        np.testing.assert_array_equal(saved, loaded)
    assert any(not np.array_equal(a, b) for a, b in zip(params_of(old), params_of(resumed)))


def test_a_finished_run_restarted_with_autoresume_finishes_again_without_a_save_error(tmp_path):
    # Found by benchmarks/reliability.py: killed after its last checkpoint but before it exited, a run
    # restarts at its end; fit()'s end-of-training save at that batch is the checkpoint it loaded.
    done = make_trainer(tmp_path, save_interval="3ba")
    done.fit()
    done.close()
    again = make_trainer(tmp_path, save_interval="3ba", autoresume=True)
    assert again.resumed_from == 6
    again.fit()
    again.close()
    assert again.state.timestamp.batch == 6 and steps_in(tmp_path) == [3, 6]
    for saved, loaded in zip(params_of(done), params_of(again)):
        np.testing.assert_array_equal(saved, loaded)


def test_a_save_refused_by_orbax_raises_instead_of_returning(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, duration="2ba", save_interval="10ba")
    trainer.fit()  # fit's own final save: checkpoint 2

    def refuse(*args, **kwargs):
        raise ValueError("Destination is not writable")

    monkeypatch.setattr(trainer.checkpointer.writer, "save", refuse)
    with pytest.raises(CheckpointSaveError, match="checkpoint ep0-ba3 not saved in .*: ValueError: Destination is not"):
        trainer.fit("1ba")  # the end-of-fit save is refused: fit fails instead of returning
    assert steps_in(tmp_path) == [2]
    assert trainer.checkpointer.last_saved == 2


def test_a_checkpoint_another_writer_put_ahead_is_an_error_not_a_skip(tmp_path):
    trainer = make_trainer(tmp_path, duration="4ba", save_interval="10ba")
    trainer.fit()  # checkpoint 4
    trainer.checkpointer.wait()
    other = make_trainer(None, duration="2ba")
    other.fit()
    writer = Checkpointer(str(tmp_path), interval="10ba")  # a second writer, no lock taken
    with pytest.raises(CheckpointSaveError, match=r"checkpoint ep0-ba2 not saved: .* already holds checkpoint\(s\) "
                                                  r"\['ep0-ba4'\]"):
        writer.save(other.state)
    writer.close()


def test_save_checkpoint_returns_a_checkpoint_that_is_on_disk(tmp_path):
    trainer = make_trainer(tmp_path, duration="3ba", save_interval="10ba")
    trainer.fit()
    trainer.fit("2ba")
    assert trainer.save_checkpoint() == str(tmp_path / "ep0-ba5")
    assert trainer.checkpointer.last_saved == 5 and 5 in steps_in(tmp_path)
    loaded = make_trainer(None, load_path=str(tmp_path / "ep0-ba5"))
    assert loaded.state.timestamp.batch == 5


@pytest.fixture
def full_disk(tmp_path):
    """A 256 KiB tmpfs with 8 KiB free: room for the owner marker, not for a checkpoint."""
    mount = tmp_path / "full"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True)
    try:
        (mount / "filler").write_bytes(b"\0" * (248 * 1024))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_save_that_fails_on_a_full_disk_ends_the_run_at_once_with_the_error(full_disk):
    # orbax's writer threads used to keep the process alive for about 5 minutes: the timeout is a hang guard.
    done = run_script("--save-folder", str(full_disk), "--save-interval", "2ba", "--max-duration", "40ba",
                      timeout=240)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert "CheckpointSaveError: checkpoint ep0-ba2 was not saved" in done.stderr
    assert "No space left on device" in done.stderr
    assert "DONE" not in done.stdout and "saved checkpoint" not in done.stdout + done.stderr
    # One line per orbax error, no pages of tracebacks: the writes tensorstore finishes after orbax's
    # event loop closed (0 to 26 bare tracebacks, by timing) are folded into one line.
    assert "Event loop is closed" not in done.stderr
    assert len(done.stderr.splitlines()) < 60, last
    assert steps_in(full_disk) == []
    # The failed save's half-written folder is gone (it would keep the disk full), listed after the
    # process exited; what the test put there and the owner marker stay.
    assert sorted(os.listdir(full_disk)) == [".composerjax-owner", "filler"]


@pytest.fixture
def read_only_folder(tmp_path):
    """A tmpfs mounted read-only: refused with EROFS even to root (a chmod would not stop root)."""
    mount = tmp_path / "read-only"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("inside", ["", "run/checkpoints"])
def test_a_read_only_save_folder_is_refused_naming_save_folder_and_what_it_needs(read_only_folder, inside):
    folder = str(read_only_folder / inside) if inside else str(read_only_folder)
    with pytest.raises(CheckpointSaveError) as error:
        make_trainer(folder, save_interval="3ba")
    # The first path the kernel refused: the owner file, or the first folder makedirs had to create.
    failed = os.path.join(folder, ".composerjax-owner") if not inside else str(read_only_folder / "run")
    assert str(error.value) == (
        f"save_folder={folder!r} cannot be written (OSError: [Errno 30] Read-only file system: {failed!r}); "
        "expected a folder this process can create and write files in: pass a writable save_folder, or "
        "save_folder=None to save no checkpoints")


def test_a_save_folder_under_a_file_is_refused_naming_save_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    folder = str(tmp_path / "notes.txt" / "checkpoints")
    with pytest.raises(CheckpointSaveError, match=r"^save_folder='[^']*/notes.txt/checkpoints' cannot be written "
                                                  r"\(NotADirectoryError: \[Errno 20\] Not a directory: .*expected a "
                                                  r"folder this process can create and write files in"):
        make_trainer(folder, save_interval="3ba")


# -- 3. an exception during fit finishes the save in flight -----------------------------------------
def test_an_exception_during_fit_finishes_the_save_in_flight_and_reraises_first(tmp_path):
    folder = tmp_path / "ck"
    done = run_script("--save-folder", str(folder), "--save-interval", "5ba", "--fail-at", "7")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "OSError: the data source went away at batch 7"
    assert "checkpoint ep0-ba5, in flight, was finished and verified" in done.stderr
    assert steps_in(folder) == [5] and not [name for name in os.listdir(folder) if "tmp" in name]
    resumed = run_script("--save-folder", str(folder), "--save-interval", "5ba", "--autoresume",
                         "--out", str(tmp_path / "out.json"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["resumed_from"] == 5


# -- 4. two live runs cannot share a folder --------------------------------------------------------
def test_a_second_live_run_is_refused_the_folder_and_a_killed_owner_releases_it(tmp_path):
    folder = tmp_path / "ck"
    owner = subprocess.Popen([sys.executable, str(SCRIPT), "--save-folder", str(folder), "--save-interval", "2ba",
                              "--ready-at", "4", "--hold-at", "4"], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "READY 0"
        deadline = time.monotonic() + 60
        while not (folder / "ep0-ba2").is_dir():  # the owner holds at batch 4; checkpoint 2 lands in the background
            assert time.monotonic() < deadline, os.listdir(folder)
            time.sleep(0.05)
        second = run_script("--save-folder", str(folder), "--autoresume")
        assert second.returncode == 1
        assert "SaveFolderInUseError" in second.stderr
        assert f'"pid": {owner.pid}' in second.stderr and "in use by another live run" in second.stderr
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    assert owner.returncode == -signal.SIGKILL
    third = run_script("--save-folder", str(folder), "--autoresume", "--out", str(tmp_path / "out.json"))
    assert third.returncode == 0, third.stderr[-2000:]
    assert json.loads((tmp_path / "out.json").read_text())["resumed_from"] == 2


# -- 6. corrupt checkpoints: autoresume walks back ------------------------------------------------
@pytest.fixture
def three_checkpoints(tmp_path):
    trainer = make_trainer(tmp_path / "ck", save_interval="2ba")
    trainer.fit()
    trainer.close()
    return tmp_path / "ck"


def params_at(folder, step) -> list[np.ndarray]:
    return params_of(make_trainer(None, load_path=str(checkpoint_at(folder, step))))


def resume_reporting(folder, capsys) -> tuple[Trainer, str]:
    trainer = make_trainer(folder, save_interval="2ba", autoresume=True)
    return trainer, capsys.readouterr().err


def test_bytes_overwritten_in_the_data_files_are_caught_and_the_checkpoint_skipped(three_checkpoints, capsys):
    expected = params_at(three_checkpoints, 4)
    for data in (three_checkpoints / "ep1-ba6" / "state").rglob("*"):
        if data.is_file() and data.parent.name == "d":
            raw = bytearray(data.read_bytes())
            middle = len(raw) // 2
            raw[middle:middle + 8] = b"\xff" * 8
            data.write_bytes(bytes(raw))
    trainer, err = resume_reporting(three_checkpoints, capsys)
    assert trainer.resumed_from == 4
    assert "skipped checkpoint ep1-ba6" in err and "DATA_LOSS" in err  # tensorstore's own check on its files
    for saved, loaded in zip(expected, params_of(trainer)):
        np.testing.assert_array_equal(saved, loaded)
    trainer.fit()  # back at batch 6, the run replaces the corrupt checkpoint instead of being refused
    trainer.close()
    assert steps_in(three_checkpoints) == [2, 4, 6]
    for saved, trained in zip(params_at(three_checkpoints, 6), params_of(trainer)):
        np.testing.assert_array_equal(saved, trained)


def test_arrays_that_read_back_but_differ_from_what_was_written_fail_the_checksum(three_checkpoints, capsys):
    import shutil

    # A well-formed 'state' item from another checkpoint (a partial copy, a mixed-up restore): tensorstore
    # reads it without complaint; only the checksums saved with checkpoint 6 can tell.
    shutil.rmtree(three_checkpoints / "ep1-ba6" / "state")
    shutil.copytree(three_checkpoints / "ep0-ba4" / "state", three_checkpoints / "ep1-ba6" / "state")
    expected = params_at(three_checkpoints, 4)
    trainer, err = resume_reporting(three_checkpoints, capsys)
    assert trainer.resumed_from == 4
    assert "skipped checkpoint ep1-ba6" in err and "differ from what was written (checksum)" in err
    assert "params.layers.0.kernel" in err or "opt_state" in err or "clock" in err
    for saved, loaded in zip(expected, params_of(trainer)):
        np.testing.assert_array_equal(saved, loaded)


def test_a_checksum_catches_a_flipped_bit_in_any_position():
    values = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)
    base = checksums({"w": values})["w"]
    bits = np.asarray(values).view(np.uint32).copy()
    for index in (0, 7, 23):
        for bit in (0, 15, 31):
            flipped = bits.copy()
            flipped.flat[index] ^= np.uint32(1 << bit)
            assert checksums({"w": jnp.asarray(flipped.view(np.float32))})["w"] != base, (index, bit)
    swapped = np.asarray(values).copy()
    swapped.flat[0], swapped.flat[1] = swapped.flat[1], swapped.flat[0]
    assert checksums({"w": jnp.asarray(swapped)})["w"] != base


def test_an_unreadable_meta_item_is_skipped(three_checkpoints, capsys):
    (three_checkpoints / "ep1-ba6" / "meta" / "metadata").write_text("{not json")
    trainer, err = resume_reporting(three_checkpoints, capsys)
    assert trainer.resumed_from == 4
    assert "skipped checkpoint ep1-ba6" in err and "'meta' item cannot be read" in err


def test_a_missing_item_is_reported_as_an_incomplete_checkpoint_and_skipped(three_checkpoints, capsys):
    import shutil

    shutil.rmtree(three_checkpoints / "ep1-ba6" / "state")
    trainer, err = resume_reporting(three_checkpoints, capsys)
    assert trainer.resumed_from == 4
    assert "checkpoint ep1-ba6 is incomplete: its 'state' item (the arrays) is missing" in err


def test_when_every_checkpoint_is_corrupt_the_error_lists_each(three_checkpoints):
    names = ("ep0-ba2", "ep0-ba4", "ep1-ba6")
    for name in names:
        (three_checkpoints / name / "meta" / "metadata").write_text("garbage")
    with pytest.raises(CheckpointCorruptError) as error:
        make_trainer(three_checkpoints, save_interval="2ba", autoresume=True)
    message = str(error.value)
    assert "no checkpoint loads" in message
    assert all(f"checkpoint {name}:" in message for name in names)


def test_a_checkpoint_that_does_not_fit_stops_the_walk_instead_of_skipping(three_checkpoints):
    with pytest.raises(CheckpointMismatchError):
        make_trainer(three_checkpoints, save_interval="2ba", autoresume=True, optimizer=optax.sgd(0.1))


def test_adam_and_adamw_checkpoints_are_a_mismatch_not_a_raw_orbax_error(tmp_path):
    trainer = make_trainer(tmp_path, duration="2ba", save_interval="2ba")
    trainer.fit()
    trainer.close()
    with pytest.raises(CheckpointMismatchError) as error:
        make_trainer(None, load_path=str(tmp_path), optimizer=optax.adamw(1e-2))
    assert "optimizer state" in str(error.value)
