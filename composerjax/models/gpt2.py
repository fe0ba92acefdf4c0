"""GPT-2: the published decoder (pre-LN blocks, tied embeddings), learned or rotary positions, a KV cache.

Submodules carry TinyGPT's names (``blocks/0/attention/qkv``, ``blocks/0/mlp/up``, ...), so
:data:`composerjax.parallel.GPT_TENSOR_PARALLEL_RULES` shards it the same way; FSDP needs no rule.
With ``scan_layers=True`` the blocks are one stacked module (``blocks/attention/qkv/kernel`` of
shape ``(n_layer, ...)``, the partition metadata with a leading ``None`` for the layer axis) run by
``lax.scan``, so compile time no longer grows with depth. Attention goes through
:func:`composerjax.models.attention.attention`, which picks the kernel.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax.models.attention import IMPLEMENTATIONS, attention, positions_from_segments
from composerjax.models.gpt import FeedForward
from composerjax.models.remat import REMAT, padded_initializer, with_remat

__all__ = ["GPT2", "GPT2Config", "GPT2_CONFIGS", "KVCache", "apply_rotary", "flops_per_token", "parameter_count"]

POSITIONS = ("learned", "rotary", "alibi")
#: ``GPT2Config.remat``: what the backward pass keeps of each block (``jax.checkpoint`` policies).
_INIT_STD = 0.02  # GPT-2's initializer_range

#: One ``(keys, values)`` pair per block, each ``(batch, length, heads, head_dim)``.
KVCache = tuple[tuple[jax.Array, jax.Array], ...]


@dataclass(frozen=True)
class GPT2Config:
    """The shape of a :class:`GPT2` model.

    Args:
        vocab_size: the number of distinct tokens.
        n_positions: the longest sequence (context length) the model takes.
        n_embd: the width of the residual stream.
        n_layer: the number of decoder blocks.
        n_head: attention heads per block (must divide ``n_embd``).
        dropout: the dropout rate on the embeddings and on each residual branch (GPT-2's
            ``embd_pdrop`` and ``resid_pdrop``); active in train mode only.
        attention_dropout: the dropout rate on the attention weights (``attn_pdrop``); while it
            is active (train mode) attention runs in XLA's explicit form, which no fused kernel
            replaces.
        position: ``'learned'`` (GPT-2's absolute position table), ``'rotary'`` (RoPE on the
            queries and keys, no position parameters; needs an even head size) or ``'alibi'``
            (a per-head linear bias on the attention logits, no position parameters; what the
            ``Alibi`` algorithm switches a model to).
        tie_embeddings: the LM head is the token embedding transposed (one matrix), as in GPT-2.
        layer_norm_epsilon: LayerNorm's epsilon.
        rotary_base: the RoPE frequency base.
        dtype: the dtype the layers compute in; ``None`` follows the parameters, which is what the
            Trainer's ``precision`` relies on (``'amp_bf16'`` casts the parameters inside the step).
        param_dtype: the dtype the parameters are created in.
        attention: the attention kernel: ``'auto'`` (cuDNN's fused attention on NVIDIA GPUs where
            its constraints hold, Pallas on TPU, XLA elsewhere: see
            :func:`~composerjax.models.attention.choose_kernel`), or ``'xla'`` / ``'cudnn'`` to force one.
        remat: what the backward pass recomputes: ``'none'`` keeps every activation; ``'dots'``
            keeps each block's matmul outputs and recomputes the rest (attention scores, norms,
            activations); ``'full'`` keeps only each block's input and recomputes the block.
        scan_layers: the blocks are one stacked module run by ``lax.scan``: one compiled block
            whatever the depth (parameter paths become ``blocks/<name>`` with a leading layer axis).
        pad_vocab_to_multiple: the embedding (and an untied head) get ``padded_vocab_size`` rows,
            ``vocab_size`` rounded up to this multiple (50,257 -> 50,304 for 64), for the matrix
            units; the extra rows start at zero and their logits are masked out of the loss, the
            metrics and generation. 1 pads nothing.

    Raises:
        ValueError: naming the field, its value and what is accepted.

    Example:
        >>> config = GPT2Config.preset("gpt2-small")
        >>> config.n_layer, config.n_embd, config.padded_vocab_size, parameter_count(config, padded=False)
        (12, 768, 50304, 124439808)
    """

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.0
    attention_dropout: float = 0.0
    position: str = "learned"
    tie_embeddings: bool = True
    layer_norm_epsilon: float = 1e-5
    rotary_base: float = 10000.0
    dtype: Any = None
    param_dtype: Any = jnp.float32
    attention: str = "auto"
    remat: str = "none"
    scan_layers: bool = False
    pad_vocab_to_multiple: int = 64

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "pad_vocab_to_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPT2Config({name}={value!r}): expected a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPT2Config(n_embd={self.n_embd}): expected a multiple of n_head={self.n_head}")
        for name in ("dropout", "attention_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"GPT2Config({name}={value!r}): expected a rate in [0, 1)")
        if self.position not in POSITIONS:
            accepted = ", ".join(map(repr, POSITIONS))
            raise ValueError(f"GPT2Config(position={self.position!r}): expected one of {accepted}")
        if self.position == "rotary" and self.head_dim % 2:
            raise ValueError(f"GPT2Config(position='rotary'): the head size n_embd / n_head = {self.head_dim} must be "
                             "even")
        for name in ("layer_norm_epsilon", "rotary_base"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"GPT2Config({name}={value!r}): expected a positive number")
        for name, accepted in (("attention", IMPLEMENTATIONS), ("remat", REMAT)):
            value = getattr(self, name)
            if value not in accepted:
                raise ValueError(f"GPT2Config({name}={value!r}): expected one of {', '.join(map(repr, accepted))}")
        if not isinstance(self.scan_layers, bool):
            raise ValueError(f"GPT2Config(scan_layers={self.scan_layers!r}): expected True or False")

    @property
    def head_dim(self) -> int:
        """The size of one attention head, ``n_embd // n_head``."""
        return self.n_embd // self.n_head

    @property
    def padded_vocab_size(self) -> int:
        """Rows of the embedding and the head: ``vocab_size`` rounded up to ``pad_vocab_to_multiple``.

        Example:
            >>> GPT2Config(vocab_size=50257).padded_vocab_size
            50304
        """
        multiple = self.pad_vocab_to_multiple
        return -(-self.vocab_size // multiple) * multiple

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> GPT2Config:
        """A named configuration from :data:`GPT2_CONFIGS`, with any field replaced.

        Example:
            >>> GPT2Config.preset("gpt2-tiny", position="rotary").position
            'rotary'
        """
        if name not in GPT2_CONFIGS:
            raise ValueError(f"GPT2Config.preset(name={name!r}): expected one of {', '.join(map(repr, GPT2_CONFIGS))}")
        return dataclasses.replace(GPT2_CONFIGS[name], **overrides)


#: The published GPT-2 sizes (with GPT-2's 0.1 dropout rates) and a tiny one for tests on CPU.
GPT2_CONFIGS: dict[str, GPT2Config] = {
    "gpt2-tiny": GPT2Config(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=2),
    "gpt2-small": GPT2Config(dropout=0.1, attention_dropout=0.1),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16, dropout=0.1, attention_dropout=0.1),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20, dropout=0.1, attention_dropout=0.1),
}


def _resolve(config: GPT2Config | str) -> GPT2Config:
    if isinstance(config, str):
        return GPT2Config.preset(config)
    if not isinstance(config, GPT2Config):
        raise ValueError(f"config={config!r}: expected a GPT2Config or a preset name ({', '.join(GPT2_CONFIGS)})")
    return config


def parameter_count(config: GPT2Config | str, padded: bool = True) -> int:
    """The number of parameters of ``GPT2(config)``, in closed form.

    Token embedding ``V·D``; learned positions ``P·D``; per block ``12·D² + 13·D`` (attention
    ``4·D² + 4·D``, MLP ``8·D² + 5·D``, two LayerNorms ``4·D``); final LayerNorm ``2·D``; an untied
    head ``D·V`` (no bias). Tied embeddings count once, as Hugging Face's ``GPT2LMHeadModel`` does.

    Args:
        config: a :class:`GPT2Config` or a preset name.
        padded: ``V`` is ``padded_vocab_size``, the rows the model holds; False counts the real
            ``vocab_size``, the published figure (GPT-2 small's 124,439,808).

    Example:
        >>> parameter_count("gpt2-small"), parameter_count("gpt2-small", padded=False)
        (124475904, 124439808)
    """
    config = _resolve(config)
    d, v = config.n_embd, config.padded_vocab_size if padded else config.vocab_size
    count = v * d + config.n_layer * (12 * d * d + 13 * d) + 2 * d
    if config.position == "learned":
        count += config.n_positions * d
    if not config.tie_embeddings:
        count += d * v
    return count


def flops_per_token(config: GPT2Config | str, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward): ``6·N + 12·L·H·Q·T`` (PaLM, appendix B).

    ``N`` counts the parameters that take part in a matmul: all of them except the position table
    and, when the head is untied, the input embedding (a lookup); the tied embedding counts once,
    as the head. The vocabulary is the real one (``vocab_size``): padding rows do no useful work.
    ``12·L·H·Q·T`` is the attention score and value matmuls over a full ``T x T``
    square (``L`` blocks, ``H`` heads of size ``Q``; the causal mask is not discounted), as in PaLM
    and nanoGPT's ``estimate_mfu``.

    Example:
        >>> flops_per_token("gpt2-small", 1024)  # about 0.85 GFLOPs per token
        855166464
    """
    config = _resolve(config)
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive integer")
    matmul = parameter_count(config, padded=False)
    if config.position == "learned":
        matmul -= config.n_positions * config.n_embd
    if not config.tie_embeddings:
        matmul -= config.vocab_size * config.n_embd
    return 6 * matmul + 12 * config.n_layer * config.n_embd * seq_len


def apply_rotary(x: jax.Array, positions: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotate ``(B, T, N, H)`` queries or keys by their ``(T,)`` or ``(B, T)`` positions (RoPE, rotating half-pairs).

    The dot product of a query rotated at position ``m`` and a key rotated at ``n`` depends only
    on ``m - n``.

    Example:
        >>> x = jnp.ones((1, 3, 2, 4))
        >>> apply_rotary(x, jnp.arange(3)).shape
        (1, 3, 2, 4)
    """
    half = x.shape[-1] // 2
    frequencies = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[..., None] * frequencies  # (T, half) or (B, T, half)
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def alibi_position_bias(num_heads: int, query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """ALiBi's additive ``(1, heads, T, S)`` bias: ``-slope_h · (i - j)`` for key ``j <= `` query ``i``, else 0.

    The slopes are the paper's (``2^(-8h/n)`` for ``n`` a power of two; see
    ``composerjax.algorithms.alibi.alibi_slopes``); entries after the query are 0, the causal mask
    removes them.

    Example:
        >>> alibi_position_bias(1, jnp.arange(3), jnp.arange(3))[0, 0].tolist()
        [[0.0, 0.0, 0.0], [-0.00390625, 0.0, 0.0], [-0.0078125, -0.00390625, 0.0]]
    """
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / closest) for h in range(closest)]
    slopes += [2.0 ** (-8.0 * (h + 1) / (2 * closest)) for h in range(2 * closest)][0::2][: num_heads - closest]
    offset = jnp.minimum(key_positions[None, :] - query_positions[:, None], 0).astype(jnp.float32)
    return (jnp.asarray(slopes, jnp.float32)[:, None, None] * offset[None])[None]


def _partitioned(initializer: Any, axes: tuple[str | None, ...]) -> Any:
    # Metadata only (eager_sharding=False): the Trainer places the parameters on its mesh, and a model
    # built outside any mesh (tests, generation) stays an ordinary single-device model.
    return nnx.with_partitioning(initializer, axes, eager_sharding=False)


def _linear(config: GPT2Config, fan_in: int, fan_out: int, std: float, rngs: nnx.Rngs, split: str,
            bias: bool = True) -> nnx.Linear:
    # Megatron layout as partition metadata: 'columns' (the first matmul of attention and of the
    # MLP) splits the outputs over the 'tensor' mesh axis, 'rows' (the second) splits the inputs,
    # so each pair needs one all-reduce. FSDP then shards each kernel on a dimension left free.
    kernel_axes = (None, "tensor") if split == "columns" else ("tensor", None)
    bias_axes = ("tensor",) if split == "columns" else (None,)
    return nnx.Linear(fan_in, fan_out, use_bias=bias,
                      kernel_init=_partitioned(nnx.initializers.normal(std), kernel_axes),
                      bias_init=_partitioned(nnx.initializers.zeros_init(), bias_axes), dtype=config.dtype,
                      param_dtype=config.param_dtype, rngs=rngs)


def _layer_norm(config: GPT2Config, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(config.n_embd, epsilon=config.layer_norm_epsilon, dtype=config.dtype,
                         param_dtype=config.param_dtype, rngs=rngs)


def _active(dropout: nnx.Dropout, deterministic: bool | None) -> bool:
    if dropout.rate == 0:
        return False
    return not (dropout.deterministic if deterministic is None else deterministic)


class GPT2Attention(nnx.Module):
    """Causal multi-head self-attention with an optional KV cache; the kernel is :func:`attention`'s choice."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs) -> None:
        self.config = config
        residual_std = _INIT_STD / math.sqrt(2 * config.n_layer)  # GPT-2's scaled residual projections
        self.qkv = _linear(config, config.n_embd, 3 * config.n_embd, _INIT_STD, rngs, "columns")
        self.proj = _linear(config, config.n_embd, config.n_embd, residual_std, rngs, "rows")
        self.attention_dropout = nnx.Dropout(config.attention_dropout, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None, *,
                 segment_ids: jax.Array | None = None, deterministic: bool | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        config = self.config
        batch, length, _ = x.shape
        q, k, v = (t.reshape(batch, length, config.n_head, config.head_dim)
                   for t in jnp.split(self.qkv(x), 3, axis=-1))
        if config.position == "rotary":
            q, k = apply_rotary(q, positions, config.rotary_base), apply_rotary(k, positions, config.rotary_base)
        mask = None
        if cache is not None:
            # Write this chunk at its positions, then attend over the whole fixed-size cache with
            # entries after each query's position masked out.
            start = positions[0]
            cache = tuple(jax.lax.dynamic_update_slice(c, t.astype(c.dtype), (0, start, 0, 0))
                          for c, t in zip(cache, (k, v)))
            k, v = (c.astype(q.dtype) for c in cache)
            mask = (jnp.arange(k.shape[1])[None, :] <= positions[:, None])[None, None]
        bias = None
        if config.position == "alibi":
            key_positions = positions if cache is None else jnp.arange(k.shape[1])
            bias = alibi_position_bias(config.n_head, positions, key_positions).astype(q.dtype)
        rate, key = 0.0, None
        if _active(self.attention_dropout, deterministic):
            rate, key = self.attention_dropout.rate, self.attention_dropout.rngs()
        out = attention(q, k, v, causal=cache is None, bias=bias, mask=mask, segment_ids=segment_ids,
                        dropout_rate=rate, dropout_rng=key, implementation=config.attention)
        return self.proj(out.reshape(batch, length, config.n_embd)), cache


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GPT-2's GELU, the tanh approximation (``jax.nn.gelu(x, approximate=True)``)."""
    return jax.nn.gelu(x, approximate=True)


class GPT2MLP(FeedForward):
    """The block's MLP: ``n_embd -> 4·n_embd -> n_embd`` with GPT-2's tanh-approximated GELU.

    A :class:`~composerjax.models.gpt.FeedForward` (``up``, ``down``, ``act_fn``), so the
    ``GatedLinearUnits`` surgery turns it into a gated block as it does TinyGPT's.
    """

    act_fn = staticmethod(gelu_tanh)

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs) -> None:
        # Not FeedForward.__init__: GPT-2's initialisation and partition metadata instead.
        self.up = _linear(config, config.n_embd, 4 * config.n_embd, _INIT_STD, rngs, "columns")
        self.down = _linear(config, 4 * config.n_embd, config.n_embd, _INIT_STD / math.sqrt(2 * config.n_layer), rngs,
                            "rows")

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(self.act_fn(self.up(x)))


class GPT2Block(nnx.Module):
    """Pre-LN block: ``x + drop(attn(ln(x)))``, then ``x + drop(mlp(ln(x)))``."""

    def __init__(self, config: GPT2Config, *, rngs: nnx.Rngs) -> None:
        self.norm1 = _layer_norm(config, rngs)
        self.attention = GPT2Attention(config, rngs=rngs)
        self.norm2 = _layer_norm(config, rngs)
        self.mlp = GPT2MLP(config, rngs=rngs)
        self.dropout = nnx.Dropout(config.dropout, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, cache: tuple[jax.Array, jax.Array] | None = None, *,
                 segment_ids: jax.Array | None = None, deterministic: bool | None = None
                 ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        h, cache = self.attention(self.norm1(x), positions, cache, segment_ids=segment_ids,
                                  deterministic=deterministic)
        x = x + self.dropout(h, deterministic=deterministic)
        return x + self.dropout(self.mlp(self.norm2(x)), deterministic=deterministic), cache


def _stacked_blocks(config: GPT2Config, rngs: nnx.Rngs) -> GPT2Block:
    """``n_layer`` blocks as one module whose arrays have a leading layer axis (``GPT2._scan_blocks`` runs it)."""

    @nnx.split_rngs(splits=config.n_layer)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def create(rngs: nnx.Rngs) -> GPT2Block:
        return GPT2Block(config, rngs=rngs)

    return create(rngs)


def _draws(block: GPT2Block, deterministic: bool | None) -> bool:
    """Whether ``block`` draws dropout masks in this call (its random streams then move on)."""
    return _active(block.dropout, deterministic) or _active(block.attention.attention_dropout, deterministic)


def _block_function(graphdef: nnx.GraphDef, remat: str, positions: jax.Array, segment_ids: jax.Array | None,
                    deterministic: bool | None, draws: bool, scanned: bool = False) -> Any:
    """``(block state, x) -> (x, the block's random-stream state or None)``: one block as a pure function.

    Pure (``nnx.merge`` inside), so ``jax.checkpoint`` and ``lax.scan`` take it whatever trace the
    model's arrays come from (``generate`` closes over the model inside a ``fori_loop``). ``remat``
    names the checkpoint policy: 'dots' saves the matmul outputs without batch dimensions (the
    projections and the MLP) and recomputes the rest; 'full' saves nothing but the block's input.
    ``scanned``: the function is a ``lax.scan`` body (the loop orders the recomputation, and no
    common-subexpression elimination can merge it away there); unrolled, the recomputation is
    ordered after the gradient of the blocks above (:func:`~composerjax.models.remat.checkpoint_after_gradient`).
    """

    def apply(state: nnx.State, x: jax.Array) -> tuple[jax.Array, nnx.State | None]:
        block = nnx.merge(graphdef, state)
        x, _ = block(x, positions, segment_ids=segment_ids, deterministic=deterministic)
        return x, (nnx.state(block, nnx.RngState) if draws else None)

    return with_remat(apply, remat, scanned)



class GPT2(nnx.Module):
    """GPT-2: token (+ learned position) embeddings, pre-LN blocks, a final LayerNorm and the LM head.

    Takes ``(B, T)`` int tokens and returns ``(B, T, vocab_size)`` logits. Dropout is active in
    train mode (``model.train()``, the default) and off after ``model.eval()`` or with
    ``deterministic=True``. :meth:`decode` runs a chunk against a :class:`KVCache`, as
    :func:`composerjax.models.generation.generate` does. For training without the whole batch's
    logits, :meth:`features` gives the final hidden states and :meth:`head_weight` the head, which
    :func:`composerjax.models.lm_loss.cross_entropy_loss` takes chunk by chunk.

    Example:
        >>> model = GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
        >>> model(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 512)
    """

    def __init__(self, config: GPT2Config | str, *, rngs: nnx.Rngs) -> None:
        config = _resolve(config)
        self.config = config
        vocab, padded = config.vocab_size, config.padded_vocab_size
        embed = {"dtype": config.dtype, "param_dtype": config.param_dtype, "rngs": rngs}
        self.tokens = nnx.Embed(padded, config.n_embd,
                                embedding_init=padded_initializer(nnx.initializers.normal(_INIT_STD), vocab, 0),
                                **embed)
        if config.position == "learned":
            self.position = nnx.Embed(config.n_positions, config.n_embd,
                                      embedding_init=nnx.initializers.normal(_INIT_STD), **embed)
        # nnx.Embed pins dtype=None to the parameter dtype at construction; None must instead follow
        # the arrays, so that parameters cast to bfloat16 (precision='amp_bf16') compute in bfloat16.
        for embedding in (self.tokens, getattr(self, "position", None)):
            if embedding is not None:
                embedding.dtype = config.dtype
        self.embedding_dropout = nnx.Dropout(config.dropout, rngs=rngs)
        if config.scan_layers:
            self.blocks = _stacked_blocks(config, rngs)
        else:
            self.blocks = nnx.List([GPT2Block(config, rngs=rngs) for _ in range(config.n_layer)])
        self.norm = _layer_norm(config, rngs)
        if not config.tie_embeddings:
            # (D, V_padded): the padding columns start at zero, as the embedding's padding rows.
            kernel_init = padded_initializer(nnx.initializers.normal(_INIT_STD), vocab, 1)
            self.head = nnx.Linear(config.n_embd, padded, use_bias=False,
                                   kernel_init=_partitioned(kernel_init, (None, "tensor")), dtype=config.dtype,
                                   param_dtype=config.param_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        """``(B, T, vocab_size)`` logits of ``(B, T)`` tokens; ``segment_ids`` ``(B, T)`` keep packed documents apart.
        """
        return self.logits(self.features(tokens, segment_ids=segment_ids, deterministic=deterministic))

    def features(self, tokens: jax.Array, *, segment_ids: jax.Array | None = None,
                 deterministic: bool | None = None) -> jax.Array:
        """The final hidden states ``(B, T, n_embd)`` (after the last LayerNorm): the LM head's input.

        With ``segment_ids`` ``(B, T)`` (packed documents) a token attends only within its segment
        and learned or rotary positions restart at 0 at every segment (:func:`positions_from_segments`).

        Example:
            >>> model = GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
            >>> model.features(jnp.zeros((2, 16), jnp.int32)).shape
            (2, 16, 64)
        """
        self._check_length(tokens, 0)
        positions = jnp.arange(tokens.shape[1])
        if segment_ids is not None and self.config.position != "alibi":
            # Each packed document counts its positions from 0, as it would run alone; ALiBi's bias
            # depends only on distances inside a segment, so it keeps the plain ones.
            positions = positions_from_segments(segment_ids)
        hidden, _ = self._run(tokens, positions, None, deterministic, segment_ids)
        return hidden

    def head_weight(self) -> jax.Array:
        """The LM head as ``(padded_vocab_size, n_embd)``, one row per token, in the compute dtype.

        The tied token embedding as it is, or an untied head's kernel transposed; the rows from
        ``vocab_size`` on are padding.
        """
        weight = self.tokens.embedding[...] if self.config.tie_embeddings else self.head.kernel[...].T
        return weight if self.config.dtype is None else weight.astype(self.config.dtype)

    def logits(self, hidden: jax.Array) -> jax.Array:
        """``(..., vocab_size)`` logits of final hidden states: the head, without its padding rows."""
        weight = self.head_weight()
        hidden, weight = nnx.nn.dtypes.promote_dtype((hidden, weight), dtype=self.config.dtype)
        logits = jnp.einsum("...d,vd->...v", hidden, weight)
        return logits[..., : self.config.vocab_size] if weight.shape[0] > self.config.vocab_size else logits

    def decode(self, tokens: jax.Array, start: jax.Array | int, cache: KVCache, *,
               deterministic: bool | None = True) -> tuple[jax.Array, KVCache]:
        """Logits of ``(B, T)`` tokens at positions ``start .. start+T-1`` and the updated cache.

        Earlier positions are read from ``cache`` (from :meth:`init_cache`); this chunk's keys
        and values are written into it. ``start`` may be traced.
        """
        if len(cache) != self.config.n_layer:
            raise ValueError(f"cache: {len(cache)} layers, expected n_layer={self.config.n_layer}")
        positions = start + jnp.arange(tokens.shape[1])
        hidden, cache = self._run(tokens, positions, cache, deterministic, None)
        return self.logits(hidden), cache

    def init_cache(self, batch: int, length: int, dtype: Any = None) -> KVCache:
        """An empty (zero) :class:`KVCache` for ``batch`` sequences of up to ``length`` tokens.

        ``dtype`` defaults to the compute dtype (``config.dtype``, else the parameters').
        """
        if not 1 <= length <= self.config.n_positions:
            raise ValueError(f"length={length}: expected 1 to n_positions={self.config.n_positions}")
        dtype = dtype or self.config.dtype or self.tokens.embedding[...].dtype
        shape = (batch, length, self.config.n_head, self.config.head_dim)
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in range(self.config.n_layer))

    def _check_length(self, tokens: jax.Array, start: int) -> None:
        if tokens.ndim != 2:
            raise ValueError(f"tokens: shape {tokens.shape}, expected (batch, length)")
        if start + tokens.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds n_positions={self.config.n_positions}")

    def _run(self, tokens: jax.Array, positions: jax.Array, cache: KVCache | None, deterministic: bool | None,
             segment_ids: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        x = self.tokens(tokens)
        if self.config.position == "learned":
            x = x + self.position(positions)  # (T, D) or, per packed document, (B, T, D)
        x = self.embedding_dropout(x, deterministic=deterministic)
        if self.config.scan_layers:
            x, cache = self._scan_blocks(x, positions, cache, deterministic, segment_ids)
        elif cache is not None:
            new_cache = []
            for block, layer_cache in zip(self.blocks, cache):
                x, layer_cache = block(x, positions, layer_cache, deterministic=deterministic)
                new_cache.append(layer_cache)
            cache = tuple(new_cache)
        elif self.config.remat == "none":
            for block in self.blocks:
                x, _ = block(x, positions, segment_ids=segment_ids, deterministic=deterministic)
        else:
            for block in self.blocks:
                graphdef, state = nnx.split(block)
                draws = _draws(block, deterministic)
                x, streams = _block_function(graphdef, self.config.remat, positions, segment_ids, deterministic,
                                             draws)(state, x)
                if draws:
                    nnx.update(block, streams)
        return self.norm(x), cache

    def _scan_blocks(self, x: jax.Array, positions: jax.Array, cache: KVCache | None, deterministic: bool | None,
                     segment_ids: jax.Array | None) -> tuple[jax.Array, KVCache | None]:
        # lax.scan over the stacked state, each step a pure function of one layer's slice: nnx's own
        # transforms refuse a model whose arrays belong to an outer trace (generation's loop).
        graphdef, state = nnx.split(self.blocks)
        if cache is None:
            draws = _draws(self.blocks, deterministic)
            layer = _block_function(graphdef, self.config.remat, positions, segment_ids, deterministic, draws,
                                    scanned=True)
            x, streams = jax.lax.scan(lambda x, layer_state: layer(layer_state, x), x, state)
            if draws:
                nnx.update(self.blocks, streams)  # the dropout streams moved on
            return x, None

        def cached(x: jax.Array, xs: tuple[nnx.State, jax.Array, jax.Array]
                   ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
            layer_state, keys, values = xs
            x, layer_cache = nnx.merge(graphdef, layer_state)(x, positions, (keys, values), deterministic=deterministic)
            return x, layer_cache

        # The cache stays one (keys, values) pair per block for callers; the scan takes it stacked.
        x, (keys, values) = jax.lax.scan(cached, x, (state, jnp.stack([k for k, _ in cache]),
                                                     jnp.stack([v for _, v in cache])))
        return x, tuple((keys[index], values[index]) for index in range(self.config.n_layer))
