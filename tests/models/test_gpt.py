"""TinyGPT: its attention goes through the one dispatch and computes what its explicit form did."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composerjax.algorithms.alibi import AlibiAttention, apply_alibi
from composerjax.models import CausalSelfAttention, TinyGPT
from composerjax.models.attention import KernelChoice, take_attention_choices


def explicit_call(module: CausalSelfAttention, x: jax.Array) -> jax.Array:
    """CausalSelfAttention's forward as it was written before the dispatch: scores, mask and softmax by hand."""
    batch, length, _ = x.shape
    head_dim = module.dim // module.num_heads
    q, k, v = jnp.split(module.qkv(x), 3, axis=-1)
    q, k, v = (t.reshape(batch, length, module.num_heads, head_dim).transpose(0, 2, 1, 3) for t in (q, k, v))
    logits = (q @ k.transpose(0, 1, 3, 2)) / jnp.sqrt(head_dim).astype(q.dtype)
    bias = module.attention_bias(length)
    logits = logits.astype(jnp.float32) + (0.0 if bias is None else bias)
    causal = jnp.tril(jnp.ones((length, length), bool))
    weights = jax.nn.softmax(jnp.where(causal, logits, -1e30), axis=-1).astype(v.dtype)
    return module.proj((weights @ v).transpose(0, 2, 1, 3).reshape(batch, length, module.dim))


@pytest.mark.parametrize("length", [12, 300])  # 300: the dispatch takes the queries in blocks
@pytest.mark.parametrize("alibi", [False, True])
def test_tiny_gpt_attention_equals_its_explicit_form_through_the_dispatch(length, alibi):
    module = CausalSelfAttention(32, 4, rngs=nnx.Rngs(0))
    if alibi:
        module = AlibiAttention(module)
    x = jax.random.normal(jax.random.key(1), (2, length, 32))
    take_attention_choices()
    out = module(x)
    assert take_attention_choices() == (KernelChoice("xla", "cpu: no fused attention kernel"),)
    np.testing.assert_allclose(out, explicit_call(module, x), atol=1e-6)


def test_tiny_gpt_keeps_its_parameters_and_its_outputs(monkeypatch):
    model = TinyGPT(vocab_size=64, dim=32, depth=2, num_heads=4, max_length=32, rngs=nnx.Rngs(0))
    paths = {path: variable[...].shape for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert paths[("blocks", 0, "attention", "qkv", "kernel")] == (32, 96)
    assert paths[("blocks", 1, "attention", "proj", "kernel")] == (32, 32)
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, 64)
    dispatched = model(tokens)
    with monkeypatch.context() as patch:
        patch.setattr(CausalSelfAttention, "__call__", explicit_call)
        explicit = model(tokens)
    np.testing.assert_allclose(dispatched, explicit, atol=1e-6)
    apply_alibi(model, max_sequence_length=32)
    dispatched = model(tokens)
    with monkeypatch.context() as patch:
        patch.setattr(CausalSelfAttention, "__call__", explicit_call)
        explicit = model(tokens)
    np.testing.assert_allclose(dispatched, explicit, atol=1e-6)
