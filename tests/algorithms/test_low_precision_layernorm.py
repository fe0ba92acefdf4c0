"""LowPrecisionLayerNorm: bf16 LayerNorm against a bf16 reference and fp32, float32 params, run-last at INIT."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import Algorithm, ArrayLoader, ComposerClassifier, Event, Trainer
from composerjax.algorithms.low_precision_layernorm import (
    LowPrecisionLayerNorm,
    LPLayerNorm,
    apply_low_precision_layernorm,
)
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import TinyGPT
from composerjax.models.surgery import count_modules


def bf16_layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, epsilon: float) -> jax.Array:
    """A LayerNorm whose every operation is in bfloat16, written out with plain jax."""
    xb = x.astype(jnp.bfloat16)
    mean = xb.mean(-1, keepdims=True)
    centered = xb - mean
    variance = (centered * centered).mean(-1, keepdims=True)
    normalized = centered * jax.lax.rsqrt(variance + jnp.bfloat16(epsilon))
    return (normalized * scale.astype(jnp.bfloat16) + bias.astype(jnp.bfloat16)).astype(x.dtype)


def test_output_is_the_bf16_computation_and_close_to_fp32():
    layer_norm = nnx.LayerNorm(64, rngs=nnx.Rngs(0))
    layer_norm.scale[...] = jnp.linspace(0.5, 2.0, 64)
    layer_norm.bias[...] = jnp.linspace(-1.0, 1.0, 64)
    x = 3.0 * jax.random.normal(jax.random.key(0), (8, 64)) + 1.0
    fp32 = layer_norm(x)
    low = LPLayerNorm(layer_norm)
    y = low(x)
    assert y.dtype == jnp.float32
    np.testing.assert_array_equal(y, bf16_layer_norm(x, layer_norm.scale[...], layer_norm.bias[...], 1e-6))
    np.testing.assert_allclose(y, fp32, atol=3e-2, rtol=2e-2)  # bf16 keeps 8 significant bits
    assert not np.array_equal(y, fp32)  # it really did compute in bf16
    assert low.scale.dtype == jnp.float32 and low.bias.dtype == jnp.float32
    assert low.scale is layer_norm.scale  # the same parameters, not copies


def test_counts_and_parameters_stay_float32():
    model = TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0))
    before = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert apply_low_precision_layernorm(model) == 3  # norm1, norm2, final norm
    assert count_modules(model, nnx.LayerNorm) == 0
    after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    assert jax.tree.structure(after) == jax.tree.structure(before)  # same parameter tree
    assert {leaf.dtype for leaf in jax.tree.leaves(after)} == {jnp.dtype(jnp.float32)}
    assert apply_low_precision_layernorm(model) == 0
    cross_device = nnx.Sequential(nnx.LayerNorm(4, axis_name="data", rngs=nnx.Rngs(0)))
    assert apply_low_precision_layernorm(cross_device) == 0


def test_bad_precision_names_the_argument():
    with pytest.raises(ValueError, match="precision='fp32'"):
        LowPrecisionLayerNorm(precision="fp32")


class NormalizeHead(Algorithm):
    """Another INIT surgery that adds a LayerNorm in front of TinyGPT's head."""

    def match(self, event, state):
        return event == Event.INIT

    def apply(self, event, state, logger):
        gpt = state.model.module
        gpt.head = nnx.Sequential(nnx.LayerNorm(32, rngs=nnx.Rngs(1)), gpt.head)


def test_runs_last_at_init_so_it_converts_layernorms_added_by_other_surgery():
    x, y = byte_windows(load_pydoc_bytes()[:20000], 32)
    loader = ArrayLoader((x[:32], y[:32]), 16, shuffle=False)
    model = ComposerClassifier(TinyGPT(dim=32, depth=1, num_heads=2, max_length=32, rngs=nnx.Rngs(0)), 256)
    trainer = Trainer(model, loader, "4ba", optax.adam(1e-2), algorithms=[LowPrecisionLayerNorm(), NormalizeHead()],
                      progress_bar=False)
    init = [trace.key for trace in trainer.engine.trace_log if trace.event == Event.INIT]
    assert init == ["NormalizeHead/INIT", "LowPrecisionLayerNorm/INIT"]
    converted = trainer.state.model
    assert count_modules(converted, LPLayerNorm) == 4 and count_modules(converted, nnx.LayerNorm) == 0
    trainer.fit()
    params = trainer.state.train_state.params["module"]
    assert params["norm"]["scale"].dtype == jnp.float32 and params["head"]["layers"][0]["scale"].dtype == jnp.float32
    assert np.isfinite(float(trainer.state.loss)) and float(trainer.state.loss) < np.log(256)
    assert trainer.compile_count == 1
