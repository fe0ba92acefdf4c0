"""GPT-2: the published parameter count, causality, tied head, rotary, dropout modes, KV-cache generation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composerjax.models import generation
from composerjax.models.attention import explicit_attention
from composerjax.models.generation import generate, generate_without_cache, sample_logits
from composerjax.models.gpt2 import (
    GPT2,
    GPT2Config,
    alibi_position_bias,
    apply_rotary,
    flops_per_token,
    parameter_count,
)
from composerjax.models.lm_loss import cross_entropy_loss


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
    assert parameter_count("gpt2-small", padded=False) == 124_439_808  # Hugging Face's GPT2LMHeadModel('gpt2')
    unpadded = GPT2Config.preset("gpt2-small", pad_vocab_to_multiple=1)
    abstract = nnx.eval_shape(lambda: GPT2(unpadded, rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == 124_439_808 == parameter_count(unpadded)
    # By default the vocabulary is padded to a multiple of 64 (50,257 -> 50,304 rows): 47 x 768 more.
    abstract = nnx.eval_shape(lambda: GPT2("gpt2-small", rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == parameter_count("gpt2-small") == 124_439_808 + 47 * 768
    assert parameter_count("gpt2-medium", padded=False) == 354_823_168
    assert parameter_count("gpt2-medium") == 354_823_168 + 47 * 1024


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
    ({"attention": "flash"}, r"GPT2Config\(attention='flash'\): expected one of 'auto', 'xla', 'cudnn'"),
    ({"remat": "some"}, r"GPT2Config\(remat='some'\): expected one of 'none', 'dots', 'full'"),
    ({"scan_layers": "yes"}, r"GPT2Config\(scan_layers='yes'\): expected True or False"),
    ({"pad_vocab_to_multiple": 0}, r"GPT2Config\(pad_vocab_to_multiple=0\): expected a positive integer"),
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
    q, k, v = jax.random.normal(jax.random.key(2), (3, 2, 6, 2, 32))
    explicit = jax.jit(lambda q, k, v: explicit_attention(q, k, v, causal=True))
    fused = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    np.testing.assert_allclose(explicit(q, k, v), fused(q, k, v), atol=1e-5)


def test_cached_decode_step_matches_the_full_forward(model):
    x = tokens((2, 9), seed=3)
    decode = nnx.jit(lambda model, x, start, cache: model.decode(x, start, cache))
    cache = model.init_cache(2, 16)
    prefill, cache = decode(model, x[:, :8], 0, cache)
    full = forward(model, x)
    np.testing.assert_allclose(prefill, full[:, :8], atol=1e-5)
    step, _ = decode(model, x[:, 8:9], 8, cache)
    np.testing.assert_allclose(step[:, 0], full[:, 8], atol=1e-5)


class RecordingGPT2(GPT2):
    """A GPT2 whose ``decode`` reports ``(position of its last token, that token's logits)`` to ``decoded``."""

    decoded: list[tuple[int, np.ndarray]] = []

    def decode(self, tokens, start, cache, *, deterministic=True):
        logits, cache = super().decode(tokens, start, cache, deterministic=deterministic)

        def record(last_position, last_logits):
            RecordingGPT2.decoded.append((int(last_position), np.asarray(last_logits)))

        jax.debug.callback(record, start + tokens.shape[1] - 1, logits[:, -1], ordered=True)
        return logits, cache


def context_dependent(position: str) -> RecordingGPT2:
    """A 1-layer tiny GPT-2 whose weight matrices are tripled.

    At the initial scale the argmax mostly repeats the last token whatever came before it, so a
    cache read at the wrong position still picks the same tokens; tripled, the next token depends
    on the context and on the positions.
    """
    model = RecordingGPT2(GPT2Config.preset("gpt2-tiny", position=position, n_layer=1), rngs=nnx.Rngs(0))
    model.eval()
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    return nnx.merge(graphdef, jax.tree.map(lambda p: p * 3.0 if p.ndim >= 2 else p, params), rest)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_greedy_generation_with_cache_equals_without(position):
    model = context_dependent(position)
    prompt, new = tokens((4, 5), seed=4), 24
    RecordingGPT2.decoded.clear()
    cached = generate(model, prompt, new)
    jax.effects_barrier()
    assert cached.shape == (4, 5 + new)
    np.testing.assert_array_equal(cached[:, :5], prompt)
    # Each decode step's logits are the full forward pass's at the same position, to float32 rounding:
    # the prompt's last position (4), then one step per new token but the last (5 .. 27).
    full = np.asarray(forward(model, cached))
    assert [at for at, _ in RecordingGPT2.decoded] == list(range(4, 4 + new))
    for at, logits in RecordingGPT2.decoded:
        np.testing.assert_allclose(logits, full[:, at], atol=2e-5, rtol=0)
    # Every new token is the argmax of the logits before it, and those depend on the context: the
    # 96 new tokens are not a few tokens repeated.
    np.testing.assert_array_equal(cached[:, 5:], np.argmax(full[:, 4:-1], axis=-1))
    assert len(np.unique(np.asarray(cached[:, 5:]))) >= 10
    np.testing.assert_array_equal(cached, generate_without_cache(model, prompt, new))


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
    np.testing.assert_allclose(explicit_attention(q, k, v, causal=True, bias=bias),
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


# -- the lean LM step: remat, scanned layers, the padded vocabulary, packed sequences -------------
LEAN = {"vocab_size": 300, "n_positions": 64, "n_embd": 64, "n_layer": 4, "n_head": 2}


def next_token_loss(model: GPT2, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    inputs, targets = batch
    return cross_entropy_loss(model.features(inputs), model.head_weight(), targets, vocab_size=model.config.vocab_size)


def stacked(unrolled: nnx.State, scanned: nnx.State, layers: int) -> nnx.State:
    """``scanned``'s structure holding ``unrolled``'s values: ``blocks/<i>/<name>`` stacked into ``blocks/<name>``."""
    flat = dict(nnx.to_flat_state(unrolled))
    values = {path: jnp.stack([flat[("blocks", i, *path[1:])][...] for i in range(layers)]) if path[0] == "blocks"
              else flat[path][...] for path, _ in nnx.to_flat_state(scanned)}
    return nnx.from_flat_state([(path, variable.replace(values[path]))
                                for path, variable in nnx.to_flat_state(scanned)])


@pytest.fixture(scope="module")
def variants() -> dict:
    """``{name: (loss, grads, compiled)}`` of a batch for the plain, remat and scanned 4-layer models, same weights."""
    sequences = tokens((8, 65), seed=9) % 300
    batch = (sequences[:, :-1], sequences[:, 1:])
    plain = nnx.state(GPT2(GPT2Config.preset("gpt2-tiny", **LEAN), rngs=nnx.Rngs(0)), nnx.Param)
    step = jax.jit(jax.value_and_grad(lambda params, graphdef, rest, batch: next_token_loss(
        nnx.merge(graphdef, params, rest), batch)), static_argnums=1)
    results = {}
    for name, overrides in {"none": {}, "dots": {"remat": "dots"}, "full": {"remat": "full"},
                            "scan": {"scan_layers": True}, "scan+full": {"scan_layers": True, "remat": "full"}}.items():
        model = GPT2(GPT2Config.preset("gpt2-tiny", **LEAN, **overrides), rngs=nnx.Rngs(0))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        params = stacked(plain, params, 4) if "scan" in name else plain
        compiled = step.lower(params, graphdef, rest, batch).compile()
        loss, grads = compiled(params, rest, batch)
        results[name] = (loss, grads, compiled)
    return results


@pytest.mark.parametrize("name", ["dots", "full", "scan", "scan+full"])
def test_remat_and_scan_give_the_plain_models_loss_and_gradients(variants, name):
    loss, grads, _ = variants["none"]
    got_loss, got_grads, _ = variants[name]
    np.testing.assert_allclose(got_loss, loss, rtol=1e-6)
    if "scan" in name:
        grads = stacked(grads, got_grads, 4)
    for (path, got), (_, expected) in zip(nnx.to_flat_state(got_grads), nnx.to_flat_state(grads), strict=True):
        np.testing.assert_allclose(got[...], expected[...], rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_remat_full_keeps_less_for_the_backward_pass(variants):
    temp = {name: variants[name][2].memory_analysis().temp_size_in_bytes
            for name in ("none", "dots", "full", "scan", "scan+full")}
    assert temp["full"] < temp["dots"] < 0.5 * temp["none"]
    assert temp["scan+full"] < 0.5 * temp["scan"]


def amp_adamw_step_peak(config: GPT2Config, batch: int, length: int) -> int:
    """Peak bytes (argument + output + temp - aliased) of a donated amp_bf16 AdamW train step, compiled from shapes.

    What ``benchmarks/lm.py --lean`` measures for gpt2-small: float32 weights and AdamW moments,
    the weights cast to bfloat16 inside the step, the chunked loss.
    """
    import optax

    graphdef, params, rest = nnx.split(nnx.eval_shape(lambda: GPT2(config, rngs=nnx.Rngs(0))), nnx.Param, ...)
    params, rest = nnx.to_pure_dict(params), nnx.to_pure_dict(rest)
    optimizer = optax.adamw(1e-3)

    def step(params, opt_state, rest, batch):
        def loss(params):
            bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
            return next_token_loss(nnx.merge(graphdef, nnx.State(bf16), nnx.State(rest)), batch)

        updates, opt_state = optimizer.update(jax.grad(loss)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    shape = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)  # noqa: E731
    tokens_shape = jax.ShapeDtypeStruct((batch, length), jnp.int32)
    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
        shape(params), shape(jax.eval_shape(optimizer.init, params)), shape(rest), (tokens_shape, tokens_shape)
    ).compile()
    memory = compiled.memory_analysis()
    return (memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes
            + memory.temp_size_in_bytes)


def test_remat_full_peak_memory_is_at_most_a_third_of_the_default():
    # gpt2-small's proportions where they set the ratio (head size 64, n_head / n_embd = 1/64, 1024
    # tokens, so attention goes in query blocks), small enough to compile in seconds. gpt2-small
    # itself at 8 x 1024: benchmarks/lm.py --lean (RESULTS.md).
    config = GPT2Config.preset("gpt2-tiny", vocab_size=512, n_positions=1024, n_embd=128, n_layer=6, n_head=2)
    default = amp_adamw_step_peak(config, 2, 1024)
    full = amp_adamw_step_peak(dataclasses.replace(config, remat="full"), 2, 1024)
    assert full <= default / 3, (full / 2**20, default / 2**20)


def test_scanned_layers_compile_one_block_in_a_loop(variants):
    def ops(compiled) -> int:
        return sum(" = " in line for line in compiled.as_text().splitlines())

    unrolled, scanned = variants["none"][2].as_text(), variants["scan"][2].as_text()
    assert " while(" in scanned and " while(" not in unrolled
    assert ops(variants["scan"][2]) < 0.6 * ops(variants["none"][2])


def test_scanned_layers_keep_the_partition_metadata_with_a_leading_layer_axis():
    from jax.sharding import PartitionSpec as P

    from composerjax.parallel import ParallelismConfig, partition_metadata

    model = nnx.eval_shape(lambda: GPT2(GPT2Config.preset("gpt2-tiny", scan_layers=True, n_layer=4), rngs=nnx.Rngs(0)))
    metadata = partition_metadata(model)
    assert metadata["blocks/attention/qkv/kernel"] == P(None, None, "tensor")
    assert metadata["blocks/mlp/down/kernel"] == P(None, "tensor", None)
    # FSDP then shards a dimension the metadata leaves free, never the layer axis the scan walks.
    spec = ParallelismConfig(fsdp=2, tensor=2).spec_for("blocks/attention/qkv/kernel", (4, 64, 192),
                                                        {"data": 1, "fsdp": 2, "tensor": 2},
                                                        metadata["blocks/attention/qkv/kernel"])
    assert spec == P(None, "fsdp", "tensor")


def test_a_scanned_model_decodes_and_generates_as_the_unrolled_one():
    unrolled = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2, position="rotary"), rngs=nnx.Rngs(0))
    scanned = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2, position="rotary", scan_layers=True), rngs=nnx.Rngs(0))
    nnx.update(scanned, stacked(nnx.state(unrolled), nnx.state(scanned), 2))
    prompt = tokens((2, 5), seed=6)
    np.testing.assert_allclose(forward(scanned, prompt), forward(unrolled, prompt), atol=1e-5)
    np.testing.assert_array_equal(generate(scanned, prompt, 6), generate(unrolled, prompt, 6))


@pytest.mark.parametrize("layers", [{"scan_layers": True}, {"remat": "full"}, {"scan_layers": True, "remat": "dots"}])
def test_dropout_in_scanned_or_recomputed_layers_draws_per_call_and_is_off_in_eval(layers):
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2, dropout=0.1, attention_dropout=0.1, **layers),
                 rngs=nnx.Rngs(0))
    call = nnx.jit(lambda model, x: model(x))
    x = tokens((2, 8))
    assert float(jnp.abs(call(model, x) - call(model, x)).max()) > 0
    model.eval()
    np.testing.assert_array_equal(call(model, x), call(model, x))


def padded_and_unpadded() -> tuple[GPT2, GPT2]:
    """The same GPT-2 with its 300 tokens padded to 320 rows (padding rows set large) and unpadded."""
    config = GPT2Config.preset("gpt2-tiny", vocab_size=300, n_layer=1)
    padded = GPT2(config, rngs=nnx.Rngs(0))
    unpadded = GPT2(dataclasses.replace(config, pad_vocab_to_multiple=1), rngs=nnx.Rngs(0))
    embedding = padded.tokens.embedding[...]
    assert embedding.shape == (320, 64) and unpadded.tokens.embedding[...].shape == (300, 64)
    assert float(jnp.abs(embedding[300:]).max()) == 0.0  # the padding rows start at zero
    np.testing.assert_array_equal(embedding[:300], unpadded.tokens.embedding[...])  # the same real weights
    # Rows that would win every argmax and dominate every softmax, were they not masked out.
    padded.tokens.embedding[...] = embedding.at[300:].set(10.0)
    return padded, unpadded


def test_padded_vocabulary_rows_never_count_in_the_loss_or_win_in_generation():
    padded, unpadded = padded_and_unpadded()
    batch = (tokens((2, 12), seed=7) % 300, tokens((2, 12), seed=8) % 300)
    np.testing.assert_allclose(next_token_loss(padded, batch), next_token_loss(unpadded, batch), rtol=1e-6)
    logits = forward(padded, batch[0])
    assert logits.shape == (2, 12, 300)
    np.testing.assert_allclose(logits, forward(unpadded, batch[0]), atol=1e-5)
    prompt = batch[0][:, :4]
    greedy = generate(padded, prompt, 8)
    np.testing.assert_array_equal(greedy, generate(unpadded, prompt, 8))
    sampled = generate(padded, prompt, 8, temperature=2.0, rng=0)
    assert int(sampled.max()) < 300
    np.testing.assert_array_equal(sampled, generate(unpadded, prompt, 8, temperature=2.0, rng=0))
    # FLOPs and MFU count the real vocabulary, padded or not.
    assert flops_per_token(padded.config, 64) == flops_per_token(unpadded.config, 64)


def test_packed_documents_do_not_attend_across_their_segments():
    model = GPT2(GPT2Config.preset("gpt2-tiny", n_layer=2), rngs=nnx.Rngs(0))
    model.eval()
    call = nnx.jit(lambda model, x, segments: model(x, segment_ids=segments))
    x = tokens((1, 10), seed=3)
    segments = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    other_first_document = x.at[:, :4].set((x[:, :4] + 7) % 512)
    packed, changed = call(model, x, segments), call(model, other_first_document, segments)
    np.testing.assert_allclose(packed[:, 4:], changed[:, 4:], atol=1e-6)  # the second document never sees the first
    assert float(jnp.abs(forward(model, x)[:, 4:] - forward(model, other_first_document)[:, 4:]).max()) > 1e-3


@pytest.mark.parametrize("surgeries", [("alibi",), ("alibi", "glu")])
def test_alibi_and_glu_surgery_on_scanned_layers_give_the_unrolled_models_loss_and_gradients(surgeries):
    from composerjax.algorithms.alibi import apply_alibi
    from composerjax.algorithms.gated_linear_units import apply_gated_linear_units

    config = GPT2Config.preset("gpt2-tiny", **{**LEAN, "n_layer": 3})
    unrolled = GPT2(config, rngs=nnx.Rngs(0))
    scanned = GPT2(dataclasses.replace(config, scan_layers=True), rngs=nnx.Rngs(0))
    for model in (unrolled, scanned):
        assert apply_alibi(model, max_sequence_length=128) == 4  # 3 attentions and the position table
        assert model.config.position == "alibi" and model.config.n_positions == 128 and not hasattr(model, "position")
    assert scanned.blocks.attention.config.position == "alibi"  # the stacked block's one attention
    if "glu" in surgeries:
        assert apply_gated_linear_units(unrolled) == 3 and apply_gated_linear_units(scanned) == 1  # one stacked MLP
        gate = scanned.blocks.mlp.gate.kernel
        assert gate[...].shape == (3, 64, 256) and not np.allclose(gate[...][0], gate[...][1])  # a gate per layer
        assert gate.get_metadata()["out_sharding"] == (None, None, "tensor")  # never split along the layer axis
        assert unrolled.blocks[0].mlp.gate.kernel.get_metadata()["out_sharding"] == (None, "tensor")
    nnx.update(scanned, stacked(nnx.state(unrolled), nnx.state(scanned), 3))
    sequences = tokens((4, 41), seed=5) % 300
    batch = (sequences[:, :-1], sequences[:, 1:])

    def loss_and_grads(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        return jax.jit(jax.value_and_grad(lambda params: next_token_loss(nnx.merge(graphdef, params, rest), batch)))(
            params)

    (loss, grads), (scanned_loss, scanned_grads) = loss_and_grads(unrolled), loss_and_grads(scanned)
    np.testing.assert_allclose(scanned_loss, loss, rtol=1e-6)
    grads = stacked(grads, scanned_grads, 3)
    for (path, got), (_, expected) in zip(nnx.to_flat_state(scanned_grads), nnx.to_flat_state(grads), strict=True):
        np.testing.assert_allclose(got[...], expected[...], rtol=1e-5, atol=1e-7, err_msg=str(path))


SHARDED_SCRIPT = """
import json
import numpy as np, optax
from composerjax import ArrayLoader, Trainer
from composerjax.models.factories import gpt2
from composerjax.parallel import ParallelismConfig

tokens = np.random.default_rng(0).integers(0, 256, size=(16, 17)).astype(np.int32)
report = {}
for name, parallelism, devices in (("one", "ddp", 1), ("fsdp2_tensor2", ParallelismConfig(fsdp=2, tensor=2), "auto")):
    model = gpt2("gpt2-tiny", vocab_size=256, n_positions=16, n_embd=32, n_layer=2, scan_layers=True, remat="full")
    trainer = Trainer(model, ArrayLoader((tokens[:, :-1], tokens[:, 1:]), 8, seed=0), "2ba", optax.sgd(0.3),
                      parallelism=parallelism, devices=devices, progress_bar=False, run_summary=False)
    trainer.fit()
    params = trainer.state.train_state.params
    kernel = params["module"]["blocks"]["attention"]["qkv"]["kernel"]
    report[name] = {"loss": float(trainer.state.loss), "qkv": str(kernel.sharding.spec),
                    "values": np.asarray(kernel).ravel()[:64].tolist()}
print(json.dumps(report))
"""


def test_scanned_layers_train_sharded_over_fsdp_and_tensor_devices():
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", SHARDED_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    one, sharded = report["one"], report["fsdp2_tensor2"]
    # The layer axis stays whole (the scan walks it); tensor and fsdp split the kernel's own dimensions.
    assert sharded["qkv"] == "P(None, 'fsdp', 'tensor')"
    assert sharded["loss"] == pytest.approx(one["loss"], rel=1e-5)
    np.testing.assert_allclose(sharded["values"], one["values"], rtol=1e-5, atol=1e-6)
