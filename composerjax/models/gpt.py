"""A small GPT-style decoder for byte-level language modelling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from composerjax.metrics import LanguageCrossEntropy, LanguagePerplexity, MaskedAccuracy, Metric
from composerjax.models.attention import attention

__all__ = ["CausalSelfAttention", "FeedForward", "DecoderBlock", "PositionEmbedding", "TinyGPT", "language_metrics"]


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; ``attention_bias`` is the hook position schemes override.

    The attention itself is :func:`composerjax.models.attention.attention`'s, which picks the kernel.
    """

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs) -> None:
        if dim % num_heads:
            raise ValueError(f"dim={dim} is not divisible by num_heads={num_heads}")
        self.dim, self.num_heads = dim, num_heads
        self.qkv = nnx.Linear(dim, 3 * dim, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, rngs=rngs)

    def attention_bias(self, length: int) -> jax.Array | None:
        """An additive ``(heads, T, T)`` (or ``(1, T, T)``) bias on the attention logits; None (the default): none."""
        return None

    def __call__(self, x: jax.Array) -> jax.Array:
        batch, length, _ = x.shape
        q, k, v = (t.reshape(batch, length, self.num_heads, self.dim // self.num_heads)
                   for t in jnp.split(self.qkv(x), 3, axis=-1))
        bias = self.attention_bias(length)
        out = attention(q, k, v, causal=True, bias=None if bias is None else bias[None])
        return self.proj(out.reshape(batch, length, self.dim))


class FeedForward(nnx.Module):
    """The block's MLP: dim -> hidden -> dim with GELU."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(dim, hidden, rngs=rngs)
        self.down = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(nnx.gelu(self.up(x)))


class DecoderBlock(nnx.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, num_heads: int, *, rngs: nnx.Rngs) -> None:
        self.norm1 = nnx.LayerNorm(dim, rngs=rngs)
        self.attention = CausalSelfAttention(dim, num_heads, rngs=rngs)
        self.norm2 = nnx.LayerNorm(dim, rngs=rngs)
        self.mlp = FeedForward(dim, 4 * dim, rngs=rngs)

    def residual(self, x: jax.Array) -> jax.Array:
        """Both residual branches' contribution (what stochastic depth drops)."""
        h = self.attention(self.norm1(x))
        return h + self.mlp(self.norm2(x + h))

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.residual(x)


class PositionEmbedding(nnx.Module):
    """Learned absolute positions, added to the token embeddings (ALiBi replaces it)."""

    def __init__(self, max_length: int, dim: int, *, rngs: nnx.Rngs) -> None:
        self.embedding = nnx.Embed(max_length, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.embedding(jnp.arange(x.shape[1]))[None]


class TinyGPT(nnx.Module):
    """Token + position embeddings, ``depth`` decoder blocks, final norm and a vocabulary head.

    Takes ``(N, T)`` int tokens and returns ``(N, T, vocab_size)`` logits.

    Example:
        >>> TinyGPT(vocab_size=256, rngs=nnx.Rngs(0))(jnp.zeros((2, 16), jnp.int32)).shape
        (2, 16, 256)
    """

    def __init__(self, vocab_size: int = 256, dim: int = 64, depth: int = 2, num_heads: int = 4,
                 max_length: int = 256, *, rngs: nnx.Rngs) -> None:
        self.max_length = max_length
        self.tokens = nnx.Embed(vocab_size, dim, rngs=rngs)
        self.position = PositionEmbedding(max_length, dim, rngs=rngs)
        self.blocks = nnx.List([DecoderBlock(dim, num_heads, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab_size, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        if tokens.shape[1] > self.max_length:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_length={self.max_length}")
        x = self.position(self.tokens(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def language_metrics(ignore_index: int = -100) -> dict[str, Metric]:
    """Composer's eval metrics for a next-token model: LanguageCrossEntropy, LanguagePerplexity, MaskedAccuracy.

    Each is a mean over the tokens of every batch, leaving out the label ``ignore_index`` (padding).
    Give them to the classifier that wraps the model:
    ``ComposerClassifier(TinyGPT(...), vocab_size, val_metrics=language_metrics())``.

    Example:
        >>> metrics = language_metrics()
        >>> list(metrics)
        ['LanguageCrossEntropy', 'LanguagePerplexity', 'MaskedAccuracy']
        >>> logits, tokens = jnp.zeros((1, 2, 4)), jnp.array([[3, -100]])  # uniform over 4 tokens, one padded
        >>> round(float(metrics["LanguagePerplexity"].update(logits, tokens).compute()), 4)
        4.0
    """
    return {
        "LanguageCrossEntropy": LanguageCrossEntropy(ignore_index=ignore_index),
        "LanguagePerplexity": LanguagePerplexity(ignore_index=ignore_index),
        "MaskedAccuracy": MaskedAccuracy(ignore_index=ignore_index),
    }
