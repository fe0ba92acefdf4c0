"""LayerFreezing: the schedule, layer order, and frozen weights and Adam moments staying bit-identical."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, Trainer
from composerjax.algorithms.layer_freezing import (
    NEVER,
    LayerFreezing,
    freeze_layers,
    freeze_schedule,
    frozen_from_steps,
    layer_indices,
)

BATCH = 16


class FourLayers(nnx.Module):
    """Attribute names in reverse alphabetical order: the layer order must follow assignment, not names."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.z_input = nnx.Linear(4, 8, rngs=rngs)
        self.y_hidden = nnx.Linear(8, 8, rngs=rngs)
        self.x_hidden = nnx.Linear(8, 8, rngs=rngs)
        self.w_output = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in (self.z_input, self.y_hidden, self.x_hidden):
            x = jnp.tanh(layer(x))
        return self.w_output(x)


LAYERS = ["z_input", "y_hidden", "x_hidden", "w_output"]


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(2, 2, rngs=rngs)
        self.down = nnx.Linear(2, 2, rngs=rngs)


class Nested(nnx.Module):
    """Layers inside an nnx.List of blocks, a norm layer, and a head that sorts first by name."""

    def __init__(self, rngs: nnx.Rngs) -> None:
        self.stem = nnx.Linear(2, 2, rngs=rngs)
        self.stem_norm = nnx.LayerNorm(2, rngs=rngs)
        self.blocks = nnx.List([Block(rngs), Block(rngs)])
        self.head = nnx.Linear(2, 1, rngs=rngs)


def regression_data(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, np.sin(x @ np.array([[1.0], [-2.0], [0.5], [3.0]], np.float32)).astype(np.float32)


def mse(model: nnx.Module, batch: tuple) -> jax.Array:
    return jnp.mean((model(batch[0]) - batch[1]) ** 2)


class History(Callback):
    """Params and Adam moments after every step (fetched each batch: fine in a test)."""

    def __init__(self) -> None:
        self.params: list[dict] = []
        self.mu: list[dict] = []
        self.nu: list[dict] = []
        self.frozen: list = []

    def batch_end(self, state, logger):
        opt_state = state.train_state.opt_state
        self.params.append(jax.device_get(state.params))
        self.mu.append(jax.device_get(optax.tree.get(opt_state, "mu")))
        self.nu.append(jax.device_get(optax.tree.get(opt_state, "nu")))
        self.frozen.append(state.step_metrics["layer_freezing/layers_frozen"])


def test_freeze_schedule_is_linear_from_freeze_start():
    assert freeze_schedule(0.5, 0.5, 1.0) == 0.0
    assert freeze_schedule(0.75, 0.5, 1.0) == pytest.approx(0.5)
    assert freeze_schedule(1.0, 0.5, 0.5) == pytest.approx(0.5)
    assert freeze_schedule(0.2, 0.0, 1.0) == pytest.approx(0.2)


def test_layers_are_numbered_in_assignment_order():
    indices, count = layer_indices(FourLayers(nnx.Rngs(0)))
    assert count == 4
    assert [indices[name]["kernel"] for name in LAYERS] == [0, 1, 2, 3]
    assert all(indices[name]["bias"] == indices[name]["kernel"] for name in LAYERS)
    nested, count = layer_indices(Nested(nnx.Rngs(0)))
    assert count == 7
    assert nested["stem"]["kernel"] == 0 and nested["stem_norm"]["scale"] == 1
    assert [nested["blocks"][i][name]["kernel"] for i in (0, 1) for name in ("up", "down")] == [2, 3, 4, 5]
    assert nested["head"]["kernel"] == 6  # defined last, although 'head' sorts before 'stem'


def test_frozen_from_steps_follows_the_composer_depth():
    # 4 layers, 8 steps, freeze_start 0: depth(k) = int(k / 8 * 3): layer 0 from step 3, layer 1 from 6, ...
    firsts = frozen_from_steps([0, 1, 2, 3], 4, 8, freeze_start=0.0, freeze_level=1.0)
    assert firsts == [3, 6, 8, NEVER]  # step 8 is past the run; the last layer never freezes
    for step in range(9):
        depth = int(freeze_schedule(step / 8, 0.0, 1.0) * 3)
        assert sum(step >= first for first in firsts) == depth


def test_frozen_layers_and_their_adam_moments_stay_bit_identical():
    x, y = regression_data()
    history = History()
    trainer = Trainer(FourLayers(nnx.Rngs(0)), ArrayLoader((x, y), BATCH, shuffle=False), "8ba", optax.adam(1e-2),
                      loss_fn=mse, algorithms=[LayerFreezing(freeze_start=0.0, freeze_level=1.0)],
                      callbacks=[history], progress_bar=False)
    trainer.fit()
    assert trainer.compile_count == 1
    assert [int(n) for n in jax.device_get(history.frozen)] == [0, 0, 0, 1, 1, 1, 2, 2]

    frozen_from = {"z_input": 3, "y_hidden": 6, "x_hidden": None, "w_output": None}  # 0-based steps
    for name, first in frozen_from.items():
        for step in range(1, 8):  # compare the state after step `step` with the one before it
            for trees in (history.params, history.mu, history.nu):
                before, after = trees[step - 1][name], trees[step][name]
                same = all(np.array_equal(after[k], before[k]) for k in ("kernel", "bias"))
                if first is not None and step >= first:
                    assert same, f"{name} changed at step {step} although frozen from step {first}"
                else:
                    assert not same, f"{name} did not change at step {step}"


def test_freeze_layers_keeps_marked_weights_fixed():
    params = {"first": {"w": jnp.ones(3)}, "last": {"w": jnp.ones(3)}}
    opt = freeze_layers(optax.adam(0.1), lambda p: {"first": {"w": True}, "last": {"w": False}})
    state = opt.init(params)
    for _ in range(3):
        updates, state = opt.update(jax.tree.map(jnp.ones_like, params), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_array_equal(params["first"]["w"], np.ones(3))
    assert not np.allclose(params["last"]["w"], 1.0)


def test_an_unknown_number_of_steps_raises():
    x, y = regression_data()
    with pytest.raises(ValueError, match="LayerFreezing needs to know the number of steps"):
        Trainer(FourLayers(nnx.Rngs(0)), iter([(x, y)]), "10tok", optax.sgd(0.1), loss_fn=mse,
                algorithms=[LayerFreezing()], progress_bar=False, tokens_per_batch=lambda batch: batch[0].size)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"freeze_start": 1.0}, "freeze_start=1.0"),
        ({"freeze_start": -0.1}, "freeze_start=-0.1"),
        ({"freeze_level": 1.5}, "freeze_level=1.5"),
        ({"freeze_level": "all"}, "freeze_level='all'"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LayerFreezing(**kwargs)
