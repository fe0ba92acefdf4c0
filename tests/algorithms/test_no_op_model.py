"""NoOpModel: the stand-in model's outputs and loss, and a trainer that never runs the real model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.no_op_model import NoOpModel, NoOpModelClass, noop_model_for


class Exploding(nnx.Module):
    """A module that must never run: NoOpModel replaces the model before any step is built."""

    def __init__(self) -> None:
        self.linear = nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    def __call__(self, x):
        raise AssertionError("the original model ran")


def test_outputs_are_zeros_and_the_loss_is_differentiable_in_the_one_parameter():
    model = NoOpModelClass(num_classes=3)
    batch = (jnp.ones((5, 8, 8)), jnp.zeros(5, jnp.int32))
    outputs = model.forward(batch)
    assert outputs.shape == (5, 3) and not np.any(outputs)
    grads = nnx.grad(lambda m: m.loss(m.forward(batch), batch))(model)
    assert jax.tree.leaves(grads) == [jnp.zeros((1,))]
    assert sum(leaf.size for leaf in jax.tree.leaves(nnx.state(model, nnx.Param))) == 1


def test_noop_model_takes_num_classes_from_a_classifier_else_one():
    assert noop_model_for(ComposerClassifier(nnx.Linear(4, 7, rngs=nnx.Rngs(0)), 7)).num_classes == 7
    assert noop_model_for(nnx.Linear(4, 7, rngs=nnx.Rngs(0))).num_classes == 1
    with pytest.raises(ValueError, match="num_classes=0"):
        NoOpModelClass(num_classes=0)


def test_trainer_runs_the_noop_model_with_one_compile_and_one_parameter():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(80, 4)).astype(np.float32), rng.integers(0, 3, size=80).astype(np.int32)
    trainer = Trainer(ComposerClassifier(Exploding(), num_classes=3), ArrayLoader((x, y), 16, shuffle=False), "5ba",
                      optax.adam(1e-3), algorithms=[NoOpModel()], progress_bar=False)
    assert isinstance(trainer.state.model, NoOpModelClass) and trainer.state.model.num_classes == 3
    params = trainer.state.train_state.params
    assert sum(leaf.size for leaf in jax.tree.leaves(params)) == 1
    trainer.fit()
    assert trainer.state.timestamp.batch == 5
    assert trainer.compile_count == 1
    assert float(trainer.state.loss) == 0.0
    np.testing.assert_array_equal(trainer.state.train_state.params["weight"], [1.0])  # zero gradient
    assert trainer.eval(ArrayLoader((x, y), 16, shuffle=False))["loss"] == 0.0


def test_a_plain_module_with_a_loss_function_gets_the_noop_model_too():
    x = np.ones((32, 4), np.float32)
    y = np.full((32, 1), 2.0, np.float32)
    trainer = Trainer(nnx.Linear(4, 1, rngs=nnx.Rngs(0)), ArrayLoader((x, y), 8, shuffle=False), "3ba",
                      optax.sgd(0.1), loss_fn=lambda model, batch: jnp.mean((model(batch[0]) - batch[1]) ** 2),
                      algorithms=[NoOpModel()], progress_bar=False)
    trainer.fit()
    assert float(trainer.state.loss) == 4.0  # outputs are zeros: (0 - 2)^2
    assert trainer.compile_count == 1
