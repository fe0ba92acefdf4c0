"""ALiBi: closed-form slopes and bias, surgery on TinyGPT against a plain-jax forward, train short / eval long."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.alibi import (
    ALiBi,
    Alibi,
    AlibiAttention,
    NoPositionEmbedding,
    alibi_bias,
    alibi_slopes,
    apply_alibi,
    scale_sequence_length,
)
from composerjax.data.text import byte_windows, load_pydoc_bytes
from composerjax.models import TinyGPT


def tiny_gpt(max_length: int = 32) -> TinyGPT:
    return TinyGPT(dim=32, depth=1, num_heads=2, max_length=max_length, rngs=nnx.Rngs(0))


def test_slopes_are_the_papers_closed_form():
    np.testing.assert_array_equal(alibi_slopes(4), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8])
    # 6 heads: the 4 slopes of 4 heads, then every other slope of 8 heads (2^-1, 2^-3).
    np.testing.assert_array_equal(alibi_slopes(6), [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3])
    np.testing.assert_allclose(alibi_slopes(8), [2.0 ** -(h + 1) for h in range(8)], rtol=1e-7)
    assert alibi_slopes(1).tolist() == [2.0**-8]
    with pytest.raises(ValueError, match="num_heads=0"):
        alibi_slopes(0)


def test_bias_is_minus_slope_times_distance_on_and_below_the_diagonal():
    bias = np.asarray(alibi_bias(2, 5))
    expected = np.zeros((2, 5, 5), np.float32)
    for h, slope in enumerate([2.0**-4, 2.0**-8]):
        for i in range(5):
            for j in range(i + 1):
                expected[h, i, j] = -slope * (i - j)
    np.testing.assert_array_equal(bias, expected)


def layer_norm(x: jax.Array, params: dict) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-6) * params["scale"] + params["bias"]


def linear(x: jax.Array, params: dict) -> jax.Array:
    return x @ params["kernel"] + params["bias"]


def reference_alibi_gpt(params: dict, tokens: jax.Array, num_heads: int, slopes: tuple[float, ...]) -> jax.Array:
    """TinyGPT with ALiBi written with plain jax: no position embeddings, linear distance bias."""
    x = params["tokens"]["embedding"][tokens]
    batch, length, dim = x.shape
    head_dim = dim // num_heads
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    bias = -np.asarray(slopes)[:, None, None] * (i - j)[None]
    for block in params["blocks"].values():
        q, k, v = jnp.split(linear(layer_norm(x, block["norm1"]), block["attention"]["qkv"]), 3, axis=-1)
        q, k, v = (t.reshape(batch, length, num_heads, head_dim).transpose(0, 2, 1, 3) for t in (q, k, v))
        logits = q @ k.transpose(0, 1, 3, 2) / np.sqrt(head_dim) + bias
        weights = jax.nn.softmax(jnp.where(j <= i, logits, -jnp.inf), axis=-1)
        h = linear((weights @ v).transpose(0, 2, 1, 3).reshape(batch, length, dim), block["attention"]["proj"])
        mlp = block["mlp"]
        x = x + h + linear(jax.nn.gelu(linear(layer_norm(x + h, block["norm2"]), mlp["up"])), mlp["down"])
    return linear(layer_norm(x, params["norm"]), params["head"])


def test_surgery_removes_positions_and_matches_a_plain_jax_alibi_forward():
    model = tiny_gpt()
    qkv_kernel = np.asarray(model.blocks[0].attention.qkv.kernel[...])
    assert apply_alibi(model, max_sequence_length=64) == 2
    assert isinstance(model.blocks[0].attention, AlibiAttention)
    assert isinstance(model.position, NoPositionEmbedding)
    assert model.max_length == 64
    np.testing.assert_array_equal(model.blocks[0].attention.qkv.kernel[...], qkv_kernel)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert not any("position" in path for path in paths)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
    # Jitted: one compile each instead of one per eager op.
    expected = jax.jit(reference_alibi_gpt, static_argnums=(2, 3))(params, tokens, 2, (2.0**-4, 2.0**-8))
    np.testing.assert_allclose(nnx.jit(lambda m, t: m(t))(model, tokens), expected, atol=1e-4, rtol=1e-4)
    assert apply_alibi(model) == 0  # already switched


def test_trained_at_length_16_evaluates_at_length_32():
    data = load_pydoc_bytes()[:20000]
    long_x, long_y = byte_windows(data, 32)
    with pytest.raises(ValueError, match="exceeds max_length=16"):
        tiny_gpt(max_length=16)(jnp.zeros((1, 32), jnp.int32))  # learned positions: no longer sequences
    x, y = byte_windows(data, 16)
    train = ArrayLoader((x[:64], y[:64]), 16, shuffle=False)
    trainer = Trainer(ComposerClassifier(tiny_gpt(max_length=16), 256), train, "8ba", optax.adam(1e-2),
                      algorithms=[ALiBi(max_sequence_length=64)], progress_bar=False)
    assert "position" not in trainer.state.train_state.params["module"]
    before = trainer.eval(train)["CrossEntropy"]
    trainer.fit()
    assert trainer.eval(train)["CrossEntropy"] < before - 0.5
    metrics = trainer.eval(ArrayLoader((long_x[:32], long_y[:32]), 16, shuffle=False))
    assert np.isfinite(metrics["CrossEntropy"]) and metrics["CrossEntropy"] < before


def test_sequence_length_scaling_reshapes_the_batch_keeping_every_token():
    x = np.arange(24).reshape(2, 12)
    labels = np.array([7, 9])
    new_x, new_labels = scale_sequence_length((x, labels), 0.25)
    np.testing.assert_array_equal(new_x, x.reshape(8, 3))
    np.testing.assert_array_equal(new_labels, [7, 7, 7, 7, 9, 9, 9, 9])
    with pytest.raises(ValueError, match="not divisible by 5"):
        scale_sequence_length((x,), 0.2)
    with pytest.raises(ValueError, match="train_sequence_length_scaling=0.3"):
        Alibi(train_sequence_length_scaling=0.3)


def test_scaling_refuses_batches_whose_axis_1_is_not_one_sequence_axis():
    tokens = np.arange(16).reshape(2, 8)
    one_hot = np.eye(3)[[0, 2]]  # (2, 3): a per-sample array whose axis 1 is not the sequence
    with pytest.raises(ValueError, match=r"same \(N, T\).*\(2, 3\), \(2, 8\)"):
        scale_sequence_length({"input_ids": tokens, "labels": one_hot}, 0.25)
    with pytest.raises(ValueError, match="no \\(N, T, ...\\) array"):
        scale_sequence_length((np.arange(4),), 0.5)
    assert scale_sequence_length((np.arange(4),), 1.0)[0].tolist() == [0, 1, 2, 3]  # scaling 1: untouched
    # a dict batch like Composer's, with a (N, T, D) array: trailing axes are kept
    batch = {"input_ids": tokens, "attention_mask": np.ones((2, 8)), "embeddings": np.arange(48).reshape(2, 8, 3)}
    cut = scale_sequence_length(batch, 0.25)
    assert cut["input_ids"].tolist() == np.arange(16).reshape(8, 2).tolist()
    np.testing.assert_array_equal(cut["embeddings"], np.arange(48).reshape(8, 2, 3))


def test_default_scaling_is_composers_quarter_length():
    assert Alibi().train_sequence_length_scaling == 0.25 and Alibi().max_sequence_length == 8192
    x, y = byte_windows(load_pydoc_bytes()[:20000], 32)
    trainer = Trainer(ComposerClassifier(tiny_gpt(), 256), ArrayLoader((x[:8], y[:8]), 8, shuffle=False), "1ba",
                      optax.adam(1e-2), algorithms=[Alibi(max_sequence_length=32)], progress_bar=False)
    trainer.fit()
    assert trainer.state.timestamp.sample == 32  # 8 sequences of 32 -> 32 of 8


def test_training_with_half_length_sequences_sees_twice_the_samples_and_compiles_once():
    x, y = byte_windows(load_pydoc_bytes()[:20000], 32)
    trainer = Trainer(ComposerClassifier(tiny_gpt(), 256), ArrayLoader((x[:32], y[:32]), 8, shuffle=False), "3ba",
                      optax.adam(1e-2), algorithms=[Alibi(max_sequence_length=32, train_sequence_length_scaling=0.5)],
                      progress_bar=False)
    trainer.fit()
    assert trainer.state.timestamp.sample == 3 * 16  # 8 sequences of 32 -> 16 of 16 per batch
    assert trainer.compile_count == 1
    assert [t.key for t in trainer.engine.trace_log].count("Alibi/AFTER_DATALOADER") == 3


@pytest.mark.parametrize("value", [0, -4, 2.5])
def test_bad_max_sequence_length_names_the_argument(value):
    with pytest.raises(ValueError, match=f"max_sequence_length={value!r}"):
        Alibi(max_sequence_length=value)
