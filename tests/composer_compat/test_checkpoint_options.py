"""Composer's checkpoint options: save_filename / save_latest_filename templates, save_overwrite,
save_checkpoint(name, weights_only), load_ignore_keys, load_exclude_algorithms, load_strict_model_weights and
weights-only loads across optimizers. Every case reads the files back and compares arrays exactly.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, CheckpointMismatchError, Trainer
from composerjax.algorithms import EMA
from composerjax.checkpoint.checkpointer import CheckpointSaveError
from composerjax.checkpoint.load import named_leaves
from composerjax.checkpoint.writer import REPLACED, read_info
from composerjax.optim import DecoupledAdamW
from composerjax.trainer import Checkpointer

RNG = np.random.default_rng(0)
X = RNG.normal(size=(48, 4)).astype(np.float32)
Y = RNG.normal(size=(48, 2)).astype(np.float32)  # 6 batches of 8 an epoch


def small_model(seed: int = 0) -> nnx.Module:
    """``layers.0`` (4 -> 8) and ``layers.2`` (8 -> 2)."""
    return nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(seed)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(seed + 1)))


def bigger_model(seed: int = 0) -> nnx.Module:
    """The small model's two layers (same shapes, same initial values) and a third, ``layers.4`` (2 -> 2)."""
    return nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(seed)), nnx.relu, nnx.Linear(8, 2, rngs=nnx.Rngs(seed + 1)),
                          nnx.relu, nnx.Linear(2, 2, rngs=nnx.Rngs(seed + 2)))


def make(folder=None, model=None, optimizer=None, duration="4ba", **kwargs) -> Trainer:
    return Trainer(model or small_model(), ArrayLoader((X, Y), batch_size=8, seed=1), duration,
                   optimizer or optax.adam(1e-2), loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2),
                   progress_bar=False, run_summary=False, save_folder=None if folder is None else str(folder),
                   **kwargs)


def arrays(trainer: Trainer, group: str) -> dict[str, np.ndarray]:
    """``{'layers.0.kernel': array}``: one group of the trainer's device state, fetched to the host."""
    return {name: np.asarray(value) for name, value in
            named_leaves(jax.device_get(getattr(trainer.state.train_state, group))).items()}


def assert_equal(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(expected)
    for name in expected:
        np.testing.assert_array_equal(got[name], expected[name], err_msg=name)


def names_in(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A 4-batch adam + EMA run saved every 2 batches; ``(folder, trainer)``."""
    folder = tmp_path_factory.mktemp("saved") / "checkpoints"
    trainer = make(folder, save_interval="2ba", algorithms=[EMA(half_life="2ba")])
    trainer.fit()
    trainer.close()
    return folder, trainer


@pytest.fixture(scope="module")
def fresh():
    """The same run, not trained: what a value left out of a load stays at."""
    return make(algorithms=[EMA(half_life="2ba")])


# -- names: save_filename, save_latest_filename ------------------------------------------------------
def test_default_names_are_composers_without_rank_or_extension_and_latest_links_the_newest(saved):
    folder, trainer = saved
    assert names_in(folder) == ["ep0-ba2", "ep0-ba4", "latest"]
    assert os.readlink(folder / "latest") == "ep0-ba4"  # relative: the folder can be moved
    record = read_info(str(folder / "ep0-ba4"))
    assert (record.name, record.batch, record.weights_only, record.rotate) == ("ep0-ba4", 4, False, True)
    loaded = make(load_path=str(folder / "latest"), algorithms=[EMA(half_life="2ba")])
    assert loaded.resumed_from == 4
    for group in ("params", "opt_state", "algorithm_state", "clock"):
        assert_equal(arrays(loaded, group), arrays(trainer, group))


def test_save_filename_templates_fill_every_field_and_latest_filename_is_a_template_too(tmp_path):
    trainer = make(tmp_path, duration="1ep", save_interval="3ba", run_name="tiny",
                   save_filename="{run_name}-ep{epoch}-ba{batch:03d}-sp{sample}-tok{token}-rank{rank}",
                   save_latest_filename="{run_name}-newest")
    trainer.fit()
    trainer.close()
    assert names_in(tmp_path) == ["tiny-ep0-ba003-sp24-tok0-rank0", "tiny-ep1-ba006-sp48-tok0-rank0", "tiny-newest"]
    assert os.readlink(tmp_path / "tiny-newest") == "tiny-ep1-ba006-sp48-tok0-rank0"
    loaded = make(load_path=str(tmp_path / "tiny-ep0-ba003-sp24-tok0-rank0"))
    assert loaded.resumed_from == 3 and int(loaded.state.timestamp.sample) == 24


def test_no_latest_link_with_save_latest_filename_none_and_bad_templates_are_refused(tmp_path):
    trainer = make(tmp_path / "a", duration="2ba", save_interval="2ba", save_latest_filename=None)
    trainer.fit()
    trainer.close()
    assert names_in(tmp_path / "a") == ["ep0-ba2"]
    with pytest.raises(ValueError, match=r"save_filename='ep\{epok\}': unknown field \{epok\}"):
        make(tmp_path / "b", save_filename="ep{epok}")
    with pytest.raises(ValueError, match="save_filename='runs/ep{epoch}' gives 'runs/ep0': expected one folder name"):
        make(tmp_path / "c", save_filename="runs/ep{epoch}")
    with pytest.raises(ValueError, match="save_latest_filename='ep{epoch}-ba{batch}' is also save_filename"):
        make(tmp_path / "d", save_latest_filename="ep{epoch}-ba{batch}")


def test_a_pointer_file_stands_in_for_the_link_where_symlinks_fail(tmp_path, monkeypatch):
    def no_symlinks(*args, **kwargs):
        raise OSError("symlinks are not supported here")

    monkeypatch.setattr(os, "symlink", no_symlinks)
    trainer = make(tmp_path, duration="2ba", save_interval="1ba")
    trainer.fit()
    trainer.close()
    assert not os.path.islink(tmp_path / "latest") and (tmp_path / "latest").read_text() == "ep0-ba2\n"
    assert make(load_path=str(tmp_path / "latest")).resumed_from == 2


# -- autoresume by recorded clock, rotation -----------------------------------------------------------
def test_autoresume_and_load_path_take_the_newest_by_recorded_clock_not_by_name(tmp_path):
    first = make(tmp_path, duration="2ep", save_interval="4ba", save_filename="c{batch}",
                 save_num_checkpoints_to_keep=2)
    first.fit()
    first.close()
    assert names_in(tmp_path) == ["c12", "c8", "latest"]  # c4 rotated out; by name c8 would be the newest
    os.rename(tmp_path / "c12", tmp_path / "a-renamed")  # what a checkpoint recorded decides, not its name
    resumed = make(tmp_path, duration="2ep", save_interval="4ba", save_filename="c{batch}", autoresume=True)
    assert resumed.resumed_from == 12
    assert_equal(arrays(resumed, "params"), arrays(first, "params"))
    resumed.close()
    assert make(load_path=str(tmp_path)).resumed_from == 12
    assert Checkpointer(str(tmp_path)).steps() == [8, 12]


def test_rotation_keeps_the_newest_of_the_savers_checkpoints_and_never_a_save_checkpoint_one(tmp_path):
    trainer = make(tmp_path, duration="6ba", save_interval="1ba", save_num_checkpoints_to_keep=2)
    trainer.fit("2ba")
    assert trainer.save_checkpoint("kept-{batch}") == str(tmp_path / "kept-2")
    trainer.fit("4ba")
    trainer.close()
    assert names_in(tmp_path) == ["ep0-ba5", "ep1-ba6", "kept-2", "latest"]


# -- save_checkpoint, save_overwrite ----------------------------------------------------------------
def test_save_checkpoint_writes_a_named_verified_checkpoint_and_refuses_to_overwrite(tmp_path):
    trainer = make(tmp_path, duration="3ba", save_interval="100ba")
    trainer.fit()
    path = trainer.save_checkpoint("manual-{batch}")
    assert path == str(tmp_path / "manual-3") and read_info(path).batch == 3
    assert trainer.save_checkpoint("manual-{batch}") == path  # the same checkpoint of the same batch: done already
    weights = trainer.save_checkpoint("weights", weights_only=True)
    tree = Checkpointer(str(tmp_path)).writer.metadata(weights).item_metadata["state"].tree
    assert sorted(tree) == ["params", "rest"] and read_info(weights).weights_only
    trainer.fit("1ba")
    with pytest.raises(CheckpointSaveError) as error:
        trainer.save_checkpoint("manual-3")
    message = str(error.value)
    assert f"{str(tmp_path / 'manual-3')!r} already exists (this run wrote it at batch 3)" in message
    assert "save_overwrite=True" in message
    assert make(load_path=str(tmp_path / "manual-3")).resumed_from == 3  # untouched
    trainer.close()


def test_save_overwrite_replaces_a_checkpoint_of_the_same_name(tmp_path):
    first = make(tmp_path, duration="2ba", save_interval="2ba", seed=1)
    first.fit()
    first.close()
    with pytest.raises(ValueError, match=r"already holds checkpoints \['ep0-ba2'\]"):
        make(tmp_path, duration="2ba", save_interval="2ba", seed=2)
    second = make(tmp_path, model=small_model(5), duration="2ba", save_interval="2ba", save_overwrite=True)
    second.fit()
    second.close()
    assert names_in(tmp_path) == ["ep0-ba2", "latest"]
    loaded = make(load_path=str(tmp_path / "ep0-ba2"))
    assert_equal(arrays(loaded, "params"), arrays(second, "params"))


def test_a_replaced_checkpoint_still_loads_when_its_replacement_fails(tmp_path, monkeypatch):
    first = make(tmp_path, duration="2ba", save_interval="2ba")
    first.fit()
    first.close()
    second = make(tmp_path, model=small_model(5), duration="2ba", save_interval="2ba", save_overwrite=True)

    def disk_gone(*args, **kwargs):
        raise OSError("the disk went away")

    monkeypatch.setattr(second.checkpointer.writer, "save", disk_gone)
    with pytest.raises(CheckpointSaveError, match="checkpoint ep0-ba2 not saved"):
        second.fit()
    assert names_in(tmp_path) == ["ep0-ba2" + REPLACED, "latest"]
    loaded = make(load_path=str(tmp_path))  # the old checkpoint, under its own name
    assert loaded.resumed_from == 2
    assert_equal(arrays(loaded, "params"), arrays(first, "params"))


# -- load_ignore_keys ---------------------------------------------------------------------------------
def test_ignored_model_keys_keep_the_fresh_values_and_the_rest_loads(saved, fresh):
    folder, trainer = saved
    loaded = make(load_path=str(folder), algorithms=[EMA(half_life="2ba")], load_ignore_keys=["state/model/layers.2.*"])
    params, saved_params, fresh_params = arrays(loaded, "params"), arrays(trainer, "params"), arrays(fresh, "params")
    assert_equal({n: v for n, v in params.items() if n.startswith("layers.2")},
                 {n: v for n, v in fresh_params.items() if n.startswith("layers.2")})
    assert_equal({n: v for n, v in params.items() if n.startswith("layers.0")},
                 {n: v for n, v in saved_params.items() if n.startswith("layers.0")})
    assert_equal(arrays(loaded, "opt_state"), arrays(trainer, "opt_state"))
    assert loaded.resumed_from == int(loaded.state.timestamp.batch) == 4
    assert loaded.state.algorithms[0].state_dict() == trainer.state.algorithms[0].state_dict()


def test_ignoring_the_optimizer_rng_and_timestamp_keeps_those_fresh(saved, fresh):
    folder, trainer = saved
    loaded = make(load_path=str(folder), algorithms=[EMA(half_life="2ba")],
                  load_ignore_keys=["state/optimizers/*", "rng", "state/timestamp"])
    assert_equal(arrays(loaded, "params"), arrays(trainer, "params"))
    assert_equal(arrays(loaded, "algorithm_state"), arrays(trainer, "algorithm_state"))
    assert_equal(arrays(loaded, "opt_state"), arrays(fresh, "opt_state"))
    assert_equal(arrays(loaded, "clock"), arrays(fresh, "clock"))
    assert int(loaded.state.timestamp.batch) == 0
    np.testing.assert_array_equal(jax.random.key_data(loaded.state.rng), jax.random.key_data(fresh.state.rng))
    with pytest.warns(UserWarning, match="'state/nothing/\\*' matches nothing"):
        make(load_path=str(folder), algorithms=[EMA(half_life="2ba")], load_ignore_keys=["state/nothing/*"])


def test_a_callable_edits_the_state_dict_before_it_is_applied(saved, fresh):
    folder, trainer = saved
    seen = {}

    def edit(state_dict: dict) -> None:
        seen["top"], seen["state"] = sorted(state_dict), sorted(state_dict["state"])
        seen["model"] = sorted(state_dict["state"]["model"])
        model = state_dict["state"]["model"]
        model["layers.0.kernel"] = model["layers.0.kernel"] * 2
        del state_dict["state"]["optimizers"]

    loaded = make(load_path=str(folder), algorithms=[EMA(half_life="2ba")], load_ignore_keys=edit)
    assert seen == {"top": ["rng", "state"],
                    "state": ["algorithms", "callbacks", "dataset_state", "model", "optimizers", "run_name",
                              "timestamp"],
                    "model": ["layers.0.bias", "layers.0.kernel", "layers.2.bias", "layers.2.kernel"]}
    params, saved_params = arrays(loaded, "params"), arrays(trainer, "params")
    np.testing.assert_array_equal(params["layers.0.kernel"], saved_params["layers.0.kernel"] * 2)
    np.testing.assert_array_equal(params["layers.2.kernel"], saved_params["layers.2.kernel"])
    assert_equal(arrays(loaded, "opt_state"), arrays(fresh, "opt_state"))


def test_bad_load_option_values_name_the_argument(saved):
    folder, _ = saved
    with pytest.raises(ValueError, match="load_ignore_keys='rng': expected a list of paths"):
        make(load_path=str(folder), load_ignore_keys="rng")
    with pytest.raises(ValueError, match="load_exclude_algorithms='EMA': expected a list of algorithm class names"):
        make(load_path=str(folder), load_exclude_algorithms="EMA")


# -- load_exclude_algorithms --------------------------------------------------------------------------
def test_excluded_algorithms_are_neither_loaded_nor_required_to_match(saved, fresh):
    folder, trainer = saved
    with pytest.raises(CheckpointMismatchError, match="algorithm state: the checkpoint has 5 arrays, this run has 0"):
        make(load_path=str(folder))
    without = make(load_path=str(folder), load_exclude_algorithms=["EMA"])
    assert_equal(arrays(without, "params"), arrays(trainer, "params"))
    assert_equal(arrays(without, "opt_state"), arrays(trainer, "opt_state"))
    with_fresh_ema = make(load_path=str(folder), algorithms=[EMA(half_life="2ba")], load_exclude_algorithms=["EMA"])
    assert_equal(arrays(with_fresh_ema, "params"), arrays(trainer, "params"))
    assert_equal(arrays(with_fresh_ema, "algorithm_state"), arrays(fresh, "algorithm_state"))
    assert with_fresh_ema.state.algorithms[0].state_dict() == fresh.state.algorithms[0].state_dict()


# -- load_strict_model_weights ------------------------------------------------------------------------
def test_strict_model_weights_lists_every_difference_and_non_strict_loads_what_both_have(saved):
    folder, trainer = saved
    with pytest.raises(CheckpointMismatchError) as error:
        make(model=bigger_model(), load_path=str(folder), load_weights_only=True)
    assert ("model parameters: the checkpoint has 4 arrays, this run has 6; missing from the checkpoint: "
            "params.layers.4.bias, params.layers.4.kernel") in str(error.value)
    fresh_bigger = arrays(make(model=bigger_model()), "params")
    with pytest.warns(UserWarning, match=r"missing from the checkpoint \(kept as they are\): "
                                         r"\['params.layers.4.bias', 'params.layers.4.kernel'\]"):
        loaded = make(model=bigger_model(), load_path=str(folder), load_weights_only=True,
                      load_strict_model_weights=False)
    params = arrays(loaded, "params")
    assert_equal({n: v for n, v in params.items() if not n.startswith("layers.4")}, arrays(trainer, "params"))
    assert_equal({n: v for n, v in params.items() if n.startswith("layers.4")},
                 {n: v for n, v in fresh_bigger.items() if n.startswith("layers.4")})
    assert int(loaded.state.timestamp.batch) == 0


def test_non_strict_full_loads_need_the_optimizer_left_out_and_report_unexpected_keys(tmp_path):
    bigger = make(tmp_path, model=bigger_model(), duration="2ba", save_interval="2ba")
    bigger.fit()
    bigger.close()
    with pytest.raises(CheckpointMismatchError, match="optimizer state: the checkpoint has 13 arrays, this run has 9"):
        make(load_path=str(tmp_path), load_strict_model_weights=False)
    with pytest.warns(UserWarning, match=r"not in this run \(not loaded\): \['params.layers.4.bias', "
                                         r"'params.layers.4.kernel'\]"):
        loaded = make(load_path=str(tmp_path), load_strict_model_weights=False,
                      load_ignore_keys=["state/optimizers/*"])
    saved_params = arrays(bigger, "params")
    assert_equal(arrays(loaded, "params"), {n: v for n, v in saved_params.items() if not n.startswith("layers.4")})
    assert loaded.resumed_from == int(loaded.state.timestamp.batch) == 2


# -- weights only, another optimizer ------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", [optax.sgd(0.1), DecoupledAdamW(lr=1e-3, weight_decay=1e-5)],
                         ids=["sgd", "DecoupledAdamW"])
def test_weights_only_loads_a_checkpoint_saved_with_another_optimizer(saved, optimizer):
    folder, trainer = saved
    fresh = make(optimizer=optimizer)
    loaded = make(optimizer=optimizer, load_path=str(folder), load_weights_only=True)
    assert loaded.resumed_from == 4 and int(loaded.state.timestamp.batch) == 0
    assert_equal(arrays(loaded, "params"), arrays(trainer, "params"))
    assert_equal(arrays(loaded, "opt_state"), arrays(fresh, "opt_state"))
    with pytest.raises(CheckpointMismatchError, match="optimizer state"):  # a full load needs the same optimizer
        make(optimizer=optimizer, load_path=str(folder), load_exclude_algorithms=["EMA"])
    loaded.fit("1ba")  # and it trains on from there
    assert int(loaded.state.timestamp.batch) == 1


def test_save_folder_template_with_run_name_as_composer(tmp_path):
    # Composer's default save folder is '{run_name}/checkpoints'; autoresume finds the same folder again.
    template = str(tmp_path / "{run_name}" / "checkpoints")
    trainer = make(template, run_name="templated", save_interval="2ba")
    trainer.fit()
    trainer.close()
    assert names_in(tmp_path / "templated" / "checkpoints") == ["ep0-ba2", "ep0-ba4", "latest"]
    resumed = make(template, run_name="templated", duration="6ba", save_interval="2ba", autoresume=True)
    assert resumed.resumed_from == 4  # the batch it resumed from
    assert resumed.checkpointer.folder == str(tmp_path / "templated" / "checkpoints")
    resumed.close()
