"""Llama: RMSNorm, rotary positions (with Llama 3's scaling), grouped-query attention, SwiGLU; Mistral and Qwen2 too.

One module covers the Llama-class decoders Hugging Face ships as ``LlamaForCausalLM`` (Llama 2
and 3, TinyLlama, SmolLM), ``MistralForCausalLM`` (a sliding attention window) and
``Qwen2ForCausalLM`` (biases on the query, key and value projections). It presents the interface
:class:`~composerjax.models.GPT2` does (``features``, ``head_weight``, ``logits``, ``decode``,
``init_cache``), so :class:`~composerjax.models.ComposerCausalLM`,
:func:`~composerjax.models.generate` and ``composerjax generate`` take it as they take GPT-2.
Submodules carry Hugging Face's names inside a block (``blocks/0/attention/q_proj``,
``blocks/0/mlp/gate_proj``); the projections have GPT-2's partition metadata (the first matmul of
attention and of the MLP split by columns over the 'tensor' mesh axis, the second by rows).
Attention goes through :func:`composerjax.models.attention.attention`, which picks the kernel.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax.models.attention import attention, positions_from_segments
from composerjax.models.llama_config import (
    LLAMA_CONFIGS,
    Llama3RopeScaling,
    LlamaConfig,
    _resolve,
    llama_flops_per_token,
    llama_parameter_count,
    rope_frequencies,
)
from composerjax.models.remat import padded_initializer, with_remat

__all__ = [
    "LLAMA_CONFIGS",
    "Llama",
    "Llama3RopeScaling",
    "LlamaConfig",
    "apply_rope",
    "flops_per_token",
    "llama_flops_per_token",
    "llama_parameter_count",
    "parameter_count",
    "rope_frequencies",
]

#: GPT-2's names for the counts (``composerjax.models.flops_per_token`` is GPT-2's; these are Llama's).
flops_per_token = llama_flops_per_token
parameter_count = llama_parameter_count

_INIT_STD = 0.02  # Hugging Face's initializer_range for these models

#: One ``(keys, values)`` pair per block, each ``(batch, length, num_key_value_heads, head_dim)``.
KVCache = tuple[tuple[jax.Array, jax.Array], ...]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: Any) -> jax.Array:
    """Rotate ``(B, T, N, H)`` queries or keys by ``(T,)`` or ``(B, T)`` positions (half-pairs, as HF's Llama).

    Example:
        >>> apply_rope(jnp.ones((1, 3, 2, 4)), jnp.arange(3), jnp.array([1.0, 0.01])).shape
        (1, 3, 2, 4)
    """
    half = x.shape[-1] // 2
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _partitioned(initializer: Any, axes: tuple[str | None, ...]) -> Any:
    # Metadata only, as GPT-2's: the Trainer (or load_pretrained) places the parameters on a mesh.
    return nnx.with_partitioning(initializer, axes, eager_sharding=False)


def _linear(config: LlamaConfig, fan_in: int, fan_out: int, rngs: nnx.Rngs, split: str,
            bias: bool = False) -> nnx.Linear:
    kernel_axes = (None, "tensor") if split == "columns" else ("tensor", None)
    bias_axes = ("tensor",) if split == "columns" else (None,)
    return nnx.Linear(fan_in, fan_out, use_bias=bias,
                      kernel_init=_partitioned(nnx.initializers.normal(_INIT_STD), kernel_axes),
                      bias_init=_partitioned(nnx.initializers.zeros_init(), bias_axes), dtype=config.dtype,
                      param_dtype=config.param_dtype, rngs=rngs)


class RMSNorm(nnx.Module):
    """``scale · x / sqrt(mean(x²) + eps)``, the statistics in float32 (as Hugging Face's ``LlamaRMSNorm``)."""

    def __init__(self, size: int, eps: float, *, param_dtype: Any = jnp.float32, dtype: Any = None) -> None:
        self.scale = nnx.Param(jnp.ones((size,), param_dtype))
        self.eps, self.dtype = eps, dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        scale = self.scale[...]
        if self.dtype is not None:
            scale, normed = scale.astype(self.dtype), normed.astype(self.dtype)
        return scale * normed


class LlamaAttention(nnx.Module):
    """Grouped-query causal self-attention with RoPE, an optional sliding window and a KV cache."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        self.config = config
        d, q = config.hidden_size, config.head_size
        bias = config.attention_bias
        self.q_proj = _linear(config, d, config.num_attention_heads * q, rngs, "columns", bias)
        self.k_proj = _linear(config, d, config.num_key_value_heads * q, rngs, "columns", bias)
        self.v_proj = _linear(config, d, config.num_key_value_heads * q, rngs, "columns", bias)
        self.o_proj = _linear(config, config.num_attention_heads * q, d, rngs, "rows")

    def __call__(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None, *,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        config = self.config
        batch, length, _ = x.shape
        heads, groups, size = config.num_attention_heads, config.num_key_value_heads, config.head_size
        inv_freq = rope_frequencies(config)
        q = apply_rope(self.q_proj(x).reshape(batch, length, heads, size), positions, inv_freq)
        k = apply_rope(self.k_proj(x).reshape(batch, length, groups, size), positions, inv_freq)
        v = self.v_proj(x).reshape(batch, length, groups, size)
        window = config.sliding_window
        if cache is not None:
            # This chunk's keys and values go in at their positions; the whole fixed-size cache is
            # attended to, with the entries after each query (or outside its window) masked out.
            start = positions[0]
            cache = tuple(jax.lax.dynamic_update_slice(c, t.astype(c.dtype), (0, start, 0, 0))
                          for c, t in zip(cache, (k, v)))
            k, v = (c.astype(q.dtype) for c in cache)
            offsets = positions[:, None] - jnp.arange(k.shape[1])[None, :]
            visible = offsets >= 0
            if window is not None:
                visible = visible & (offsets < window)
            mask = visible[None, None]
        elif window is not None and window < length:
            index = jnp.arange(length)
            mask = (index[:, None] - index[None, :] < window)[None, None]
        else:
            mask = None
        if groups != heads:  # each key/value head serves heads / groups query heads, in order
            k, v = jnp.repeat(k, heads // groups, axis=2), jnp.repeat(v, heads // groups, axis=2)
        out = attention(q, k, v, causal=cache is None, mask=mask, segment_ids=segment_ids,
                        implementation=config.attention)
        return self.o_proj(out.reshape(batch, length, heads * size)), cache


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) · up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        d, hidden = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(config, d, hidden, rngs, "columns")
        self.up_proj = _linear(config, d, hidden, rngs, "columns")
        self.down_proj = _linear(config, hidden, d, rngs, "rows")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nnx.Module):
    """Pre-norm block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs) -> None:
        norm = {"param_dtype": config.param_dtype, "dtype": config.dtype}
        self.norm1 = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.attention = LlamaAttention(config, rngs=rngs)
        self.norm2 = RMSNorm(config.hidden_size, config.rms_norm_eps, **norm)
        self.mlp = LlamaMLP(config, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None, *,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        h, cache = self.attention(self.norm1(x), positions, cache, segment_ids=segment_ids)
        x = x + h
        return x + self.mlp(self.norm2(x)), cache


def _stacked_blocks(config: LlamaConfig, rngs: nnx.Rngs) -> LlamaBlock:
    @nnx.split_rngs(splits=config.num_hidden_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def create(rngs: nnx.Rngs) -> LlamaBlock:
        return LlamaBlock(config, rngs=rngs)

    return create(rngs)


def _block_function(graphdef: nnx.GraphDef, remat: str, positions: jax.Array, segment_ids: jax.Array | None,
                    scanned: bool = False) -> Any:
    """``(block state, x) -> x``: one block as a pure function, under the ``remat`` policy."""

    def apply(state: nnx.State, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, state)(x, positions, segment_ids=segment_ids)[0]

    return with_remat(apply, remat, scanned)



class Llama(nnx.Module):
    """A Llama-class decoder: token embedding, pre-norm RMSNorm blocks (RoPE, GQA, SwiGLU), a final norm, the head.

    Takes ``(B, T)`` int tokens and returns ``(B, T, vocab_size)`` logits. ``segment_ids``
    ``(B, T)`` keep packed documents apart (no attention across them, positions restarting at each).
    :meth:`decode` runs a chunk against a KV cache (:meth:`init_cache`), as
    :func:`composerjax.models.generate` does.

    Example:
        >>> model = Llama(LlamaConfig.preset("llama-tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 512)
    """

    def __init__(self, config: LlamaConfig | str, *, rngs: nnx.Rngs) -> None:
        config = _resolve(config)
        self.config = config
        vocab, padded = config.vocab_size, config.padded_vocab_size
        self.tokens = nnx.Embed(padded, config.hidden_size,
                                embedding_init=padded_initializer(nnx.initializers.normal(_INIT_STD), vocab, 0),
                                dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)
        self.tokens.dtype = config.dtype  # None follows the arrays (see GPT2)
        if config.scan_layers:
            self.blocks = _stacked_blocks(config, rngs)
        else:
            self.blocks = nnx.List([LlamaBlock(config, rngs=rngs) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=config.param_dtype,
                            dtype=config.dtype)
        if not config.tie_word_embeddings:
            kernel_init = padded_initializer(nnx.initializers.normal(_INIT_STD), vocab, 1)
            self.head = nnx.Linear(config.hidden_size, padded, use_bias=False,
                                   kernel_init=_partitioned(kernel_init, (None, "tensor")),
                                   dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        """``(B, T, vocab_size)`` logits of ``(B, T)`` tokens (``deterministic`` is accepted: there is no dropout)."""
        return self.logits(self.features(tokens, segment_ids=segment_ids, deterministic=deterministic))

    def features(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        """The final hidden states ``(B, T, hidden_size)`` (after the last RMSNorm): the LM head's input.

        Example:
            >>> model = Llama(LlamaConfig.preset("llama-tiny"), rngs=nnx.Rngs(0))
            >>> model.features(jnp.zeros((2, 16), jnp.int32)).shape
            (2, 16, 64)
        """
        del deterministic
        self._check_length(tokens, 0)
        positions = jnp.arange(tokens.shape[1])
        if segment_ids is not None:
            positions = positions_from_segments(segment_ids)
        hidden, _ = self._run(tokens, positions, None, segment_ids)
        return hidden

    def head_weight(self) -> jax.Array:
        """The LM head as ``(padded_vocab_size, hidden_size)`` in the compute dtype; rows from ``vocab_size`` on pad."""
        weight = self.tokens.embedding[...] if self.config.tie_word_embeddings else self.head.kernel[...].T
        return weight if self.config.dtype is None else weight.astype(self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """``(..., vocab_size)`` logits of final hidden states: the head, without its padding rows."""
        weight = self.head_weight()
        hidden, weight = nnx.nn.dtypes.promote_dtype((hidden, weight), dtype=self.config.dtype)
        logits = jnp.einsum("...d,vd->...v", hidden, weight)
        return logits[..., : self.config.vocab_size] if weight.shape[0] > self.config.vocab_size else logits

    def decode(self, tokens: jax.Array, start: jax.Array | int, cache: KVCache, *,
               deterministic: bool | None = True) -> tuple[jax.Array, KVCache]:
        """Logits of ``(B, T)`` tokens at positions ``start ..`` ``start+T-1`` and the updated cache.

        Example:
            >>> model = Llama(LlamaConfig.preset("llama-tiny"), rngs=nnx.Rngs(0))
            >>> logits, cache = model.decode(jnp.zeros((1, 3), jnp.int32), 0, model.init_cache(1, 8))
            >>> logits.shape, cache[0][0].shape
            ((1, 3, 512), (1, 8, 2, 16))
        """
        del deterministic
        if len(cache) != self.config.num_hidden_layers:
            raise ValueError(f"cache: {len(cache)} layers, expected num_hidden_layers={self.config.num_hidden_layers}")
        positions = start + jnp.arange(tokens.shape[1])
        hidden, cache = self._run(tokens, positions, cache, None)
        return self.logits(hidden), cache

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> KVCache:
        """An empty (zero) cache for ``batch`` sequences of up to ``length`` tokens (key/value heads only)."""
        if not 1 <= length <= self.config.max_position_embeddings:
            raise ValueError(f"length={length}: expected 1 to max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        dtype = dtype or self.config.dtype or self.tokens.embedding[...].dtype
        shape = (batch, length, self.config.num_key_value_heads, self.config.head_size)
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.config.num_hidden_layers))

    def _check_length(self, tokens: jax.Array, start: int) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"tokens: shape {tokens.shape}, expected (batch, length)")
        if start + tokens.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    def _run(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None,
             segment_ids: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        x = self.tokens(tokens)
        if self.config.scan_layers:
            x, cache = self._scan_blocks(x, positions, cache, segment_ids)
        elif cache is not None:
            new_cache = []
            for block, layer_cache in zip(self.blocks, cache):
                x, layer_cache = block(x, positions, layer_cache)
                new_cache.append(layer_cache)
            cache = tuple(new_cache)
        elif self.config.remat == "none":
            for block in self.blocks:
                x, _ = block(x, positions, segment_ids=segment_ids)
        else:
            for block in self.blocks:
                graphdef, state = nnx.split(block)
                x = _block_function(graphdef, self.config.remat, positions, segment_ids)(state, x)
        return self.norm(x), cache

    def _scan_blocks(self, x: jax.Array, positions: jax.Array, cache: KVCache | None,
                     segment_ids: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        graphdef, state = nnx.split(self.blocks)
        if cache is None:
            layer = _block_function(graphdef, self.config.remat, positions, segment_ids, scanned=True)
            x, _ = jax.lax.scan(lambda x, layer_state: (layer(layer_state, x), None), x, state)
            return x, None

        def cached(x: jax.Array, xs: tuple[nnx.State, jax.Array, jax.Array]
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            layer_state, keys, values = xs
            return nnx.merge(graphdef, layer_state)(x, positions, (keys, values))

        x, (keys, values) = jax.lax.scan(cached, x, (state, jnp.stack([k for k, _ in cache]),
                                                     jnp.stack([v for _, v in cache])))
        return x, tuple((keys[index], values[index]) for index in range(self.config.num_hidden_layers))
