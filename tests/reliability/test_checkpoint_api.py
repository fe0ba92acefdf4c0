"""Checkpoint promises no other test held: ``save_checkpoint()``, the load events, callback state by name.

* ``trainer.save_checkpoint()`` returns the saved checkpoint's folder, and the checkpoint is complete on disk
  when it returns (an async save is still in its ``*.orbax-checkpoint-tmp`` folder then) and loads.
* BEFORE_LOAD and AFTER_LOAD run right after INIT, around the restore, for ``load_path`` (a save folder or one
  checkpoint in it), ``load_weights_only`` and ``autoresume``; not at all when there is nothing to load.
* Callback state comes back by class name (``instance_names``: ``Counter``, ``Counter#1``, ...): callbacks in
  another order get their own state back; a callback the checkpoint does not know (a new or renamed class) keeps
  its fresh state; a saved callback the run no longer has is ignored. Without ``callback_names`` (an older
  checkpoint), state goes by position and the counts must match.
"""

from __future__ import annotations

import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer


def make_trainer(save_folder=None, callbacks=(), duration="4ba", **kwargs) -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    y = rng.normal(size=(48, 1)).astype(np.float32)
    return Trainer(nnx.Linear(6, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), batch_size=8, seed=0), duration,
                   optax.adam(1e-2), loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                   callbacks=list(callbacks), progress_bar=False, run_summary=False,
                   save_folder=None if save_folder is None else str(save_folder), **kwargs)


def params_of(trainer_or_state) -> list[np.ndarray]:
    state = getattr(trainer_or_state, "state", trainer_or_state)
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(state.train_state.params))]


def steps_in(folder) -> list[int]:
    """The batch counts of the checkpoints in ``folder``, read from their names (``ep{epoch}-ba{batch}``)."""
    return sorted(int(match[1]) for match in (re.fullmatch(r"ep\d+-ba(\d+)", n) for n in os.listdir(folder)) if match)


class Counter(Callback):
    """Counts batches; its checkpointed state names it by ``label``; ``loaded`` is what it got back."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.batches = 0
        self.loaded: dict | None = None

    def batch_end(self, state, logger) -> None:
        self.batches += 1

    def state_dict(self) -> dict:
        return {"label": self.label, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = dict(state)


class Tally(Counter):
    """Another class with the same kind of state."""


class Renamed(Counter):
    """What ``Tally`` would be after a rename: a class the checkpoint does not know."""


class Newcomer(Counter):
    """A callback added on restart."""


class LoadWatcher(Counter):
    """Records ``(event, timestamp.batch, whether its own state was restored yet)`` at INIT and the load events."""

    def __init__(self, label: str) -> None:
        super().__init__(label)
        self.seen: list[tuple[str, int, bool]] = []

    def note(self, event: str, state) -> None:
        self.seen.append((event, int(state.timestamp.batch), self.loaded is not None))

    def init(self, state, logger) -> None:
        self.note("init", state)

    def before_load(self, state, logger) -> None:
        self.note("before_load", state)

    def after_load(self, state, logger) -> None:
        self.note("after_load", state)


class SaveNow(Callback):
    """At BATCH_END of batch ``at``: ``trainer.save_checkpoint()``, then look at the folder at once."""

    def __init__(self, at: int, folder) -> None:
        self.at, self.folder = at, str(folder)
        self.trainer: Trainer | None = None
        self.seen: dict | None = None

    def batch_end(self, state, logger) -> None:
        if state.timestamp.batch == self.at:
            returned = self.trainer.save_checkpoint()
            self.seen = {
                "returned": returned,
                "names": sorted(os.listdir(self.folder)),
                "complete": os.path.exists(os.path.join(returned, "_CHECKPOINT_METADATA")),
                "params": params_of(state),
            }


def test_save_checkpoint_returns_the_folder_and_the_checkpoint_is_on_disk_and_loads(tmp_path):
    folder = tmp_path / "checkpoints"
    save_now = SaveNow(2, folder)
    trainer = make_trainer(folder, callbacks=[save_now], save_interval="100ba")
    save_now.trainer = trainer
    trainer.fit()
    seen = save_now.seen
    assert seen["returned"] == str(folder / "ep0-ba2")
    assert seen["complete"], seen["names"]  # finished, not still being written
    assert "ep0-ba2" in seen["names"] and not any("tmp" in name for name in seen["names"]), seen["names"]
    # After training: the end of training was saved (batch 4); saving it again returns that checkpoint.
    assert trainer.save_checkpoint() == str(folder / "ep0-ba4") and trainer.state.timestamp.batch == 4
    trainer.close()
    assert steps_in(folder) == [2, 4]

    loaded = make_trainer(load_path=str(folder / "ep0-ba2"))
    assert loaded.resumed_from == 2 and loaded.state.timestamp.batch == 2
    for saved, restored in zip(seen["params"], params_of(loaded), strict=True):
        np.testing.assert_array_equal(saved, restored)

    with pytest.raises(ValueError, match="save_folder"):
        make_trainer().save_checkpoint()


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 4-batch run saved at batches 2 and 4 with callbacks Counter, Tally, Counter#1 and LoadWatcher."""
    folder = tmp_path_factory.mktemp("saved") / "checkpoints"
    trainer = make_trainer(folder, save_interval="2ba", callbacks=[
        Counter("first"), Tally("tally"), Counter("second"), LoadWatcher("watcher")])
    trainer.fit()
    trainer.close()
    assert steps_in(folder) == [2, 4]
    return folder, trainer.state.state_dict()


@pytest.mark.parametrize("how", ["load_path", "load_path_one_checkpoint", "load_weights_only", "autoresume"])
def test_before_load_and_after_load_run_around_the_restore(saved_run, tmp_path, how):
    folder, _ = saved_run
    watcher = LoadWatcher("new")
    if how == "autoresume":
        folder = shutil.copytree(folder, tmp_path / "checkpoints")
        trainer = make_trainer(folder, callbacks=[watcher], autoresume=True)
    elif how == "load_path_one_checkpoint":
        trainer = make_trainer(callbacks=[watcher], load_path=str(folder / "ep0-ba2"))
    else:
        trainer = make_trainer(callbacks=[watcher], load_path=str(folder), load_weights_only=how == "load_weights_only")
    loaded_batch = {"load_path_one_checkpoint": 2}.get(how, 4)
    if how == "load_weights_only":  # weights only: time and callback state start fresh
        after = ("after_load", 0, False)
    else:
        after = ("after_load", loaded_batch, True)
    assert watcher.seen == [("init", 0, False), ("before_load", 0, False), after]
    assert trainer.resumed_from == loaded_batch
    trainer.close()


def test_load_events_fire_on_every_construction_even_with_nothing_to_load(tmp_path):
    """As in Composer: BEFORE_LOAD/AFTER_LOAD run on every construction; here nothing is restored between them."""
    watcher = LoadWatcher("new")
    trainer = make_trainer(tmp_path / "empty", callbacks=[watcher], autoresume=True)
    assert watcher.seen == [("init", 0, False), ("before_load", 0, False), ("after_load", 0, False)]
    assert trainer.resumed_from is None
    trainer.close()


def test_callback_state_comes_back_by_class_name_in_any_order(saved_run):
    folder, _ = saved_run
    tally, first, second = Tally("new tally"), Counter("new first"), Counter("new second")
    make_trainer(callbacks=[tally, first, second], load_path=str(folder))
    assert tally.loaded == {"label": "tally", "batches": 4}
    assert first.loaded == {"label": "first", "batches": 4}  # 'Counter': the first Counter saved
    assert second.loaded == {"label": "second", "batches": 4}  # 'Counter#1': the second


def test_unknown_callbacks_start_fresh_and_dropped_ones_are_ignored(saved_run):
    folder, _ = saved_run
    renamed, newcomer, counter = Renamed("renamed"), Newcomer("newcomer"), Counter("counter")
    trainer = make_trainer(callbacks=[renamed, newcomer, counter], load_path=str(folder))
    assert trainer.resumed_from == 4
    assert renamed.loaded is None and newcomer.loaded is None  # no saved state under their class names
    assert counter.loaded == {"label": "first", "batches": 4}
    # Tally, Counter#1 and LoadWatcher were saved but are not in this run: ignored, as is a run with no callbacks.
    assert make_trainer(load_path=str(folder)).resumed_from == 4


def test_without_callback_names_state_goes_by_position_and_counts_must_match(saved_run):
    _, saved = saved_run
    older = {key: value for key, value in saved.items() if key != "callback_names"}
    callbacks = [Newcomer("a"), Newcomer("b"), Renamed("c"), Tally("d")]
    make_trainer(callbacks=callbacks).state.load_state_dict(older)
    assert [callback.loaded["label"] for callback in callbacks] == ["first", "tally", "second", "watcher"]
    with pytest.raises(ValueError, match="callbacks has 4 saved entries but the run has 1"):
        make_trainer(callbacks=[Counter("only")]).state.load_state_dict(older)
