"""The one attention function every model calls, and the pure rule that picks its kernel.

:func:`attention` takes ``(batch, length, heads, head_dim)`` queries, keys and values with a causal
flag, an additive bias (ALiBi), a boolean mask (a KV cache's filled positions), segment ids (packed
sequences: a token attends only within its segment), sequence lengths (padding) and dropout on the
weights, and runs one of three kernels:

* ``'cudnn'``: cuDNN's fused (flash) attention through ``jax.nn.dot_product_attention(...,
  implementation='cudnn')`` on NVIDIA GPUs of compute capability 8.0 (Ampere) or newer, for
  bfloat16 or float16 inputs with a head size that is a multiple of 8 and at most 128 (256 from
  Hopper, sm90, on). Causality goes in as ``is_causal=True``, never as a boolean mask (a mask
  becomes a full-size bias there).
* ``'pallas'``: the Pallas flash-attention kernel JAX ships for TPUs
  (``jax.experimental.pallas.ops.tpu.flash_attention``), without bias, mask or padding lengths,
  for sequence lengths that are multiples of its 128-token blocks.
* ``'xla'``: XLA's attention everywhere else: CPU, float32 on a GPU, unsupported head sizes, and
  attention dropout, which needs the weights explicitly (no fused kernel takes a JAX dropout key).
  As the fused kernels do, it keeps only its inputs for the backward pass and recomputes the
  ``(B, N, T, S)`` scores and weights there (:func:`~composerjax.models.remat.checkpoint_after_gradient`):
  for GPT-2 small at 8 x 1024 tokens those are about 0.4 GB per layer in float32. Queries longer
  than 256 go in blocks (a loop with a backward loop of its own), so even then only one block's
  scores exist at a time, and each layer's gradient buffers are made only once its gradient exists.

:func:`choose_kernel` is the rule, a pure function of the backend and the inputs' description.
When a fused kernel refuses its inputs at trace time (``NotImplementedError``, ``ValueError`` or
``RuntimeError``), :func:`attention` falls back to XLA and warns once per distinct reason.
Every choice is recorded; :func:`take_attention_choices` hands those made since its last call to
the step's compile record, so the compile line says which kernel ran and why.
"""

from __future__ import annotations

import math
import warnings
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from composerjax.models.remat import checkpoint_after_gradient

__all__ = [
    "IMPLEMENTATIONS",
    "KernelChoice",
    "attention",
    "choose_kernel",
    "current_backend",
    "describe_choices",
    "explicit_attention",
    "positions_from_segments",
    "take_attention_choices",
]

#: What ``implementation`` (and ``GPT2Config.attention``) accepts: ``'auto'`` lets :func:`choose_kernel` decide.
IMPLEMENTATIONS = ("auto", "xla", "cudnn")

_HALF = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
#: XLA's attention takes queries in blocks of at most this many (evenly split): with the recomputation
#: in the backward pass, one block's ``(B, N, block, S)`` scores exist at a time.
_QUERY_BLOCK = 256
_PALLAS_BLOCK = 128  # the TPU kernel's default block along both sequence axes


class KernelChoice(NamedTuple):
    """Which attention kernel runs and why: ``kernel`` is ``'xla'``, ``'cudnn'`` or ``'pallas'``."""

    kernel: str
    reason: str

    def describe(self) -> str:
        """``'cudnn (NVIDIA sm90, bfloat16, head size 64)'``: the kernel and the reason, for one line."""
        return f"{self.kernel} ({self.reason})"


class Backend(NamedTuple):
    """What :func:`choose_kernel` needs to know about the devices: platform, kind and CUDA compute capability."""

    platform: str
    device_kind: str = ""
    compute_capability: str | None = None


def current_backend() -> Backend:
    """The default backend's platform, device kind and (NVIDIA CUDA devices only) compute capability.

    Example:
        >>> current_backend().platform
        'cpu'
    """
    device = jax.devices()[0]
    capability = getattr(device, "compute_capability", None)
    return Backend(device.platform, str(getattr(device, "device_kind", "")),
                   None if capability is None else str(capability))


def _capability(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        major, _, minor = str(text).partition(".")
        return int(major), int(minor or 0)
    except ValueError:
        return None


def choose_kernel(*, platform: str, dtype: Any, head_dim: int, q_length: int, kv_length: int,
                  has_bias: bool = False, has_mask: bool = False, has_segments: bool = False,
                  has_lengths: bool = False, has_dropout: bool = False, requested: str = "auto",
                  device_kind: str = "", compute_capability: str | None = None) -> KernelChoice:
    """The attention kernel for these inputs on this backend, and why: a pure function.

    Args:
        platform: ``'cpu'``, ``'gpu'`` or ``'tpu'`` (``jax.devices()[0].platform``).
        dtype: the queries' dtype.
        head_dim: the size of one head.
        q_length: the query sequence length.
        kv_length: the key/value sequence length.
        has_bias: an additive bias on the scores (ALiBi).
        has_mask: a boolean mask (a KV cache's filled positions).
        has_segments: segment ids (packed sequences).
        has_lengths: query or key/value sequence lengths (padding).
        has_dropout: dropout on the attention weights is active.
        requested: ``'auto'``, or ``'xla'`` / ``'cudnn'`` to force one (``'cudnn'`` where it cannot run
            falls back to XLA with the reason).
        device_kind: the device's name (``'NVIDIA H100 80GB HBM3'``), for the reason.
        compute_capability: ``'9.0'`` on an NVIDIA CUDA device, else None.

    Raises:
        ValueError: ``requested`` is not one of :data:`IMPLEMENTATIONS`.

    Example:
        >>> choose_kernel(platform="gpu", dtype="bfloat16", head_dim=64, q_length=1024, kv_length=1024,
        ...               compute_capability="9.0").kernel
        'cudnn'
        >>> choose_kernel(platform="cpu", dtype="bfloat16", head_dim=64, q_length=1024, kv_length=1024)
        KernelChoice(kernel='xla', reason='cpu: no fused attention kernel')
    """
    if requested not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation={requested!r}: expected one of "
                         f"{', '.join(map(repr, IMPLEMENTATIONS))}")
    dtype = jnp.dtype(dtype)
    if requested == "xla":
        return KernelChoice("xla", "attention='xla' requested")
    forced = "attention='cudnn' requested, but " if requested == "cudnn" else ""
    if has_dropout:
        return KernelChoice("xla", f"{forced}attention dropout is active: no fused kernel takes a JAX dropout key, "
                                   "so the weights are dropped explicitly")
    if platform == "gpu":
        return _gpu_choice(forced, dtype, head_dim, q_length, kv_length, has_bias or has_mask or has_segments,
                           compute_capability)
    if forced:
        return KernelChoice("xla", f"{forced}{platform} has no cuDNN")
    if platform == "tpu":
        return _tpu_choice(q_length, kv_length, has_bias, has_mask, has_lengths)
    return KernelChoice("xla", f"{platform}: no fused attention kernel")


def _gpu_choice(forced: str, dtype: jnp.dtype, head_dim: int, q_length: int, kv_length: int, biased: bool,
                compute_capability: str | None) -> KernelChoice:
    capability = _capability(compute_capability)
    if capability is None:
        return KernelChoice("xla", f"{forced}not an NVIDIA CUDA GPU: cuDNN's fused attention needs one")
    sm = f"sm{capability[0]}{capability[1]}"
    if capability < (8, 0):
        return KernelChoice("xla", f"{forced}NVIDIA {sm}: cuDNN's fused attention needs Ampere (sm80) or newer")
    if dtype not in _HALF:
        return KernelChoice("xla", f"{forced}{dtype.name} inputs: cuDNN's fused attention takes bfloat16 or "
                                   "float16 (precision='amp_bf16' computes in bfloat16)")
    largest = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > largest:
        return KernelChoice("xla", f"{forced}head size {head_dim}: cuDNN's fused attention on {sm} needs a multiple "
                                   f"of 8 up to {largest}")
    if biased and (q_length % 2 or kv_length % 2):
        return KernelChoice("xla", f"{forced}a bias or mask with sequence lengths {q_length} x {kv_length}: cuDNN "
                                   "needs them even")
    return KernelChoice("cudnn", f"NVIDIA {sm}, {dtype.name}, head size {head_dim}")


def _tpu_choice(q_length: int, kv_length: int, has_bias: bool, has_mask: bool, has_lengths: bool) -> KernelChoice:
    if has_bias or has_mask or has_lengths:
        what = "a bias" if has_bias else "a mask" if has_mask else "padding lengths"
        return KernelChoice("xla", f"tpu: {what}, which the Pallas flash kernel is not given")
    if q_length % _PALLAS_BLOCK or kv_length % _PALLAS_BLOCK:
        return KernelChoice("xla", f"tpu: sequence lengths {q_length} x {kv_length} are not multiples of the Pallas "
                                   f"kernel's {_PALLAS_BLOCK}-token blocks")
    return KernelChoice("pallas", "tpu: Pallas flash attention")


def positions_from_segments(segment_ids: jax.Array) -> jax.Array:
    """Each token's position inside its own segment: ``(B, T)`` int32 that restart at 0 where the id changes.

    A segment is a run of equal ids along the sequence (a packed document), so positions count
    from the first token of the run: what the document would see run alone. Learned and rotary
    positions take these for packed sequences; ALiBi needs nothing, its bias depends only on
    ``i - j`` inside one segment.

    Example:
        >>> positions_from_segments(jnp.array([[0, 0, 0, 1, 1, 2], [5, 5, 5, 5, 7, 7]])).tolist()
        [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 1]]
    """
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim != 2:
        raise ValueError(f"segment_ids: shape {segment_ids.shape}, expected (batch, length)")
    index = jnp.broadcast_to(jnp.arange(segment_ids.shape[1], dtype=jnp.int32), segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                             axis=1)
    return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


# -- the record of choices and the one-time warnings ------------------------------------------------
_CHOICES: dict[KernelChoice, None] = {}  # an ordered set: each distinct choice once, since the last take
_WARNED: set[str] = set()


def take_attention_choices() -> tuple[KernelChoice, ...]:
    """The distinct kernel choices :func:`attention` made (while tracing) since the last call, oldest first.

    The step's compile record calls it right after a step compiled, so the compile line says which
    kernel that step traced.

    Example:
        >>> _ = take_attention_choices()
        >>> q = jnp.zeros((1, 4, 2, 8))
        >>> _ = attention(q, q, q, causal=True)
        >>> take_attention_choices()
        (KernelChoice(kernel='xla', reason='cpu: no fused attention kernel'),)
    """
    choices = tuple(_CHOICES)
    _CHOICES.clear()
    return choices


def describe_choices(choices: tuple[KernelChoice, ...]) -> str | None:
    """The choices as one phrase for the compile line (None when there are none).

    Example:
        >>> describe_choices((KernelChoice("xla", "cpu: no fused attention kernel"),))
        'xla (cpu: no fused attention kernel)'
    """
    return "; ".join(choice.describe() for choice in choices) or None


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


# -- the dispatcher -------------------------------------------------------------------------------
def attention(query: jax.Array, key: jax.Array, value: jax.Array, *, causal: bool = False,
              bias: jax.Array | None = None, mask: jax.Array | None = None,
              segment_ids: jax.Array | None = None, kv_segment_ids: jax.Array | None = None,
              q_lengths: jax.Array | None = None, kv_lengths: jax.Array | None = None, scale: float | None = None,
              dropout_rate: float = 0.0, dropout_rng: jax.Array | None = None,
              implementation: str = "auto") -> jax.Array:
    """Multi-head attention of ``(B, T, N, H)`` queries over ``(B, S, N, H)`` keys and values, on the chosen kernel.

    Args:
        query: ``(B, T, N, H)``.
        key: ``(B, S, N, H)``.
        value: ``(B, S, N, H)``.
        causal: query ``i`` attends only to keys ``j <= i``.
        bias: added to the scores, broadcastable to ``(B, N, T, S)`` (ALiBi's ``(1, N, T, S)``).
        mask: boolean, broadcastable to ``(B, N, T, S)``; True takes part.
        segment_ids: ``(B, T)`` ints: a query attends only to keys of its own segment (packed sequences).
        kv_segment_ids: ``(B, S)`` segment ids of the keys; defaults to ``segment_ids`` (self-attention).
        q_lengths: ``(B,)`` int32 real query lengths; the rest are padding (their outputs are 0).
        kv_lengths: ``(B,)`` int32 real key lengths; the rest are never attended to.
        scale: the scores' scale; ``1 / sqrt(H)`` by default.
        dropout_rate: dropout on the attention weights, in ``[0, 1)``; needs ``dropout_rng``.
        dropout_rng: the key of the dropout mask.
        implementation: ``'auto'`` (:func:`choose_kernel` decides), ``'xla'`` or ``'cudnn'``.

    Raises:
        ValueError: a bad ``implementation`` or ``dropout_rate``, or dropout without ``dropout_rng``.

    Example:
        >>> q = jnp.ones((2, 8, 4, 16))
        >>> attention(q, q, q, causal=True).shape
        (2, 8, 4, 16)
    """
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)) or not 0 <= dropout_rate < 1:
        raise ValueError(f"attention(dropout_rate={dropout_rate!r}): expected a rate in [0, 1)")
    if dropout_rate and dropout_rng is None:
        raise ValueError(f"attention(dropout_rate={dropout_rate}): dropout needs dropout_rng, a jax.random key")
    if kv_segment_ids is None:
        kv_segment_ids = segment_ids
    elif segment_ids is None:
        raise ValueError("attention(kv_segment_ids=...): give the queries' segment_ids too")
    backend = current_backend()
    choice = choose_kernel(platform=backend.platform, dtype=query.dtype, head_dim=query.shape[-1],
                           q_length=query.shape[1], kv_length=key.shape[1], has_bias=bias is not None,
                           has_mask=mask is not None, has_segments=segment_ids is not None,
                           has_lengths=q_lengths is not None or kv_lengths is not None,
                           has_dropout=bool(dropout_rate), requested=implementation,
                           device_kind=backend.device_kind, compute_capability=backend.compute_capability)
    if implementation != "auto" and choice.kernel != implementation:
        _warn_once(f"attention: {choice.reason}; using {choice.kernel}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)
    full_mask = _segment_mask(mask, segment_ids, kv_segment_ids)
    out = None
    if choice.kernel == "cudnn":
        try:
            out = _cudnn_attention(query, key, value, None if bias is None else bias.astype(query.dtype), full_mask,
                                   causal=causal, scale=scale, q_lengths=q_lengths, kv_lengths=kv_lengths)
        except (NotImplementedError, ValueError, RuntimeError) as error:
            choice = _refused("cuDNN", error)
    elif choice.kernel == "pallas":
        try:
            out = _pallas_attention(query, key, value, segment_ids, kv_segment_ids, causal=causal, scale=scale)
        except (NotImplementedError, ValueError, RuntimeError, ImportError) as error:
            choice = _refused("Pallas", error)
    if out is None:
        xla = checkpoint_after_gradient(partial(_xla_kernel, causal=causal, scale=scale, dropout_rate=dropout_rate))
        out = xla(query, key, value, bias, full_mask, q_lengths, kv_lengths, dropout_rng)
    _CHOICES[choice] = None
    return out


def _refused(name: str, error: Exception) -> KernelChoice:
    reason = f"{name} refused the inputs ({type(error).__name__}: {error}); fell back to XLA"
    _warn_once(f"attention: {reason}")
    return KernelChoice("xla", reason)


def _segment_mask(mask: jax.Array | None, segment_ids: jax.Array | None,
                  kv_segment_ids: jax.Array | None) -> jax.Array | None:
    if segment_ids is None:
        return mask
    same = (segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    return same if mask is None else same & mask


def _xla_kernel(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
                q_lengths: jax.Array | None, kv_lengths: jax.Array | None, dropout_rng: jax.Array | None, *,
                causal: bool, scale: float, dropout_rate: float) -> jax.Array:
    """XLA's attention; queries longer than :data:`_QUERY_BLOCK` go in blocks, one block's scores at a time."""
    length = query.shape[1]
    if length <= _QUERY_BLOCK:
        return _xla_block(query, key, value, bias, mask, q_lengths, kv_lengths, dropout_rng, None, causal=causal,
                          scale=scale, dropout_rate=dropout_rate)
    count = math.ceil(length / _QUERY_BLOCK)
    size = math.ceil(length / count)
    padded = count * size

    def along_queries(x: jax.Array | None, axis: int) -> jax.Array | None:
        if x is None or x.shape[axis] == 1:  # broadcast along the queries: the same for every block
            return x
        return jnp.pad(x, [(0, padded - length if i == axis else 0) for i in range(x.ndim)])

    blocks = _QueryBlocks(count, size, causal, scale, dropout_rate)
    out = _blocked_attention(blocks, along_queries(query, 1), key, value, along_queries(bias, 2),
                             along_queries(mask, 2), kv_lengths, dropout_rng)[:, :length]
    if q_lengths is not None:
        out = jnp.where((jnp.arange(length)[None, :] < q_lengths[:, None])[:, :, None, None], out, 0).astype(out.dtype)
    return out


class _QueryBlocks(NamedTuple):
    """How :func:`_blocked_attention` splits the (padded) queries, and the attention's static options."""

    count: int
    size: int
    causal: bool
    scale: float
    dropout_rate: float

    def cut(self, x: jax.Array | None, axis: int, start: jax.Array) -> jax.Array | None:
        """Block ``start`` of ``x`` along the queries' ``axis`` (``x`` as it is where it broadcasts there)."""
        return x if x is None or x.shape[axis] == 1 else jax.lax.dynamic_slice_in_dim(x, start, self.size, axis=axis)

    def attend(self, index: jax.Array, query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
               mask: jax.Array | None, kv_lengths: jax.Array | None, dropout_rng: jax.Array | None) -> jax.Array:
        """Block ``index``'s output from its queries (and bias) against every key."""
        start = index * self.size
        rng = None if dropout_rng is None else jax.random.fold_in(dropout_rng, index)
        return _xla_block(query, key, value, bias, self.cut(mask, 2, start), None, kv_lengths, rng, start,
                          causal=self.causal, scale=self.scale, dropout_rate=self.dropout_rate)


def _zeros_after(shape: tuple[int, ...], dtype: Any, anchor: jax.Array) -> jax.Array:
    """Zeros that XLA cannot allocate before ``anchor`` exists (a loop's start buffer, made after its input).

    A plain ``jnp.zeros`` is a constant: XLA shares it between the layers' loops and schedules each
    loop's copy early, in the forward pass, so every layer's backward buffers would live at once.
    A non-finite first entry of ``anchor`` makes them non-finite (an incoming gradient's would make
    the gradients so anyway; the forward loop overwrites its buffer whole).
    """
    return jnp.zeros(shape, dtype) + (anchor.reshape(-1)[0] * 0).astype(dtype)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _blocked_attention(blocks: _QueryBlocks, query: jax.Array, key: jax.Array, value: jax.Array,
                       bias: jax.Array | None, mask: jax.Array | None, kv_lengths: jax.Array | None,
                       dropout_rng: jax.Array | None) -> jax.Array:
    """Attention one block of queries at a time (``fori_loop``): one block's scores exist at a time.

    The backward pass (a loop of its own) recomputes each block's scores from the inputs, the only
    residuals, and accumulates the keys' and values' gradients in float32.
    """

    def body(index: jax.Array, out: jax.Array) -> jax.Array:
        start = index * blocks.size
        block = blocks.attend(index, blocks.cut(query, 1, start), key, value, blocks.cut(bias, 2, start), mask,
                              kv_lengths, dropout_rng)
        return jax.lax.dynamic_update_slice_in_dim(out, block.astype(out.dtype), start, axis=1)

    out = _zeros_after((*query.shape[:-1], value.shape[-1]), value.dtype, query)
    return jax.lax.fori_loop(0, blocks.count, body, out)


def _blocked_forward(blocks: _QueryBlocks, *args: Any) -> tuple[jax.Array, tuple[Any, ...]]:
    return _blocked_attention(blocks, *args), args


def _blocked_backward(blocks: _QueryBlocks, residuals: tuple[Any, ...], grad: jax.Array) -> tuple[Any, ...]:
    query, key, value, bias, mask, kv_lengths, dropout_rng = residuals

    def body(index: jax.Array, grads: tuple[Any, ...]) -> tuple[Any, ...]:
        query_grad, key_grad, value_grad, bias_grad = grads
        start = index * blocks.size

        def attend(q: jax.Array, k: jax.Array, v: jax.Array, b: jax.Array | None) -> jax.Array:
            return blocks.attend(index, q, k, v, b, mask, kv_lengths, dropout_rng)

        _, pullback = jax.vjp(attend, blocks.cut(query, 1, start), key, value, blocks.cut(bias, 2, start))
        q, k, v, b = pullback(jax.lax.dynamic_slice_in_dim(grad, start, blocks.size, axis=1))
        query_grad = jax.lax.dynamic_update_slice_in_dim(query_grad, q.astype(query_grad.dtype), start, axis=1)
        if bias is not None:
            bias_grad = (bias_grad + b.astype(bias_grad.dtype) if bias.shape[2] == 1
                         else jax.lax.dynamic_update_slice_in_dim(bias_grad, b.astype(bias_grad.dtype), start, axis=2))
        return query_grad, key_grad + k, value_grad + v, bias_grad

    # Each gradient buffer starts after the incoming gradient exists (see _zeros_after).
    grads = (_zeros_after(query.shape, query.dtype, grad), _zeros_after(key.shape, jnp.float32, grad),
             _zeros_after(value.shape, jnp.float32, grad),
             None if bias is None else _zeros_after(bias.shape, jnp.float32, grad))
    query_grad, key_grad, value_grad, bias_grad = jax.lax.fori_loop(0, blocks.count, body, grads)
    bias_grad = None if bias is None else bias_grad.astype(bias.dtype)
    return query_grad, key_grad.astype(key.dtype), value_grad.astype(value.dtype), bias_grad, None, None, None


_blocked_attention.defvjp(_blocked_forward, _blocked_backward)


def _xla_block(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None, mask: jax.Array | None,
               q_lengths: jax.Array | None, kv_lengths: jax.Array | None, dropout_rng: jax.Array | None,
               offset: jax.Array | None, *, causal: bool, scale: float, dropout_rate: float) -> jax.Array:
    """Queries from position ``offset`` (None: 0, the whole sequence) against every key."""
    if causal and offset is not None:  # a block of queries: the causal mask starts at its offset
        rows = offset + jnp.arange(query.shape[1])
        below = (jnp.arange(key.shape[1])[None, :] <= rows[:, None])[None, None]
        mask, causal = below if mask is None else mask & below, False
    if dropout_rate:
        return explicit_attention(query, key, value, causal=causal, bias=bias, mask=mask, q_lengths=q_lengths,
                                  kv_lengths=kv_lengths, scale=scale, dropout_rate=dropout_rate,
                                  dropout_rng=dropout_rng)
    return _xla_attention(query, key, value, bias, mask, causal=causal, scale=scale, q_lengths=q_lengths,
                          kv_lengths=kv_lengths)


def _xla_attention(query: jax.Array, key: jax.Array, value: jax.Array, bias: jax.Array | None,
                   mask: jax.Array | None, *, causal: bool, scale: float, q_lengths: jax.Array | None,
                   kv_lengths: jax.Array | None, implementation: str = "xla") -> jax.Array:
    # is_causal, not a boolean causal mask: cuDNN turns any mask into a full-size bias, but skips
    # the masked blocks of a causal one.
    return jax.nn.dot_product_attention(query, key, value, bias=bias, mask=mask, scale=scale, is_causal=causal,
                                        query_seq_lengths=q_lengths, key_value_seq_lengths=kv_lengths,
                                        implementation=implementation)


def _cudnn_attention(*args: Any, **kwargs: Any) -> jax.Array:
    """:func:`_xla_attention`'s call on cuDNN's fused kernel (a name of its own, so tests can stand in for it)."""
    return _xla_attention(*args, **kwargs, implementation="cudnn")


def _pallas_attention(query: jax.Array, key: jax.Array, value: jax.Array, segment_ids: jax.Array | None,
                      kv_segment_ids: jax.Array | None, *, causal: bool, scale: float) -> jax.Array:
    from jax.experimental.pallas.ops.tpu import flash_attention as pallas

    segments = None if segment_ids is None else pallas.SegmentIds(segment_ids.astype(jnp.int32),
                                                                  kv_segment_ids.astype(jnp.int32))
    heads_first = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731  the kernel takes (B, N, T, H)
    out = pallas.flash_attention(heads_first(query), heads_first(key), heads_first(value), segment_ids=segments,
                                 causal=causal, sm_scale=scale)
    return heads_first(out)


def explicit_attention(query: jax.Array, key: jax.Array, value: jax.Array, *, causal: bool = False,
                       bias: jax.Array | None = None, mask: jax.Array | None = None,
                       q_lengths: jax.Array | None = None, kv_lengths: jax.Array | None = None,
                       scale: float | None = None, dropout_rate: float = 0.0,
                       dropout_rng: jax.Array | None = None) -> jax.Array:
    """Attention with the weights written out (scores and softmax in float32): the form attention dropout needs.

    The same arguments as :func:`attention` (segment ids already folded into ``mask``); the dropout
    mask is ``jax.random.bernoulli(dropout_rng, 1 - dropout_rate)`` on the ``(B, N, T, S)`` weights,
    kept weights scaled by ``1 / (1 - dropout_rate)``, as ``nnx.Dropout`` does.

    Example:
        >>> q = jnp.ones((1, 3, 2, 8))
        >>> bool(jnp.allclose(explicit_attention(q, q, q, causal=True), attention(q, q, q, causal=True)))
        True
    """
    t, s = query.shape[1], key.shape[1]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    logits = jnp.einsum("btnh,bsnh->bnts", query, key, preferred_element_type=jnp.float32) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    keep = jnp.ones((1, 1, t, s), bool)
    if causal:
        keep = keep & jnp.tril(jnp.ones((t, s), bool))[None, None]
    if mask is not None:
        keep = keep & mask
    if kv_lengths is not None:
        keep = keep & (jnp.arange(s)[None, None, None, :] < kv_lengths[:, None, None, None])
    weights = jax.nn.softmax(jnp.where(keep, logits, jnp.finfo(jnp.float32).min), axis=-1)
    if dropout_rate:
        kept = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jax.lax.select(kept, weights / (1.0 - dropout_rate), jnp.zeros_like(weights))
    out = jnp.einsum("bnts,bsnh->btnh", weights.astype(value.dtype), value)
    if q_lengths is not None:
        out = jnp.where((jnp.arange(t)[None, :] < q_lengths[:, None])[:, :, None, None], out, 0).astype(out.dtype)
    return out
