"""Cross-entropy over a vocabulary without the whole batch's float32 logits: the LM head, chunk by chunk.

The logits of a language model's last layer are ``hidden @ weight.T``: ``(B, T, V)``, for GPT-2
small at batch 8 x 1024 tokens 412M numbers, 1.6 GB in float32, held for the backward pass with
their softmax and gradient. Here the sequence is walked in chunks (``lax.scan``): each chunk's
logits are computed in float32 from the compute-dtype operands (``preferred_element_type``), used
and dropped. :func:`cross_entropy_loss`, the training loss, computes each chunk's gradient in the
same pass (the mean's gradient is known there, up to the incoming scale, as in Liger's fused
linear cross-entropy): between the passes it keeps the gradients of the hidden states and of the
head, and the backward pass only scales them, with no logits recomputed. :func:`token_cross_entropy`
(per token, any incoming gradient) keeps each token's log-sum-exp and recomputes the chunk's logits
in the backward pass. Values and gradients equal the plain loss's to float32 rounding.

The head may be wider than the vocabulary (rows padded to a multiple of 64 for the matrix units):
columns from ``vocab_size`` on are masked out (``-inf``) of the softmax, the argmax and the loss.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

__all__ = ["LOGITS_CHUNK_BYTES", "chunk_length", "cross_entropy_loss", "token_cross_entropy", "token_statistics"]

#: The float32 logits one chunk may hold (``batch x chunk x vocabulary x 4`` bytes): 256 MiB.
LOGITS_CHUNK_BYTES = 256 * 2**20


def chunk_length(batch: int, length: int, vocab: int, max_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Sequence positions per chunk: as many as keep one chunk's float32 logits under ``max_bytes``, evenly split.

    Example:
        >>> chunk_length(8, 1024, 50304)  # GPT-2 small at 8 x 1024: 7 chunks of 147 positions
        147
        >>> chunk_length(16, 128, 2048)  # everything fits one chunk
        128
    """
    most = max(1, max_bytes // (batch * vocab * 4))
    chunks = math.ceil(length / min(most, length))
    return math.ceil(length / chunks)


def _check_chunk_size(chunk_size: int | None) -> None:
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size={chunk_size!r}: expected a positive number of sequence positions, or None "
                         "(chosen so one chunk's float32 logits stay under LOGITS_CHUNK_BYTES)")


def _as_batch(hidden: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(B, T, D)`` hidden states and ``(B, T)`` targets from ``(..., T, D)`` and ``(..., T)``."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {hidden.shape} and targets {targets.shape}: expected hidden (..., D) and targets "
                         "(...) with the same leading shape")
    if targets.ndim == 1:
        return hidden[None], targets[None]
    return hidden.reshape(-1, *hidden.shape[-2:]), targets.reshape(-1, targets.shape[-1])


def _chunks(x: jax.Array, count: int, size: int, fill: int | float = 0) -> jax.Array:
    """``(B, T, ...)`` -> ``(count, B, size, ...)``, the sequence padded with ``fill`` to ``count * size``."""
    pad = count * size - x.shape[1]
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return jnp.moveaxis(x.reshape(x.shape[0], count, size, *x.shape[2:]), 1, 0)


def _unchunk(x: jax.Array, length: int) -> jax.Array:
    """``(count, B, size, ...)`` -> ``(B, length, ...)``."""
    x = jnp.moveaxis(x, 0, 1)
    return x.reshape(x.shape[0], -1, *x.shape[3:])[:, :length]


def _logits(hidden: jax.Array, weight: jax.Array, vocab_size: int) -> jax.Array:
    """One chunk's float32 logits ``(B, C, V_padded)`` from compute-dtype operands; padded columns are -inf."""
    logits = jnp.einsum("bcd,vd->bcv", hidden, weight, preferred_element_type=jnp.float32)
    if weight.shape[0] > vocab_size:
        logits = jnp.where(jnp.arange(weight.shape[0]) < vocab_size, logits, -jnp.inf)
    return logits


def _valid(targets: jax.Array, vocab_size: int) -> jax.Array:
    return (targets >= 0) & (targets < vocab_size)


def _minus_targets(probabilities: jax.Array, targets: jax.Array) -> jax.Array:
    """``softmax - one_hot(targets)`` without a one-hot array: one select XLA fuses (targets -1: none)."""
    hit = jnp.arange(probabilities.shape[-1]) == targets[..., None]
    return jnp.where(hit, probabilities - 1.0, probabilities)


def _chunk_forward(hidden: jax.Array, weight: jax.Array, targets: jax.Array, vocab_size: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses, log-sum-exp, argmax)`` of one chunk, each ``(B, C)``."""
    logits = _logits(hidden, weight, vocab_size)
    lse = jax.nn.logsumexp(logits, axis=-1)
    valid = _valid(targets, vocab_size)
    picked = jnp.take_along_axis(logits, jnp.where(valid, targets, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, lse - picked, 0.0), lse, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _over_chunks(function, hidden: jax.Array, targets: jax.Array, size: int) -> tuple[jax.Array, ...]:
    """``function(hidden_chunk, targets_chunk)`` over the sequence, chunk by chunk; outputs ``(B, T)`` each."""
    length = hidden.shape[1]
    count = math.ceil(length / size)
    if count == 1:
        return function(hidden, targets)
    outputs = jax.lax.map(lambda xs: function(*xs), (_chunks(hidden, count, size), _chunks(targets, count, size, -1)))
    return tuple(_unchunk(output, length) for output in outputs)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _token_losses(hidden: jax.Array, weight: jax.Array, targets: jax.Array, vocab_size: int, size: int) -> jax.Array:
    return _token_losses_forward(hidden, weight, targets, vocab_size, size)[0]


def _token_losses_forward(hidden: jax.Array, weight: jax.Array, targets: jax.Array, vocab_size: int, size: int
                          ) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    losses, lse, _ = _over_chunks(lambda h, t: _chunk_forward(h, weight, t, vocab_size), hidden, targets, size)
    return losses, (hidden, weight, targets, lse)


def _token_losses_backward(vocab_size: int, size: int, residuals: tuple[jax.Array, ...], grad: jax.Array
                           ) -> tuple[jax.Array, jax.Array, None]:
    hidden, weight, targets, lse = residuals
    length = hidden.shape[1]
    count = math.ceil(length / size)
    # Through the incoming gradient (+ 0 * g), so XLA neither merges the recomputed logits with the
    # forward's (keeping those alive in between) nor computes them before the gradient exists.
    hidden = hidden + (grad.reshape(-1)[0] * 0).astype(hidden.dtype)

    def chunk(weight_grad: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        h, t, chunk_lse, g = xs
        probabilities = jnp.exp(_logits(h, weight, vocab_size) - chunk_lse[..., None])
        valid = _valid(t, vocab_size)
        # d loss / d logits in float32, then the compute dtype: both matmuls of the backward pass take
        # compute-dtype operands (bfloat16 under amp_bf16) and accumulate in float32, as the forward's.
        logits_grad = (_minus_targets(probabilities, jnp.where(valid, t, -1))
                       * jnp.where(valid, g, 0.0)[..., None]).astype(h.dtype)
        hidden_grad = jnp.einsum("bcv,vd->bcd", logits_grad, weight, preferred_element_type=jnp.float32)
        weight_grad = weight_grad + jnp.einsum("bcv,bcd->vd", logits_grad, h, preferred_element_type=jnp.float32)
        return weight_grad, hidden_grad.astype(hidden.dtype)

    zero = jnp.zeros(weight.shape, jnp.float32)
    if count == 1:
        weight_grad, hidden_grad = chunk(zero, (hidden, targets, lse, grad))
    else:
        xs = (_chunks(hidden, count, size), _chunks(targets, count, size, -1), _chunks(lse, count, size),
              _chunks(grad, count, size))
        weight_grad, hidden_grad = jax.lax.scan(chunk, zero, xs)
        hidden_grad = _unchunk(hidden_grad, length)
    return hidden_grad, weight_grad.astype(weight.dtype), None


_token_losses.defvjp(_token_losses_forward, _token_losses_backward)


def token_cross_entropy(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, vocab_size: int | None = None,
                        chunk_size: int | None = None) -> jax.Array:
    """Per-token cross-entropy of the logits ``hidden @ weight.T``, computed chunk by chunk (float32).

    Differentiable in ``hidden`` and ``weight`` (a custom VJP that recomputes each chunk's logits).
    A target outside ``[0, vocab_size)`` (``-100``, padding) gets loss 0 and no gradient.

    Args:
        hidden: ``(..., T, D)`` final hidden states, in the compute dtype.
        weight: ``(V_padded, D)``: the LM head, rows per token (a tied embedding as it is; an
            untied ``(D, V)`` kernel transposed).
        targets: ``(..., T)`` integer next tokens.
        vocab_size: the real vocabulary; rows of ``weight`` from it on are padding, masked out
            (default: every row is a token).
        chunk_size: sequence positions per chunk; default :func:`chunk_length`'s.

    Returns:
        ``(..., T)`` float32 losses.

    Example:
        >>> hidden, weight = jnp.ones((2, 5, 4)), jnp.zeros((8, 4))  # uniform over 8 tokens
        >>> losses = token_cross_entropy(hidden, weight, jnp.array([[1, 2, 3, 4, -100]] * 2), chunk_size=2)
        >>> [round(float(x), 4) for x in losses[0]]
        [2.0794, 2.0794, 2.0794, 2.0794, 0.0]
    """
    _check_chunk_size(chunk_size)
    shape = targets.shape
    hidden, targets = _as_batch(hidden, targets)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    size = chunk_size or chunk_length(hidden.shape[0], hidden.shape[1], weight.shape[0])
    return _token_losses(hidden, weight, targets.astype(jnp.int32), vocab_size, size).reshape(shape)


def cross_entropy_loss(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, vocab_size: int | None = None,
                       ignore_index: int | None = -100, chunk_size: int | None = None) -> jax.Array:
    """Mean next-token cross-entropy over the counted tokens, without the whole batch's logits.

    Tokens whose target is ``ignore_index`` are left out of the mean (Composer's ``-100``), as are
    targets outside ``[0, vocab_size)``. The mean is over real tokens, so a batch with padding
    weighs what it holds. The gradients are computed in the forward pass, chunk by chunk, and the
    backward pass scales them: the head's matmul runs three times per step, as without chunks.

    Args:
        hidden: ``(..., T, D)`` final hidden states, in the compute dtype.
        weight: ``(V_padded, D)``, the LM head one row per token (see :func:`token_cross_entropy`).
        targets: ``(..., T)`` integer next tokens.
        vocab_size: the real vocabulary; rows from it on are padding (default: every row).
        ignore_index: the target left out (None: none).
        chunk_size: sequence positions per chunk; default :func:`chunk_length`'s.

    Example:
        >>> hidden, weight = jnp.ones((1, 3, 4)), jnp.zeros((8, 4))
        >>> round(float(cross_entropy_loss(hidden, weight, jnp.array([[1, -100, 3]]))), 4)  # ln 8
        2.0794
    """
    _check_chunk_size(chunk_size)
    valid = jnp.ones(targets.shape, bool) if ignore_index is None else targets != ignore_index
    hidden, targets = _as_batch(hidden, jnp.where(valid, targets, -1).astype(jnp.int32))
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    size = chunk_size or chunk_length(hidden.shape[0], hidden.shape[1], weight.shape[0])
    return _mean_loss(hidden, weight, targets, vocab_size, size)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _mean_loss(hidden: jax.Array, weight: jax.Array, targets: jax.Array, vocab_size: int, size: int) -> jax.Array:
    return _mean_loss_forward(hidden, weight, targets, vocab_size, size)[0]


def _mean_loss_forward(hidden: jax.Array, weight: jax.Array, targets: jax.Array, vocab_size: int, size: int
                       ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """The mean loss, and its gradients for an incoming gradient of 1: ``(d hidden, d weight)``."""
    count = jnp.maximum(jnp.sum(_valid(targets, vocab_size)), 1).astype(jnp.float32)
    length = hidden.shape[1]

    def chunk(weight_grad: jax.Array, xs: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, tuple[jax.Array, ...]]:
        h, t = xs
        logits = _logits(h, weight, vocab_size)
        lse = jax.nn.logsumexp(logits, axis=-1)
        valid = _valid(t, vocab_size)
        safe = jnp.where(valid, t, 0)
        losses = jnp.where(valid, lse - jnp.take_along_axis(logits, safe[..., None], axis=-1)[..., 0], 0.0)
        # d mean / d logits in float32, then the compute dtype: both gradient matmuls take compute-dtype
        # operands (bfloat16 under amp_bf16) and accumulate in float32, as the forward's.
        logits_grad = (_minus_targets(jnp.exp(logits - lse[..., None]), jnp.where(valid, t, -1))
                       * (valid.astype(jnp.float32) / count)[..., None]).astype(h.dtype)
        hidden_grad = jnp.einsum("bcv,vd->bcd", logits_grad, weight, preferred_element_type=jnp.float32)
        weight_grad = weight_grad + jnp.einsum("bcv,bcd->vd", logits_grad, h, preferred_element_type=jnp.float32)
        return weight_grad, (jnp.sum(losses), hidden_grad.astype(hidden.dtype))

    zero = jnp.zeros(weight.shape, jnp.float32)
    chunks = math.ceil(length / size)
    if chunks == 1:
        weight_grad, (total, hidden_grad) = chunk(zero, (hidden, targets))
    else:
        weight_grad, (totals, hidden_grad) = jax.lax.scan(
            chunk, zero, (_chunks(hidden, chunks, size), _chunks(targets, chunks, size, -1)))
        total, hidden_grad = jnp.sum(totals), _unchunk(hidden_grad, length)
    return total / count, (hidden_grad, weight_grad.astype(weight.dtype))


def _mean_loss_backward(vocab_size: int, size: int, gradients: tuple[jax.Array, jax.Array], grad: jax.Array
                        ) -> tuple[jax.Array, jax.Array, None]:
    hidden_grad, weight_grad = gradients
    return (hidden_grad * grad).astype(hidden_grad.dtype), (weight_grad * grad).astype(weight_grad.dtype), None


_mean_loss.defvjp(_mean_loss_forward, _mean_loss_backward)


def token_statistics(hidden: jax.Array, weight: jax.Array, targets: jax.Array, *, vocab_size: int | None = None,
                     chunk_size: int | None = None) -> tuple[jax.Array, jax.Array]:
    """``(losses, predictions)`` per token, chunk by chunk: what the eval metrics need, without the logits.

    ``losses`` as :func:`token_cross_entropy` (0 where the target is out of range);
    ``predictions`` the argmax over the real vocabulary (padded rows never win). Not differentiated.

    Example:
        >>> weight = jnp.eye(4)  # token i's logits are the hidden state itself
        >>> hidden = jnp.array([[[0.0, 5.0, 0.0, 0.0], [0.0, 0.0, 0.0, 5.0]]])
        >>> token_statistics(hidden, weight, jnp.array([[1, 2]]), vocab_size=3)[1].tolist()  # 3 is padding
        [[1, 0]]
    """
    _check_chunk_size(chunk_size)
    shape = targets.shape
    hidden, targets = _as_batch(jax.lax.stop_gradient(hidden), targets)
    weight = jax.lax.stop_gradient(weight)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    size = chunk_size or chunk_length(hidden.shape[0], hidden.shape[1], weight.shape[0])
    losses, _, predictions = _over_chunks(lambda h, t: _chunk_forward(h, weight, t, vocab_size), hidden,
                                          targets.astype(jnp.int32), size)
    return losses.reshape(shape), predictions.reshape(shape)
