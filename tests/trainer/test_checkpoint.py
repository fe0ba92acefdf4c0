"""Checkpoints: async orbax saves, autoresume, load_path, weights only, validation, time limit, NaN skip."""

from __future__ import annotations

import json
import os
import re
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, BatchError, Callback, CheckpointMismatchError, Trainer
from composerjax.algorithms import EMA, SWA
from composerjax.callbacks import NaNMonitor
from composerjax.checkpoint.checkpointer import OWNER_FILE
from composerjax.loggers import InMemoryLogger
from composerjax.trainer import Checkpointer
from composerjax.trainer.stopping import TimeLimit


def regression_data(samples: int = 48) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(samples, 6)).astype(np.float32), rng.normal(size=(samples, 1)).astype(np.float32)


def make_trainer(folder, duration="3ep", width=8, optimizer=None, data=None, shuffle=True, **kwargs) -> Trainer:
    x, y = data if data is not None else regression_data()
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(6, width, rngs=rngs), nnx.relu, nnx.Dropout(0.2, rngs=rngs),
                           nnx.Linear(width, 1, rngs=rngs))
    return Trainer(model, ArrayLoader((x, y), batch_size=16, seed=3, shuffle=shuffle), duration,
                   optimizer or optax.adam(1e-2), loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                   progress_bar=False, run_summary=False,
                   save_folder=str(folder) if folder is not None else None, **kwargs)


def leaves(trainer: Trainer, key: str | None = None) -> list[np.ndarray]:
    tree = trainer.state.train_state if key is None else getattr(trainer.state.train_state, key)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(tree))]


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b):
        np.testing.assert_array_equal(left, right)


def saved_steps(folder) -> list[int]:
    """The batch counts of the checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


class Crash(Callback):
    """Raise at BATCH_END of batch ``at``: the run dies without saving anything more."""

    def __init__(self, at: int) -> None:
        self.at = at

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            raise RuntimeError("simulated crash")


@pytest.fixture(scope="module")
def uninterrupted() -> Trainer:
    trainer = make_trainer(None)
    trainer.fit()
    return trainer


def test_autoresume_after_a_crash_continues_bit_identically(tmp_path, uninterrupted):
    first = make_trainer(tmp_path, save_interval="2ba", callbacks=[Crash(5)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit()
    first.checkpointer.wait()
    assert saved_steps(tmp_path) == [2, 4]

    resumed = make_trainer(tmp_path, save_interval="2ba", autoresume=True)
    assert resumed.resumed_from == 4
    assert resumed.state.timestamp.batch == 4 and resumed.state.timestamp.batch_in_epoch == 1
    resumed.fit()
    resumed.close()
    assert resumed.state.timestamp.batch == uninterrupted.state.timestamp.batch == 9
    assert_same(leaves(uninterrupted), leaves(resumed))
    assert saved_steps(tmp_path) == [2, 4, 6, 8, 9]  # the end of training is always saved


def test_keep_n_and_load_path_from_folder_or_one_checkpoint(tmp_path, uninterrupted):
    trainer = make_trainer(tmp_path, save_interval="1ba", save_num_checkpoints_to_keep=2)
    trainer.fit()
    trainer.close()
    assert saved_steps(tmp_path) == [8, 9]
    loaded = make_trainer(None, load_path=str(tmp_path))
    assert loaded.resumed_from == 9 and loaded.state.timestamp.epoch == 3
    assert_same(leaves(uninterrupted), leaves(loaded))
    older = make_trainer(None, load_path=str(tmp_path / "ep2-ba8"))
    assert older.resumed_from == 8 and older.state.timestamp.batch == 8


def test_ema_average_comes_back_exactly(tmp_path):
    trainer = make_trainer(tmp_path, duration="5ba", save_interval="5ba", algorithms=[EMA(half_life="2ba")])
    trainer.fit()
    trainer.close()
    loaded = make_trainer(None, duration="5ba", load_path=str(tmp_path), algorithms=[EMA(half_life="2ba")])
    averages = leaves(trainer, "algorithm_state")
    assert len(averages) > 1
    assert_same(averages, leaves(loaded, "algorithm_state"))


@pytest.mark.parametrize("interval", ["1ba", "1ep"])
def test_swa_average_and_window_come_back_exactly_after_a_crash(tmp_path, interval):
    def swa():
        return SWA(swa_start="0.2dur", swa_end="0.9dur", update_interval=interval)

    reference = make_trainer(None, duration="4ep", algorithms=[swa()])
    reference.fit()
    crashed = make_trainer(tmp_path, duration="4ep", save_interval="3ba", algorithms=[swa()], callbacks=[Crash(7)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        crashed.fit()
    crashed.checkpointer.wait()
    resumed = make_trainer(tmp_path, duration="4ep", save_interval="3ba", algorithms=[swa()], autoresume=True)
    assert resumed.resumed_from == 6
    resumed.fit()
    resumed.close()
    average = leaves(reference, "algorithm_state")
    assert int(jax.device_get(reference.state.train_state.algorithm_state["SWA"]["count"])) > 1
    assert_same(average, leaves(resumed, "algorithm_state"))
    assert_same(leaves(reference, "params"), leaves(resumed, "params"))
    # The host side of the window came back too: both runs swapped the average in once, at the same step.
    assert reference.state.algorithms[0].state_dict() == resumed.state.algorithms[0].state_dict()
    assert resumed.state.algorithms[0].state_dict()["completed"] is True


def test_weights_only_save_and_load(tmp_path, uninterrupted):
    trainer = make_trainer(tmp_path, save_weights_only=True)
    trainer.fit()
    trainer.close()
    saved = Checkpointer(str(tmp_path)).writer.metadata(str(tmp_path / "ep3-ba9")).item_metadata["state"].tree
    assert sorted(saved) == ["params", "rest"]
    fresh = make_trainer(None, optimizer=optax.sgd(0.1))
    loaded = make_trainer(None, optimizer=optax.sgd(0.1), load_path=str(tmp_path), load_weights_only=True)
    assert_same(leaves(uninterrupted, "params"), leaves(loaded, "params"))
    assert loaded.state.timestamp.batch == 0  # time and optimizer start fresh
    assert_same(leaves(fresh, "opt_state"), leaves(loaded, "opt_state"))
    with pytest.raises(CheckpointMismatchError, match="load_weights_only=True"):
        make_trainer(None, load_path=str(tmp_path))
    with pytest.raises(ValueError, match="save_weights_only=True"):
        make_trainer(tmp_path, autoresume=True, save_weights_only=True)


def test_hyperparameters_are_saved_as_json(tmp_path):
    trainer = make_trainer(tmp_path, duration="2ba", save_interval="1ba", seed=7, algorithms=[EMA(half_life="3ba")])
    trainer.fit()
    trainer.close()
    hparams = Checkpointer(str(tmp_path)).read_hparams()
    assert hparams["max_duration"] == "2ba" and hparams["seed"] == 7 and hparams["save_interval"] == "1ba"
    assert hparams["algorithms"][0]["name"] == "EMA"
    assert hparams["versions"]["jax"] == jax.__version__
    on_disk = json.loads((tmp_path / "ep0-ba2" / "meta" / "metadata").read_text())
    assert on_disk["hparams"] == hparams and on_disk["host"]["timestamp"]["batch"] == 2


def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_changes(tmp_path):
    trainer = make_trainer(tmp_path, duration="2ba", save_interval="1ba")
    trainer.fit()
    trainer.close()
    before = {path: os.path.getmtime(os.path.join(root, path)) for root, _, files in os.walk(tmp_path)
              for path in files if path != OWNER_FILE}
    with pytest.raises(CheckpointMismatchError) as error:
        make_trainer(None, width=5, load_path=str(tmp_path))
    message = str(error.value)
    assert "load_path=" in message and "model parameters" in message
    assert "layers.0.kernel saved with shape (6, 8), this run expects (6, 5)" in message
    with pytest.raises(CheckpointMismatchError, match="optimizer state: the checkpoint has 9 arrays, this run has 0"):
        make_trainer(None, optimizer=optax.sgd(0.1), load_path=str(tmp_path))
    with pytest.raises(CheckpointMismatchError, match="save_folder="):  # autoresume into a different model
        make_trainer(tmp_path, width=5, autoresume=True)
    after = {path: os.path.getmtime(os.path.join(root, path)) for root, _, files in os.walk(tmp_path)
             for path in files if path != OWNER_FILE}
    assert saved_steps(tmp_path) == [1, 2] and after == before


def test_bad_checkpoint_arguments_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_path="):
        make_trainer(None, load_path=str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        make_trainer(None, load_path=str(tmp_path))
    with pytest.raises(ValueError, match="save_interval="):
        make_trainer(tmp_path, save_interval="10sp")
    with pytest.raises(ValueError, match="save_interval='soon'"):
        make_trainer(tmp_path, save_interval="soon")
    with pytest.raises(ValueError, match="autoresume=True needs save_folder"):
        make_trainer(None, autoresume=True)
    with pytest.raises(ValueError, match="save_num_checkpoints_to_keep=0"):
        make_trainer(tmp_path, save_num_checkpoints_to_keep=0)
    with pytest.raises(ValueError, match="time_limit='10ep'"):
        make_trainer(None, time_limit="10ep")


class RewindClock(Callback):
    """Make the time limit run out at BATCH_END of batch ``at`` (no sleeping in tests)."""

    def __init__(self, trainer_box: list, at: int) -> None:
        self.box, self.at = trainer_box, at

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            limit = next(c for c in self.box[0].state.callbacks if isinstance(c, TimeLimit))
            limit._started -= 3 * 3600


def test_time_limit_saves_stops_and_autoresume_continues(tmp_path, uninterrupted):
    box: list = []
    trainer = make_trainer(tmp_path, save_interval="1ep", time_limit="2h30m", callbacks=[RewindClock(box, 5)])
    box.append(trainer)
    assert trainer.time_limit == 9000.0
    trainer.fit()
    trainer.close()
    assert trainer.stop_reason == "time_limit" and trainer.state.timestamp.batch == 5
    assert saved_steps(tmp_path) == [3, 5]
    resumed = make_trainer(tmp_path, save_interval="1ep", time_limit="2h30m", autoresume=True)
    assert resumed.resumed_from == 5
    resumed.fit()
    assert resumed.stop_reason is None and resumed.state.timestamp.batch == 9
    assert_same(leaves(uninterrupted), leaves(resumed))


def nan_data(bad_batch: int) -> tuple[np.ndarray, np.ndarray]:
    x, y = regression_data()
    x = x.copy()
    x[16 * bad_batch] = np.nan  # one sample of that (unshuffled) batch
    return x, y


def test_skip_nonfinite_updates_leaves_the_state_as_it_was():
    memory = InMemoryLogger()
    skipped = make_trainer(None, duration="3ba", data=nan_data(2), shuffle=False, skip_nonfinite_updates=True,
                           loggers=[memory], log_interval=1)
    skipped.fit()
    # The same compiled step (the guard changes how XLA fuses the update), stopped before the bad batch.
    two_batches = make_trainer(None, duration="2ba", data=nan_data(2), shuffle=False, skip_nonfinite_updates=True)
    two_batches.fit()
    for key in ("params", "opt_state", "rest"):
        assert_same(leaves(two_batches, key), leaves(skipped, key))
    assert skipped.state.timestamp.batch == 3
    assert [value for _, value in memory.data["train/skipped_nonfinite"]] == [0.0, 0.0, 1.0]
    plain = make_trainer(None, duration="3ba", data=nan_data(2), shuffle=False)
    plain.fit()
    assert any(np.isnan(leaf).any() for leaf in leaves(plain, "params"))


def test_nan_monitor_skip_policy_records_instead_of_raising():
    monitor = NaNMonitor(policy="skip")
    trainer = make_trainer(None, duration="3ba", data=nan_data(1), shuffle=False, callbacks=[monitor], log_interval=1)
    with pytest.warns(UserWarning, match="batch 2"):
        trainer.fit()
    assert monitor.skipped == [2]
    assert all(np.isfinite(leaf).all() for leaf in leaves(trainer, "params"))
    with pytest.raises(ValueError, match="policy='never'"):
        NaNMonitor(policy="never")


class Batches:
    """A re-iterable of fixed batches (with len), to feed malformed data."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def fit_on(batches: list) -> Trainer:
    rngs = nnx.Rngs(0)
    trainer = Trainer(nnx.Linear(6, 1, rngs=rngs), Batches(batches), "1ep", optax.sgd(0.1),
                      loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), progress_bar=False, run_summary=False)
    trainer.fit()
    return trainer


def test_malformed_batches_name_the_batch_and_what_was_expected():
    good = (np.zeros((4, 6), np.float32), np.zeros((4, 1), np.float32))
    with pytest.raises(BatchError, match=r"train_dataloader batch 1: batch\[0\] is float32\[4, 5\], but the batches "
                                         r"before it had float32\[4, 6\]"):
        fit_on([good, (np.zeros((4, 5), np.float32), good[1])])
    with pytest.raises(BatchError, match=r"train_dataloader batch 0: the arrays disagree on the batch \(leading\) "
                                         r"dimension \(batch\[0\]: 4, batch\[1\]: 3\)"):
        fit_on([(good[0], np.zeros((3, 1), np.float32))])
    with pytest.raises(BatchError, match=r"batch\[1\] is str"):
        fit_on([(good[0], "labels")])
    with pytest.raises(BatchError, match="different structure"):
        fit_on([good, {"x": good[0], "y": good[1]}])
    with pytest.raises(TypeError) as error:  # the model cannot take it: the error says which batch it was
        fit_on([(np.zeros((4, 3), np.float32), good[1])])
    assert "train_dataloader batch 0: {batch[0]: float32[4, 3], batch[1]: float32[4, 1]}" in "".join(
        getattr(error.value, "__notes__", []))


def test_orbax_writer_threads_run_at_the_lowest_priority_and_the_main_thread_does_not(tmp_path):
    trainer = make_trainer(tmp_path, duration="2ba", save_interval="100ba")
    trainer.fit()  # the first save (orbax's setup) happens at the end of training
    if not os.path.isdir("/proc/self/task"):  # no per-thread ids to find: nothing is touched
        assert trainer.checkpointer.writer_threads == set()
        trainer.close()
        return
    priorities: dict[int, tuple[int, int]] = {}
    switch_intervals = [sys.getswitchinterval()]

    class SaveAndLook(Callback):
        """At batch 3, start a save and read the priority of each thread it started while they work."""

        def batch_end(self, state, logger) -> None:
            if state.timestamp.batch != 3:
                return
            before = set(trainer.checkpointer.writer_threads)
            trainer.checkpointer.save(state)  # async: its writer threads are at work when it returns
            switch_intervals.append(sys.getswitchinterval())
            for tid in trainer.checkpointer.writer_threads - before:
                try:
                    priorities[tid] = (os.getpriority(os.PRIO_PROCESS, tid), os.sched_getscheduler(tid))
                except OSError:  # that thread has already finished
                    pass

    trainer.state.callbacks.append(SaveAndLook())
    trainer.fit("2ba")  # batches 3 and 4
    trainer.checkpointer.wait()
    main = threading.main_thread().native_id
    assert priorities and main not in priorities
    assert set(priorities.values()) == {(19, os.SCHED_IDLE)}
    assert (os.getpriority(os.PRIO_PROCESS, main), os.sched_getscheduler(main)) == (0, os.SCHED_OTHER)
    # And what they write is a complete checkpoint.
    assert saved_steps(tmp_path) == [2, 3, 4]
    # While the save was in flight the GIL changed hands every 0.5 ms; fit()'s closing wait put it back.
    assert switch_intervals == [switch_intervals[0], 0.0005] and sys.getswitchinterval() == switch_intervals[0]
    trainer.close()
    with pytest.raises(ValueError, match=r"writer_switch_interval=0: expected a positive number of seconds"):
        Checkpointer(str(tmp_path), writer_switch_interval=0)


def test_two_checkpointers_share_the_lowered_switch_interval_and_the_last_one_done_restores_it(tmp_path):
    trainer = make_trainer(None, duration="1ba")
    trainer.fit()
    original = sys.getswitchinterval()
    first = Checkpointer(str(tmp_path / "a"), writer_switch_interval=0.001)
    second = Checkpointer(str(tmp_path / "b"), writer_switch_interval=0.0005)
    first.save(trainer.state)
    assert sys.getswitchinterval() == 0.001
    second.save(trainer.state)
    assert sys.getswitchinterval() == 0.0005  # the smaller of the two while both may be writing
    second.wait()
    assert sys.getswitchinterval() == 0.001  # the first one's save may still be in flight
    first.close()
    second.close()
    assert sys.getswitchinterval() == original
    assert first.latest() == second.latest() == 1


def test_surgery_at_init_is_reapplied_before_loading(tmp_path):
    from composerjax.algorithms import Factorize

    def factorize():
        return [Factorize(min_features=6, latent_features=2)]

    trainer = make_trainer(tmp_path, duration="3ba", save_interval="3ba", algorithms=factorize())
    trainer.fit()
    trainer.close()
    loaded = make_trainer(None, duration="3ba", load_path=str(tmp_path), algorithms=factorize())
    assert "linear0" in str(jax.tree_util.tree_structure(loaded.state.train_state.params))
    assert_same(leaves(trainer), leaves(loaded))
    with pytest.raises(CheckpointMismatchError, match="model parameters"):  # an unfactorized model does not fit
        make_trainer(None, duration="3ba", load_path=str(tmp_path))


def test_checkpoints_are_written_uncompressed(tmp_path):
    """Weights hardly compress, so saves skip compression (CPU the steps would lose): zero weights keep their size."""
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(6, 2**16, kernel_init=nnx.initializers.zeros, rngs=rngs),
                           nnx.Linear(2**16, 1, kernel_init=nnx.initializers.zeros, rngs=rngs))
    x, y = regression_data()
    trainer = Trainer(model, ArrayLoader((x, y), batch_size=16, shuffle=False), "1ba", optax.set_to_zero(),
                      loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), progress_bar=False, run_summary=False,
                      save_folder=str(tmp_path), save_interval="1ba")
    trainer.fit()
    trainer.close()
    raw = sum(np.asarray(leaf).nbytes for leaf in leaves(trainer, "params"))
    assert raw > 2**20 and not any(np.asarray(leaf).any() for leaf in leaves(trainer, "params"))
    on_disk = sum(os.path.getsize(os.path.join(folder, name))
                  for folder, _, names in os.walk(tmp_path / "ep0-ba1") for name in names)
    assert on_disk >= raw  # zstd would store these zeros in a few kilobytes
