"""ALiBi: drop learned position embeddings and bias attention logits linearly by query-key distance.

Attention with Linear Biases (Press et al., 2021) adds ``-m_h * (i - j)`` to the logit of query ``i``
attending to key ``j <= i``, with one fixed slope ``m_h`` per head, and uses no position embeddings.
Position information then comes from the bias alone, which extends to sequences longer than the
ones seen in training: train short, evaluate long.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composerjax import Algorithm, Event, Logger, State
from composerjax.models import GPT2, CausalSelfAttention
from composerjax.models.gpt import PositionEmbedding
from composerjax.models.gpt2 import GPT2Attention
from composerjax.models.surgery import replace_modules

__all__ = [
    "ALiBi",
    "Alibi",
    "AlibiAttention",
    "NoPositionEmbedding",
    "alibi_bias",
    "alibi_slopes",
    "apply_alibi",
    "scale_sequence_length",
]


def _geometric_slopes(num_heads: int) -> list[float]:
    # For a power of two n: 2^(-8/n), 2^(-16/n), ..., 2^(-8).
    return [2.0 ** (-8.0 * (head + 1) / num_heads) for head in range(num_heads)]


def alibi_slopes(num_heads: int) -> jax.Array:
    """The per-head ALiBi slopes, ``(num_heads,)`` float32.

    For a power of two ``n`` the slopes are ``2^(-8h/n)`` for ``h = 1..n``. Otherwise, as in the
    paper, the ``2^floor(log2 n)`` slopes of the nearest smaller power of two come first, followed by
    every other slope of the next power of two until there are ``n``.

    Example:
        >>> alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
        >>> alibi_slopes(6).tolist()[4:]
        [0.5, 0.125]
    """
    return jnp.asarray(_slopes(num_heads))


def _slopes(num_heads: int) -> np.ndarray:
    if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1:
        raise ValueError(f"num_heads={num_heads!r}: expected a positive integer")
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = _geometric_slopes(closest)
    if closest < num_heads:
        slopes += _geometric_slopes(2 * closest)[0::2][: num_heads - closest]
    return np.asarray(slopes, np.float32)


def alibi_bias(num_heads: int, length: int) -> jax.Array:
    """The additive ``(num_heads, length, length)`` ALiBi bias: ``-slope_h * (i - j)`` for ``j <= i``, else 0.

    Entries above the diagonal are 0: the causal mask removes them anyway.

    Example:
        >>> alibi_bias(1, 3).tolist()
        [[[0.0, 0.0, 0.0], [-0.00390625, 0.0, 0.0], [-0.0078125, -0.00390625, 0.0]]]
    """
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ValueError(f"length={length!r}: expected a positive integer")
    position = np.arange(length)
    # j - i, clipped at 0 above the diagonal (built with numpy: a constant of the compiled step).
    offset = np.minimum(position[None, :] - position[:, None], 0).astype(np.float32)
    return jnp.asarray(_slopes(num_heads)[:, None, None] * offset[None])


class AlibiAttention(CausalSelfAttention):
    """A ``CausalSelfAttention`` whose ``attention_bias`` is the ALiBi bias; it takes over the old ``qkv``/``proj``.

    Example:
        >>> old = CausalSelfAttention(8, 2, rngs=nnx.Rngs(0))
        >>> AlibiAttention(old).attention_bias(4).shape
        (2, 4, 4)
    """

    def __init__(self, attention: CausalSelfAttention) -> None:
        # No super().__init__(): it would draw fresh weights, and the old module's are the ones to keep.
        self.dim, self.num_heads = attention.dim, attention.num_heads
        self.qkv = attention.qkv
        self.proj = attention.proj

    def attention_bias(self, length: int) -> jax.Array:
        return alibi_bias(self.num_heads, length)


class NoPositionEmbedding(nnx.Module):
    """Identity in place of a position embedding: ALiBi encodes positions in the attention bias."""

    def __call__(self, x: jax.Array) -> jax.Array:
        return x


def apply_alibi(model: nnx.Module, max_sequence_length: int = 8192) -> int:
    """Switch ``model`` to ALiBi in place; return the number of modules replaced.

    Every ``CausalSelfAttention`` becomes an ``AlibiAttention`` (same weights), every
    ``PositionEmbedding`` becomes a ``NoPositionEmbedding`` (its parameters are dropped), and every
    submodule with an integer ``max_length`` attribute (``TinyGPT``) accepts up to
    ``max_sequence_length`` tokens. A Llama-class model (``LlamaAttention``: rotary positions) is
    refused with a ``ValueError`` that says why.

    Example:
        >>> from composerjax.models import TinyGPT
        >>> model = TinyGPT(dim=8, depth=2, num_heads=2, max_length=16, rngs=nnx.Rngs(0))
        >>> apply_alibi(model, max_sequence_length=64)  # 2 attentions + 1 position embedding
        3
        >>> model(jnp.zeros((1, 64), jnp.int32)).shape
        (1, 64, 256)
    """
    if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 1:
        raise ValueError(f"max_sequence_length={max_sequence_length!r}: expected a positive integer")
    _refuse_rotary(model)

    def to_alibi(attention: CausalSelfAttention) -> nnx.Module:
        return attention if isinstance(attention, AlibiAttention) else AlibiAttention(attention)

    gpt2_replaced = _gpt2_to_alibi(model, max_sequence_length)
    before = sum(1 for _, m in nnx.iter_modules(model) if isinstance(m, (AlibiAttention, NoPositionEmbedding)))
    replace_modules(model, {CausalSelfAttention: to_alibi, PositionEmbedding: lambda old: NoPositionEmbedding()})
    for _, module in nnx.iter_modules(model):
        if isinstance(getattr(module, "max_length", None), int):
            module.max_length = max_sequence_length
    after = sum(1 for _, m in nnx.iter_modules(model) if isinstance(m, (AlibiAttention, NoPositionEmbedding)))
    return after - before + gpt2_replaced


def _refuse_rotary(model: nnx.Module) -> None:
    """Raise if ``model`` holds Llama-class attention: it encodes positions with RoPE, ALiBi has nothing to replace."""
    from composerjax.models.llama import LlamaAttention

    for path, module in nnx.iter_modules(model):
        if isinstance(module, LlamaAttention):
            where = "/".join(map(str, path))
            raise ValueError(
                f"Alibi cannot be applied to this model: its attention {where!r} is Llama-class "
                "(LlamaAttention), which encodes positions with rotary embeddings (RoPE) inside every layer and has "
                "no position-embedding table to drop. ALiBi's biases on top of RoPE would be two position schemes "
                "the model was never trained with, and no Hugging Face architecture to export to. Remove Alibi for "
                "Llama, Mistral and Qwen2 models (it applies to TinyGPT and GPT-2).")


def _gpt2_to_alibi(model: nnx.Module, max_sequence_length: int) -> int:
    """Switch every :class:`~composerjax.models.GPT2` in ``model`` to ``position='alibi'``; count as for TinyGPT.

    Each attention counts one (the ``n_layer`` layers of scanned blocks too) and a dropped learned
    position table one more; ``n_positions`` becomes ``max_sequence_length`` (ALiBi has no table to
    outgrow).
    """
    replaced = 0
    for _, module in list(nnx.iter_modules(model)):
        if not isinstance(module, GPT2) or module.config.position == "alibi":
            continue
        config = dataclasses.replace(module.config, position="alibi", n_positions=max_sequence_length)
        if hasattr(module, "position"):
            del module.position
            replaced += 1
        module.config = config
        # Scanned layers are one stacked block (arrays with a leading layer axis): one attention to switch.
        for block in [module.blocks] if config.scan_layers else module.blocks:
            block.attention.config = config
        replaced += config.n_layer
    return replaced


def scale_sequence_length(batch: Any, scaling: float) -> Any:
    """Cut every sequence of ``batch`` into ``1 / scaling`` shorter ones, keeping every token (Composer's reshape).

    Arrays with a sequence axis (``ndim >= 2``) go from ``(N, T, ...)`` to ``(N / scaling, T * scaling,
    ...)``; per-sample arrays (``ndim == 1``) are repeated for each piece; scalars are kept.

    Raises:
        ValueError: when the arrays with ``ndim >= 2`` do not all start with the same ``(N, T)`` (their
            axis 1 is then not one sequence axis, and cutting it would scramble them), or ``T`` is not
            divisible by ``1 / scaling``.

    Example:
        >>> x = np.arange(8).reshape(1, 8)
        >>> scale_sequence_length((x, x + 1), 0.5)[0].tolist()
        [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    pieces = _pieces(scaling)
    if pieces == 1:
        return batch
    sequences = [np.shape(leaf)[:2] for leaf in jax.tree.leaves(batch) if np.ndim(leaf) >= 2]
    if not sequences:
        raise ValueError(f"train_sequence_length_scaling={scaling}: the batch has no (N, T, ...) array to cut into "
                         "shorter sequences; pass train_sequence_length_scaling=1.0 for such batches")
    if len(set(sequences)) > 1:
        raise ValueError(f"train_sequence_length_scaling={scaling}: the batch's arrays must all be (N, T, ...) with "
                         "the same (N, T) to be cut into shorter sequences; got leading shapes "
                         f"{sorted(set(sequences))}; pass train_sequence_length_scaling=1.0 for such batches")
    length = sequences[0][1]
    if length % pieces:
        raise ValueError(f"train_sequence_length_scaling={scaling}: the sequence length {length} is not "
                         f"divisible by {pieces}")

    def reshape(leaf: Any) -> Any:
        ndim = getattr(leaf, "ndim", 0)
        if ndim == 0:
            return leaf
        if ndim == 1:
            return leaf.repeat(pieces, axis=0)
        size = leaf.shape[0]
        return leaf.reshape(size * pieces, length // pieces, *leaf.shape[2:])

    return jax.tree.map(reshape, batch)


def _pieces(scaling: Any) -> int:
    if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not 0 < scaling <= 1:
        raise ValueError(f"train_sequence_length_scaling={scaling!r}: expected 1/k for a positive integer k "
                         "(1, 0.5, 0.25, ...)")
    pieces = round(1 / scaling)
    if abs(pieces * scaling - 1) > 1e-9:
        raise ValueError(f"train_sequence_length_scaling={scaling!r}: expected 1/k for a positive integer k "
                         "(1, 0.5, 0.25, ...)")
    return pieces


class Alibi(Algorithm):
    """Replace learned positions by ALiBi attention biases at INIT, so the model evaluates on longer sequences.

    Runs at ``Event.INIT`` (host): surgery on ``state.model`` (see ``apply_alibi``) before the
    parameters are placed; the position-embedding parameters are gone from the trained state. With
    ``train_sequence_length_scaling < 1`` (Composer's default 0.25) it also runs at
    ``Event.AFTER_DATALOADER`` (host) and reshapes each training batch into shorter sequences
    (``scale_sequence_length``): same tokens, cheaper attention, one compile for the new shape. Every
    array of the batch with ``ndim >= 2`` must then be ``(N, T, ...)`` with the same ``(N, T)``
    (a ``ValueError`` says otherwise); eval batches keep their length.

    Args:
        max_sequence_length: the longest sequence the model accepts after surgery (evaluation).
        train_sequence_length_scaling: ``1/k``: train on sequences ``k`` times shorter (and ``k``
            times more of them); 1 leaves batches alone.

    Example::

        trainer = Trainer(ComposerClassifier(TinyGPT(max_length=128, rngs=nnx.Rngs(0)), 256), loader, '1ep',
                          algorithms=[Alibi(max_sequence_length=1024)])
    """

    required_modules = (CausalSelfAttention, GPT2Attention)

    def __init__(self, max_sequence_length: int = 8192, train_sequence_length_scaling: float = 0.25) -> None:
        if isinstance(max_sequence_length, bool) or not isinstance(max_sequence_length, int) or max_sequence_length < 1:
            raise ValueError(f"max_sequence_length={max_sequence_length!r}: expected a positive integer")
        self.pieces = _pieces(train_sequence_length_scaling)
        self.max_sequence_length = max_sequence_length
        self.train_sequence_length_scaling = train_sequence_length_scaling

    events = frozenset({Event.INIT, Event.AFTER_DATALOADER})

    def match(self, event: Event, state: State) -> bool:
        return event == Event.INIT or (event == Event.AFTER_DATALOADER and self.pieces > 1)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        if event == Event.AFTER_DATALOADER:
            state.batch = scale_sequence_length(state.batch, self.train_sequence_length_scaling)
            return
        replaced = apply_alibi(state.model, self.max_sequence_length)
        logger.log_hyperparameters({"alibi/num_replacements": replaced})
        if replaced == 0:
            warnings.warn("Alibi had no effect: the model has no CausalSelfAttention or PositionEmbedding",
                          UserWarning, stacklevel=2)

    def __repr__(self) -> str:
        return (f"Alibi(max_sequence_length={self.max_sequence_length}, "
                f"train_sequence_length_scaling={self.train_sequence_length_scaling})")


#: The paper's spelling.
ALiBi = Alibi
