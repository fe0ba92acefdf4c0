"""Checkpoints: async orbax saves at an interval, autoresume, load_path, keep-N."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Trainer


def make_trainer(folder, duration="3ep", **kwargs) -> Trainer:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(48, 6)).astype(np.float32)
    y = rng.normal(size=(48, 1)).astype(np.float32)
    rngs = nnx.Rngs(0)
    model = nnx.Sequential(nnx.Linear(6, 8, rngs=rngs), nnx.relu, nnx.Dropout(0.2, rngs=rngs),
                           nnx.Linear(8, 1, rngs=rngs))
    return Trainer(model, ArrayLoader((x, y), batch_size=16, seed=3), duration, optax.adam(1e-2),
                   loss_fn=lambda m, b: jnp.mean((m(b[0]) - b[1]) ** 2), progress_bar=False, run_summary=False,
                   save_folder=str(folder) if folder is not None else None, **kwargs)


def leaves(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state))]


def test_autoresume_continues_from_the_newest_checkpoint_bit_identically(tmp_path):
    uninterrupted = make_trainer(None)
    uninterrupted.fit()

    first = make_trainer(tmp_path, save_interval="2ba")
    first.fit("5ba")  # saves at batches 2 and 4; the run "dies" after batch 5
    first.close()
    assert sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit()) == [2, 4]

    resumed = make_trainer(tmp_path, save_interval="2ba", autoresume=True)
    assert resumed.state.timestamp.batch == 4 and resumed.state.timestamp.batch_in_epoch == 1
    resumed.fit()
    resumed.close()
    assert resumed.state.timestamp.batch == uninterrupted.state.timestamp.batch == 9
    for a, b in zip(leaves(uninterrupted), leaves(resumed)):
        np.testing.assert_array_equal(a, b)


def test_keep_n_and_load_path(tmp_path):
    trainer = make_trainer(tmp_path, save_interval="1ep", save_num_checkpoints_to_keep=1)
    trainer.fit()
    trainer.close()
    assert [name for name in os.listdir(tmp_path) if name.isdigit()] == ["9"]
    loaded = make_trainer(None, load_path=str(tmp_path))
    assert loaded.state.timestamp.epoch == 3
    for a, b in zip(leaves(trainer), leaves(loaded)):
        np.testing.assert_array_equal(a, b)


def test_bad_checkpoint_arguments_name_the_field(tmp_path):
    with pytest.raises(FileNotFoundError, match="load_path="):
        make_trainer(None, load_path=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="save_interval="):
        make_trainer(tmp_path, save_interval="10sp")
    with pytest.raises(ValueError, match="autoresume=True needs save_folder"):
        make_trainer(None, autoresume=True)
