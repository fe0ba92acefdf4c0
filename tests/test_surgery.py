"""replace_modules: in-place surgery by class, used by the surgery algorithms at INIT."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.models import BasicBlock, SmallResNet
from composerjax.models.surgery import count_modules, replace_modules


class Doubled(nnx.Module):
    """Wraps a module and doubles its output; keeps the wrapped module's weights."""

    def __init__(self, inner: nnx.Module) -> None:
        self.inner = inner

    def __call__(self, x):
        return 2 * self.inner(x)


def test_replaces_modules_in_lists_and_attributes_and_keeps_weights():
    model = SmallResNet(num_classes=3, width=4, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 8, 8))
    model.eval()
    before = model(x)
    head_kernel = np.asarray(model.head.kernel[...])
    assert replace_modules(model, {nnx.Linear: Doubled}) == 1
    np.testing.assert_allclose(model(x), 2 * before, rtol=1e-5)
    np.testing.assert_array_equal(model.head.inner.kernel[...], head_kernel)
    assert replace_modules(model, {BasicBlock: lambda block, index: Doubled(block)}) == 2
    assert count_modules(model, Doubled) == 3
    assert isinstance(model.blocks[1], Doubled)


def test_replaced_modules_are_not_visited_again_unless_asked():
    model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    assert replace_modules(model, {nnx.Linear: Doubled}) == 1
    assert count_modules(model, Doubled) == 1  # the wrapped Linear was not wrapped again


def test_factory_must_return_a_module():
    model = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    with pytest.raises(TypeError, match="Linear returned a int"):
        replace_modules(model, {nnx.Linear: lambda old: 3})


class DoubleHeadAtInit(Algorithm):
    def match(self, event, state):
        return event == Event.INIT

    def apply(self, event, state, logger):
        replace_modules(state.model, {nnx.Linear: Doubled})


def test_surgery_at_init_is_trained_and_its_parameters_are_placed():
    x = np.random.default_rng(0).normal(size=(32, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16), "2ba", optax.sgd(0.1), algorithms=[DoubleHeadAtInit()],
                      progress_bar=False)
    assert "inner" in trainer.state.train_state.params["module"]["head"]
    trainer.fit()
    assert isinstance(trainer.state.model.module.head, Doubled)
    assert trainer.compile_count == 1
