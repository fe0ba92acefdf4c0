"""GPT-2: the published parameter count, causality, tied head, rotary, dropout modes, KV-cache generation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composerjax.models import generation
from composerjax.models.generation import generate, generate_without_cache, sample_logits
from composerjax.models.gpt2 import (
    GPT2,
    GPT2Attention,
    GPT2Config,
    alibi_position_bias,
    apply_rotary,
    flops_per_token,
    parameter_count,
)


def size_of(state: nnx.State) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state))


@pytest.fixture(scope="module", params=["learned", "rotary"])
def model(request) -> GPT2:
    model = GPT2(GPT2Config.preset("gpt2-tiny", position=request.param, n_layer=1), rngs=nnx.Rngs(0))
    model.eval()
    return model


@nnx.jit
def forward(model: GPT2, x: jax.Array) -> jax.Array:
    return model(x, deterministic=True)


def tokens(shape: tuple[int, int], seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 512, jnp.int32)


def test_gpt2_small_has_the_published_124m_parameters_without_allocating_them():
    assert parameter_count("gpt2-small") == 124_439_808  # Hugging Face's GPT2LMHeadModel('gpt2')
    abstract = nnx.eval_shape(lambda: GPT2("gpt2-small", rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == 124_439_808
    assert parameter_count("gpt2-medium") == 354_823_168


@pytest.mark.parametrize("overrides", [{}, {"position": "rotary"}, {"tie_embeddings": False},
                                       {"position": "rotary", "tie_embeddings": False}])
def test_parameter_count_closed_form_matches_the_model(overrides):
    config = GPT2Config.preset("gpt2-tiny", **overrides)
    abstract = nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == parameter_count(config)


def test_flops_per_token_is_palms_6n_plus_attention():
    n = 124_439_808 - 1024 * 768  # the position table is a lookup, not a matmul
    assert flops_per_token("gpt2-small", 1024) == 6 * n + 12 * 12 * 768 * 1024
    untied = GPT2Config.preset("gpt2-tiny", tie_embeddings=False)
    n_untied = parameter_count(untied) - 128 * 64 - 512 * 64  # positions and the input embedding
    assert flops_per_token(untied, 100) == 6 * n_untied + 12 * 2 * 64 * 100
    with pytest.raises(ValueError, match="seq_len=0"):
        flops_per_token("gpt2-tiny", 0)


@pytest.mark.parametrize(("overrides", "field"), [
    ({"n_embd": 66, "n_head": 4}, "n_embd=66"),
    ({"n_layer": 0}, "n_layer=0"),
    ({"dropout": 1.0}, "dropout=1.0"),
    ({"attention_dropout": -0.1}, "attention_dropout=-0.1"),
    ({"position": "sinusoidal"}, "position='sinusoidal'"),
    ({"n_embd": 6, "n_head": 2, "position": "rotary"}, "head size"),
    ({"layer_norm_epsilon": 0.0}, "layer_norm_epsilon=0.0"),
])
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        GPT2Config.preset("gpt2-tiny", **overrides)
    with pytest.raises(ValueError, match="name='gpt3'"):
        GPT2Config.preset("gpt3")


def test_forward_shape_and_causality(model):
    x = tokens((2, 12))
    logits = forward(model, x)
    assert logits.shape == (2, 12, 512)
    changed = forward(model, x.at[:, 7].set((x[:, 7] + 1) % 512))
    np.testing.assert_allclose(changed[:, :7], logits[:, :7], atol=1e-6)
    assert float(jnp.abs(changed[:, 7:] - logits[:, 7:]).min(axis=-1).max()) > 0
    with pytest.raises(ValueError, match="n_positions=128"):
        model(tokens((1, 129)))


def test_tied_head_is_the_token_embedding():
    config = GPT2Config.preset("gpt2-tiny")
    tied = GPT2(config, rngs=nnx.Rngs(0))
    assert not any("head" in str(path) for path, _ in nnx.to_flat_state(nnx.state(tied, nnx.Param)))
    tied.tokens.embedding[...] = jnp.zeros_like(tied.tokens.embedding[...])
    assert float(jnp.abs(forward(tied, tokens((2, 12)))).max()) == 0.0  # logits = h @ E^T
    untied = GPT2(GPT2Config.preset("gpt2-tiny", tie_embeddings=False), rngs=nnx.Rngs(0))
    untied.tokens.embedding[...] = jnp.zeros_like(untied.tokens.embedding[...])
    assert float(jnp.abs(forward(untied, tokens((2, 12)))).max()) > 0.0


def test_rotary_scores_depend_only_on_relative_position():
    q, k = jax.random.normal(jax.random.key(1), (2, 1, 1, 1, 8))

    @jax.jit
    def rotated(m, n):
        return apply_rotary(q, m[None]), jnp.sum(apply_rotary(q, m[None]) * apply_rotary(k, n[None]))

    def score(m, n):
        return float(rotated(jnp.array(m), jnp.array(n))[1])

    assert score(5, 2) == pytest.approx(score(13, 10), rel=1e-5)
    assert score(5, 2) != pytest.approx(score(5, 3), rel=1e-3)
    np.testing.assert_allclose(rotated(jnp.array(0), jnp.array(0))[0], q, rtol=1e-6)  # position 0: unrotated
    np.testing.assert_allclose(jnp.linalg.norm(rotated(jnp.array(7), jnp.array(0))[0]), jnp.linalg.norm(q), rtol=1e-5)


def test_rotary_model_has_no_position_table_and_sees_token_order():
    # One causal layer without positions is blind to the order of the earlier tokens: rotary must fix that.
    model = GPT2(GPT2Config.preset("gpt2-tiny", position="rotary", n_layer=1), rngs=nnx.Rngs(0))
    assert not hasattr(model, "position")
    x = jnp.array([[3, 9, 27, 81]])
    swapped = jnp.array([[9, 3, 27, 81]])
    last, last_swapped = forward(model, x)[0, -1], forward(model, swapped)[0, -1]
    assert float(jnp.abs(last - last_swapped).max()) > 1e-4


@pytest.mark.parametrize("rate", ["dropout", "attention_dropout"])
def test_dropout_only_in_train_mode(rate):
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1, **{rate: 0.1}), rngs=nnx.Rngs(0))
    call = nnx.jit(lambda model, x: model(x))
    x = tokens((2, 8))
    assert float(jnp.abs(call(model, x) - call(model, x)).max()) > 0  # train mode: a fresh mask per call
    model.eval()
    np.testing.assert_array_equal(call(model, x), call(model, x))


def test_explicit_attention_matches_dot_product_attention_without_dropout():
    attention = GPT2Attention(GPT2Config.preset("gpt2-tiny", attention_dropout=0.1), rngs=nnx.Rngs(0))
    q, k, v = jax.random.normal(jax.random.key(2), (3, 2, 6, 2, 32))
    explicit = nnx.jit(lambda attention, q, k, v: attention._attend_with_dropout(q, k, v, None, None, True))
    fused = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    np.testing.assert_allclose(explicit(attention, q, k, v), fused(q, k, v), atol=1e-5)


def test_cached_decode_step_matches_the_full_forward(model):
    x = tokens((2, 9), seed=3)
    decode = nnx.jit(lambda model, x, start, cache: model.decode(x, start, cache))
    cache = model.init_cache(2, 16)
    prefill, cache = decode(model, x[:, :8], 0, cache)
    full = forward(model, x)
    np.testing.assert_allclose(prefill, full[:, :8], atol=1e-5)
    step, _ = decode(model, x[:, 8:9], 8, cache)
    np.testing.assert_allclose(step[:, 0], full[:, 8], atol=1e-5)


def test_greedy_generation_with_cache_equals_without(model):
    prompt = tokens((2, 5), seed=4)
    cached = generate(model, prompt, 6)
    assert cached.shape == (2, 11)
    np.testing.assert_array_equal(cached[:, :5], prompt)
    np.testing.assert_array_equal(cached, generate_without_cache(model, prompt, 6))
    # The first new token is the argmax of the prompt's last logits.
    np.testing.assert_array_equal(cached[:, 5], jnp.argmax(forward(model, prompt)[:, -1], axis=-1))


def test_sampling_with_the_same_rng_is_the_same_with_or_without_cache():
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(0))
    prompt = tokens((2, 5), seed=5)
    sampled = generate(model, prompt, 6, temperature=1.5, top_k=50, rng=jax.random.key(7))
    np.testing.assert_array_equal(sampled,
                                  generate_without_cache(model, prompt, 6, temperature=1.5, top_k=50, rng=7))
    other = generate(model, prompt, 6, temperature=1.5, top_k=50, rng=8)
    assert bool((sampled != other).any())


def test_top_k_one_and_top_k_filtering():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.0]])
    draw = jax.jit(jax.vmap(lambda key, k: sample_logits(logits, key, 5.0, top_k=k), (0, None)), static_argnums=1)
    keys = jax.random.split(jax.random.key(0), 200)
    assert set(np.asarray(draw(keys, 2)).ravel().tolist()) == {1, 3}  # only the two largest logits
    assert set(np.asarray(draw(keys, 1)).ravel().tolist()) == {1}


def test_generate_compiles_once_per_shape():
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(1))
    before = generation._generate_cached._cache_size()
    first = generate(model, tokens((3, 4), seed=1), 3)
    second = generate(model, tokens((3, 4), seed=2), 3)
    assert generation._generate_cached._cache_size() == before + 1
    assert bool((first != second).any())


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"max_new_tokens": 200}, "max_new_tokens=200"),
    ({"temperature": -1.0}, "temperature=-1.0"),
    ({"temperature": 1.0, "top_k": 0, "rng": 0}, "top_k=0"),
    ({"temperature": 1.0}, "rng=None"),
    ({"rng": "seed"}, "rng='seed'"),
    ({"prompt_tokens": jnp.zeros((4,), jnp.int32)}, "prompt_tokens"),
    ({"prompt_tokens": jnp.array([[1, 512]])}, "prompt_tokens: ids from 1 to 512"),
])
def test_bad_generation_arguments_name_the_argument(kwargs, name):
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(0))
    arguments = {"prompt_tokens": jnp.array([[1, 2]]), "max_new_tokens": 2, **kwargs}
    for function in (generate, generate_without_cache):
        with pytest.raises(ValueError, match=name):
            function(model, **arguments)


def test_parameters_cast_to_bfloat16_compute_in_bfloat16():
    # What precision='amp_bf16' does inside the step: cast the parameters, keep dtype=None.
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=1), rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    cast = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), rest)
    assert jax.eval_shape(lambda x: cast(x, deterministic=True), jnp.zeros((1, 4), jnp.int32)).dtype == jnp.bfloat16


@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_bias_is_the_alibi_algorithms_bias(heads):
    from composerjax.algorithms.alibi import alibi_bias

    got = alibi_position_bias(heads, jnp.arange(7), jnp.arange(7))
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(alibi_bias(heads, 7)))
    # With a cache the keys are the whole cache: query position 2 against keys 0..4.
    np.testing.assert_array_equal(np.asarray(alibi_position_bias(heads, jnp.array([2]), jnp.arange(5))[0, :, 0]),
                                  np.asarray(alibi_bias(heads, 5)[:, 2]))


def test_the_alibi_algorithm_switches_gpt2_to_alibi_keeping_every_other_weight():
    from composerjax.algorithms.alibi import apply_alibi

    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2, attention_dropout=0.1), rngs=nnx.Rngs(0))
    before = nnx.state(model, nnx.Param)
    assert apply_alibi(model, max_sequence_length=256) == 3  # 2 attentions + the position table
    assert apply_alibi(model, max_sequence_length=256) == 0
    assert model.config.position == "alibi" and model.config.n_positions == 256 and not hasattr(model, "position")
    after = nnx.to_flat_state(nnx.state(model, nnx.Param))
    kept = dict(nnx.to_flat_state(before))
    assert {path for path, _ in after} == {path for path in kept if path[0] != "position"}
    for path, value in after:
        np.testing.assert_array_equal(np.asarray(value[...]), np.asarray(kept[path][...]))
    model.eval()
    x = tokens((1, 200))  # longer than the learned table was
    logits = forward(model, x)
    # The explicit attention path (used with attention dropout in training) adds the same bias.
    attention = model.blocks[0].attention
    q = k = v = jax.random.normal(jax.random.key(1), (1, 5, 2, 32))
    bias = alibi_position_bias(2, jnp.arange(5), jnp.arange(5))
    np.testing.assert_allclose(attention._attend_with_dropout(q, k, v, None, bias, True),
                               jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True), atol=1e-5)
    assert logits.shape == (1, 200, 512)
    # The attention module adds the bias: its output is proj(attention(q, k, v) + bias).
    h = jax.random.normal(jax.random.key(2), (1, 5, 64))
    q, k, v = (t.reshape(1, 5, 2, 32) for t in jnp.split(attention.qkv(h), 3, axis=-1))
    expected = attention.proj(jax.nn.dot_product_attention(q, k, v, bias=bias, is_causal=True).reshape(1, 5, 64))
    np.testing.assert_allclose(attention(h, jnp.arange(5), deterministic=True)[0], expected, atol=1e-5)
    prompt = tokens((1, 4), seed=2)
    np.testing.assert_array_equal(generate(model, prompt, 6), generate_without_cache(model, prompt, 6))


def test_gated_linear_units_turn_gpt2s_mlp_into_a_gated_block():
    from composerjax.algorithms.gated_linear_units import GLUFeedForward, apply_gated_linear_units
    from composerjax.models.gpt2 import gelu_tanh

    model = GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
    up_kernel = np.asarray(model.blocks[0].mlp.up.kernel[...])
    assert apply_gated_linear_units(model) == 2
    mlp = model.blocks[0].mlp
    assert isinstance(mlp, GLUFeedForward) and mlp.act_fn is gelu_tanh
    np.testing.assert_array_equal(np.asarray(mlp.up.kernel[...]), up_kernel)
    x = jax.random.normal(jax.random.key(0), (2, 3, 64))
    expected = mlp.down(gelu_tanh(x @ mlp.gate.kernel[...]) * (x @ mlp.up.kernel[...]))
    np.testing.assert_allclose(mlp(x), expected, atol=1e-6)
