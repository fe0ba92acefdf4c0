"""GatedLinearUnits: the GLU block against a hand computation, kept weights, counts, and training TinyGPT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.gated_linear_units import (
    GatedLinearUnits,
    GLUFeedForward,
    apply_gated_linear_units,
    glu_from_feed_forward,
)
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import FeedForward, TinyGPT


def tiny_gpt(depth: int = 1) -> TinyGPT:
    return TinyGPT(dim=32, depth=depth, num_heads=2, max_length=32, rngs=nnx.Rngs(0))


def test_glu_block_output_is_down_of_gelu_gate_times_up():
    rngs = nnx.Rngs(0)
    feed_forward = FeedForward(4, 16, rngs=rngs)
    feed_forward.down.bias[...] = jnp.linspace(-1, 1, 4)
    glu = glu_from_feed_forward(feed_forward, gated_layer_bias=True, rngs=rngs)
    glu.gate.bias[...] = jnp.linspace(0, 1, 16)
    x = jax.random.normal(jax.random.key(1), (3, 4))
    gate, up, down = glu.gate, glu.up, glu.down
    expected = (jax.nn.gelu(x @ gate.kernel[...] + gate.bias[...]) * (x @ up.kernel[...])) @ down.kernel[...]
    np.testing.assert_allclose(glu(x), expected + down.bias[...], rtol=1e-5, atol=1e-6)


def test_up_and_down_weights_are_kept_and_biases_follow_the_flags():
    feed_forward = FeedForward(4, 16, rngs=nnx.Rngs(0))
    feed_forward.up.bias[...] = jnp.arange(16, dtype=jnp.float32)
    up_kernel, down_kernel = np.asarray(feed_forward.up.kernel[...]), np.asarray(feed_forward.down.kernel[...])
    glu = glu_from_feed_forward(feed_forward, rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(glu.up.kernel[...], up_kernel)
    np.testing.assert_array_equal(glu.down.kernel[...], down_kernel)
    assert glu.up.bias is None and glu.gate.bias is None  # the defaults: no biases inside the GLU
    assert glu.gate.kernel.shape == (4, 16) and not np.allclose(glu.gate.kernel[...], up_kernel)
    kept = glu_from_feed_forward(feed_forward, gated_layer_bias=True, non_gated_layer_bias=True, rngs=nnx.Rngs(1))
    np.testing.assert_array_equal(kept.up.bias[...], np.arange(16))
    np.testing.assert_array_equal(kept.gate.bias[...], np.zeros(16))


def test_counts_and_activation():
    model = tiny_gpt(depth=2)
    assert apply_gated_linear_units(model, act_fn=jax.nn.silu, rngs=3) == 2
    assert all(isinstance(block.mlp, GLUFeedForward) for block in model.blocks)
    assert model.blocks[0].mlp.act_fn is jax.nn.silu
    assert apply_gated_linear_units(model) == 0  # nothing left to gate
    assert apply_gated_linear_units(nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))) == 0
    model = tiny_gpt()
    assert apply_gated_linear_units(model) == 1
    assert model.blocks[0].mlp.act_fn is nnx.gelu  # FeedForward's own activation by default


@pytest.mark.parametrize("argument, value",
                         [("act_fn", "gelu"), ("gated_layer_bias", 1), ("non_gated_layer_bias", None)])
def test_bad_arguments_name_the_argument(argument, value):
    with pytest.raises(ValueError, match=f"{argument}={value!r}"):
        GatedLinearUnits(**{argument: value})


def test_gated_tiny_gpt_trains_on_bytes_with_one_compile():
    x, y = byte_windows(load_pydoc_bytes()[:20000], 32)
    loader = ArrayLoader((x[:64], y[:64]), 16, shuffle=False)
    model = tiny_gpt()
    up_kernel = np.asarray(model.blocks[0].mlp.up.kernel[...])
    trainer = Trainer(ComposerClassifier(model, num_classes=256), loader, "8ba", optax.adam(1e-2),
                      algorithms=[GatedLinearUnits()], progress_bar=False)
    mlp = trainer.state.train_state.params["module"]["blocks"][0]["mlp"]
    assert set(mlp) == {"gate", "up", "down"} and "bias" not in mlp["up"]
    np.testing.assert_array_equal(mlp["up"]["kernel"], up_kernel)
    gate_before = np.asarray(mlp["gate"]["kernel"])
    before = trainer.eval(loader)["CrossEntropy"]
    trainer.fit()
    assert trainer.eval(loader)["CrossEntropy"] < before - 0.5
    gate_after = trainer.state.train_state.params["module"]["blocks"][0]["mlp"]["gate"]["kernel"]
    assert not np.allclose(gate_before, gate_after)  # the new gate is trained
    assert trainer.compile_count == 2  # one train step, one eval step
