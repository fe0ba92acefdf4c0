"""Llama: published sizes, Llama 3 rope scaling, GQA, sliding windows, packed documents, KV-cache generation."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from composerjax import registry
from composerjax.models import ComposerCausalLM
from composerjax.models.generation import generate, generate_without_cache
from composerjax.models.llama import (
    Llama,
    Llama3RopeScaling,
    LlamaConfig,
    llama_flops_per_token,
    llama_parameter_count,
    rope_frequencies,
)

TINY = LlamaConfig.preset("llama-tiny", vocab_size=100, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


def size_of(state: nnx.State) -> int:
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(state))


def tokens(shape: tuple[int, int], seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), shape, 0, 100, jnp.int32)


def test_presets_have_the_published_parameter_counts_without_allocating_them():
    assert llama_parameter_count("smollm-135m", padded=False) == 134_515_008  # HuggingFaceTB/SmolLM-135M
    assert llama_parameter_count("tinyllama-1.1b", padded=False) == 1_100_048_384  # TinyLlama-1.1B
    smollm = LlamaConfig.preset("smollm-135m")
    assert (smollm.hidden_size, smollm.num_hidden_layers, smollm.num_attention_heads, smollm.num_key_value_heads,
            smollm.tie_word_embeddings) == (576, 30, 9, 3, True)
    abstract = nnx.eval_shape(lambda: Llama("tinyllama-1.1b", rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == 1_100_048_384  # 32000 is already a multiple of 64


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": False}, {"attention_bias": True},
                                       {"head_dim": 8, "num_key_value_heads": 1}, {"scan_layers": True}])
def test_parameter_count_closed_form_matches_the_model(overrides):
    config = dataclasses.replace(TINY, **overrides)
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    assert size_of(nnx.state(abstract, nnx.Param)) == llama_parameter_count(config)
    assert llama_parameter_count(config) - llama_parameter_count(config, padded=False) == (
        28 * 64 * (1 if config.tie_word_embeddings else 2))  # 100 -> 128 rows


def test_flops_per_token_is_palms_6n_plus_attention():
    from composerjax.models import llama as llama_module

    assert llama_module.parameter_count is llama_parameter_count  # GPT-2's names work for Llama too
    assert llama_module.flops_per_token is llama_flops_per_token
    n = 134_515_008  # tied: the embedding counts once, as the head
    assert llama_flops_per_token("smollm-135m", 2048) == 6 * n + 12 * 30 * 576 * 2048
    untied = LlamaConfig.preset("tinyllama-1.1b")
    assert llama_flops_per_token(untied, 100) == 6 * (1_100_048_384 - 32000 * 2048) + 12 * 22 * 2048 * 100
    with pytest.raises(ValueError, match="seq_len=0"):
        llama_flops_per_token("llama-tiny", 0)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"hidden_size": 66}, "hidden_size=66"),
    ({"num_key_value_heads": 3}, "num_key_value_heads=3"),
    ({"num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"sliding_window": 0}, "sliding_window=0"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "missing key"),
    ({"attention": "flash"}, "attention='flash'"),
    ({"remat": "some"}, "remat='some'"),
    ({"head_dim": 7}, "head_dim=7"),
])
def test_bad_config_fields_are_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(TINY, **overrides)
    with pytest.raises(ValueError, match="preset\\(name='llama-7b'\\).*'llama-tiny'"):
        LlamaConfig.preset("llama-7b")


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_rope_frequencies_are_transformers_inv_freq(scaling):
    import torch  # noqa: F401  transformers' rope functions compute in torch
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = HFLlamaConfig(hidden_size=64, num_attention_heads=2, rope_theta=500.0, max_position_embeddings=64,
                       rope_scaling=scaling)
    config = dataclasses.replace(TINY, num_attention_heads=2, num_key_value_heads=1, rope_theta=500.0,
                                 rope_scaling=scaling)
    ours = rope_frequencies(config)
    if scaling is None:
        theirs = 1.0 / (500.0 ** (np.arange(0, 32, 2, dtype=np.float32) / 32))
    else:
        assert config.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 16)
        theirs = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].numpy()
        plain = rope_frequencies(dataclasses.replace(config, rope_scaling=None))
        assert not np.allclose(ours, plain)  # the scaling moved the low frequencies
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


@pytest.mark.parametrize("overrides", [{}, {"sliding_window": 3}, {"scan_layers": True},
                                       {"attention_bias": True, "tie_word_embeddings": False}])
def test_kv_cache_generation_equals_recomputing_everything(overrides):
    model = Llama(dataclasses.replace(TINY, **overrides), rngs=nnx.Rngs(1))
    prompt = tokens((2, 5))
    cached = generate(model, prompt, 9)
    assert cached.shape == (2, 14)
    np.testing.assert_array_equal(cached, generate_without_cache(model, prompt, 9))
    sampled = generate(model, prompt, 9, temperature=1.0, top_k=20, rng=3)
    np.testing.assert_array_equal(sampled, generate_without_cache(model, prompt, 9, temperature=1.0, top_k=20, rng=3))


@pytest.mark.parametrize("window", [None, 3])
def test_decoding_in_chunks_gives_the_full_forward_logits(window):
    model = Llama(dataclasses.replace(TINY, sliding_window=window), rngs=nnx.Rngs(2))
    sequence = tokens((2, 12), seed=1)
    full = model(sequence)
    cache = model.init_cache(2, 16)
    first, cache = model.decode(sequence[:, :7], 0, cache)
    second, _ = model.decode(sequence[:, 7:], 7, cache)
    np.testing.assert_allclose(np.concatenate([first, second], axis=1), full, atol=1e-5)


def test_a_sliding_window_hides_keys_older_than_the_window():
    model = Llama(TINY, rngs=nnx.Rngs(2))
    windowed = Llama(dataclasses.replace(TINY, sliding_window=4), rngs=nnx.Rngs(2))  # same weights
    sequence = tokens((1, 10), seed=2)
    plain, narrow = model(sequence), windowed(sequence)
    np.testing.assert_allclose(narrow[:, :4], plain[:, :4], atol=1e-6)  # nothing older than 4 yet
    assert np.abs(narrow[:, 4:] - plain[:, 4:]).max() > 1e-3
    # Each of the 2 layers looks back 3 positions, so position 9 reads tokens 3..9 only: replacing
    # tokens 0..2 leaves its logits as they were, replacing token 3 does not.
    changed = sequence.at[:, :3].set((sequence[:, :3] + 1) % 100)
    np.testing.assert_allclose(windowed(changed)[:, 9], narrow[:, 9], atol=1e-6)
    changed = sequence.at[:, 3].set((sequence[:, 3] + 1) % 100)
    assert np.abs(windowed(changed)[:, 9] - narrow[:, 9]).max() > 1e-4


def test_packed_documents_equal_each_document_run_alone():
    model = Llama(TINY, rngs=nnx.Rngs(3))
    first, second = tokens((1, 5), seed=4), tokens((1, 7), seed=5)
    packed = jnp.concatenate([first, second], axis=1)
    segment_ids = jnp.asarray([[1] * 5 + [2] * 7])
    logits = model(packed, segment_ids=segment_ids)
    np.testing.assert_allclose(logits[:, :5], model(first), atol=1e-5)
    np.testing.assert_allclose(logits[:, 5:], model(second), atol=1e-5)
    assert np.abs(model(packed)[:, 5:] - model(second)).max() > 1e-3  # without the ids the second one sees the first


@pytest.mark.parametrize("remat", ["dots", "full"])
def test_remat_keeps_the_logits_and_gradients(remat):
    plain = Llama(TINY, rngs=nnx.Rngs(4))
    recomputed = Llama(dataclasses.replace(TINY, remat=remat), rngs=nnx.Rngs(4))
    sequence = tokens((2, 8), seed=6)

    def loss(model: Llama) -> jax.Array:
        return jnp.mean(model(sequence) ** 2)

    grads = nnx.grad(loss)(plain)
    grads_recomputed = nnx.grad(loss)(recomputed)
    np.testing.assert_allclose(recomputed(sequence), plain(sequence), atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_recomputed)):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_the_padded_vocabulary_never_reaches_the_logits():
    model = Llama(dataclasses.replace(TINY, tie_word_embeddings=False), rngs=nnx.Rngs(5))
    assert model.tokens.embedding.shape == (128, 64) and model.head.kernel.shape == (64, 128)
    np.testing.assert_array_equal(model.tokens.embedding[100:], 0)
    np.testing.assert_array_equal(model.head.kernel[:, 100:], 0)
    assert model(tokens((1, 4))).shape == (1, 4, 100)


def test_partition_metadata_uses_the_mesh_axes_gpt2_uses():
    from jax.sharding import PartitionSpec as P

    from composerjax.parallel import partition_metadata

    specs = partition_metadata(Llama(TINY, rngs=nnx.Rngs(0)))
    assert specs["blocks/0/attention/q_proj/kernel"] == P(None, "tensor")
    assert specs["blocks/0/attention/o_proj/kernel"] == P("tensor", None)
    assert specs["blocks/1/mlp/gate_proj/kernel"] == P(None, "tensor")
    assert specs["blocks/1/mlp/down_proj/kernel"] == P("tensor", None)
    scanned = partition_metadata(Llama(dataclasses.replace(TINY, scan_layers=True), rngs=nnx.Rngs(0)))
    assert scanned["blocks/mlp/up_proj/kernel"] == P(None, None, "tensor")  # the layer axis stays whole


def test_the_llama_factory_is_registered_and_builds_a_causal_lm():
    factory = registry.models.get("llama")
    model = factory("llama-tiny", vocab_size=300, max_position_embeddings=16, num_hidden_layers=1)
    assert isinstance(model, ComposerCausalLM) and isinstance(model.module, Llama)
    batch = (np.zeros((2, 16), np.int32), np.ones((2, 16), np.int32))
    loss = float(model.loss(model.forward(batch), batch))
    assert np.isfinite(loss) and loss == pytest.approx(np.log(300), rel=0.05)  # near uniform at init


def test_composerjax_generate_continues_a_prompt_with_a_trained_llama(tmp_path, monkeypatch, capsys):
    from composerjax.cli import main
    from composerjax.cli_generate import load_model_weights
    from composerjax.data.tokenizer import decode, load_tokenizer
    from composerjax.models.factories import llama

    model = {"name": "llama", "config": "llama-tiny", "vocab_size": 300, "max_position_embeddings": 64,
             "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
    recipe = {"run_name": "lm", "model": model,
              "data": {"name": "stdlib_lm", "seq_len": 32, "batch_size": 4, "vocab_size": 300, "max_files": 6,
                       "validation_fraction": 0.0},
              "optimizer": {"name": "adam", "lr": 0.01}, "max_duration": "3ba",
              "save_folder": "runs/{run_name}/checkpoints", "progress_bar": False, "run_summary": False}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["train", "recipe.yaml"]) == 0
    capsys.readouterr()
    assert main(["generate", "runs/lm", "--prompt", "return ", "--max-new-tokens", "10"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")

    fresh = llama(**{key: value for key, value in model.items() if key != "name"})
    trained, _ = load_model_weights(fresh, "runs/lm/checkpoints")
    tokenizer = load_tokenizer("runs/lm/tokenizer.json")
    prompt = jnp.asarray([tokenizer.encode("return ").ids], jnp.int32)
    assert text == decode(tokenizer, generate(trained.module, prompt, 10)[0].tolist())
    assert text.startswith("return ") and len(text) > len("return ")
