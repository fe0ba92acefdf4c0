"""Text generation for GPT2 and Llama: greedy or temperature/top-k sampling with a KV cache.

:func:`generate` prefills a fixed-size cache (prompt + new tokens) with the prompt, then decodes one
token per ``lax.fori_loop`` step; it compiles once per (batch, prompt length, ``max_new_tokens``,
greedy or not, ``top_k``) and the model's structure. :func:`generate_without_cache` recomputes the
full forward pass at every step and is the reference the cached path is tested against. Both draw
step ``i``'s token with ``jax.random.fold_in(rng, i)``, so with the same ``rng`` they sample the same.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from composerjax.models.gpt2 import GPT2
from composerjax.models.llama import Llama

__all__ = ["generate", "generate_without_cache", "sample_logits"]


def sample_logits(logits: jax.Array, key: jax.Array | None, temperature: float | jax.Array = 0.0,
                  top_k: int | None = None, *, greedy: bool | None = None) -> jax.Array:
    """Next tokens ``(B,)`` from ``(B, V)`` logits: the argmax when greedy, else a draw from
    ``softmax(logits / temperature)`` restricted to the ``top_k`` largest logits.

    ``greedy`` defaults to ``temperature == 0`` (pass it when ``temperature`` is traced).

    Example:
        >>> sample_logits(jnp.array([[0.0, 2.0, 1.0]]), None).tolist()
        [1]
    """
    if greedy is None:
        greedy = float(temperature) == 0.0
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _key_of(rng: Any, greedy: bool) -> jax.Array:
    if rng is None:
        if not greedy:
            raise ValueError("rng=None: sampling (temperature > 0) needs a jax.random key or an integer seed")
        return jax.random.key(0)
    if isinstance(rng, (int, np.integer)) and not isinstance(rng, bool):
        return jax.random.key(int(rng))
    if isinstance(rng, jax.Array) and jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return rng
    if isinstance(rng, jax.Array) and rng.dtype == jnp.uint32 and rng.shape == (2,):
        return jax.random.wrap_key_data(rng)
    raise ValueError(f"rng={rng!r}: expected a jax.random key, a raw uint32[2] key or an integer seed")


def _check(model: Any, prompt_tokens: Any, max_new_tokens: Any, temperature: Any, top_k: Any,
           rng: Any) -> tuple[jax.Array, float, jax.Array]:
    if not isinstance(model, (GPT2, Llama)):
        raise ValueError(f"model={type(model).__name__}: expected a composerjax.models.GPT2 or Llama")
    config = model.config
    prompt = jnp.asarray(prompt_tokens)
    if prompt.ndim != 2 or prompt.shape[0] < 1 or prompt.shape[1] < 1 or not jnp.issubdtype(prompt.dtype, jnp.integer):
        raise ValueError(f"prompt_tokens: shape {prompt.shape} dtype {prompt.dtype}, expected a non-empty "
                         "(batch, length) integer array")
    if not isinstance(prompt, jax.core.Tracer) and (int(prompt.min()) < 0 or int(prompt.max()) >= config.vocab_size):
        raise ValueError(f"prompt_tokens: ids from {int(prompt.min())} to {int(prompt.max())}, expected 0 to "
                         f"vocab_size - 1 = {config.vocab_size - 1}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: expected a positive integer")
    if prompt.shape[1] + max_new_tokens > config.n_positions:
        raise ValueError(f"max_new_tokens={max_new_tokens}: the prompt ({prompt.shape[1]} tokens) plus the new tokens "
                         f"exceed n_positions={config.n_positions}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
        raise ValueError(f"temperature={temperature!r}: expected a number >= 0 (0 is greedy)")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or not 1 <= top_k <= config.vocab_size):
        raise ValueError(f"top_k={top_k!r}: expected None or an integer from 1 to vocab_size={config.vocab_size}")
    greedy = temperature == 0
    return prompt.astype(jnp.int32), float(temperature), _key_of(rng, greedy)


def generate(model: GPT2 | Llama, prompt_tokens: Any, max_new_tokens: int, *, temperature: float = 0.0,
             top_k: int | None = None, rng: Any = None) -> jax.Array:
    """The prompt followed by ``max_new_tokens`` generated tokens, ``(B, P + max_new_tokens)``, using a KV cache.

    Args:
        model: a :class:`GPT2` or :class:`~composerjax.models.llama.Llama` (run without dropout, whatever its
            train/eval mode).
        prompt_tokens: ``(B, P)`` integer token ids, the same length for every sequence.
        max_new_tokens: how many tokens to add; ``P + max_new_tokens`` must fit ``n_positions``.
        temperature: 0 takes the argmax (greedy); above 0, logits are divided by it and sampled.
        top_k: when sampling, only the ``top_k`` most likely tokens are candidates.
        rng: a ``jax.random`` key or an integer seed; required when ``temperature > 0``.

    Raises:
        ValueError: naming the argument, its value and what is accepted.

    Example:
        >>> from composerjax.models.gpt2 import GPT2Config
        >>> model = GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
        >>> generate(model, jnp.array([[1, 2, 3]]), 4).shape
        (1, 7)
    """
    prompt, temperature, key = _check(model, prompt_tokens, max_new_tokens, temperature, top_k, rng)
    graphdef, state = nnx.split(model)
    new = _generate_cached(graphdef, state, prompt, key, jnp.float32(temperature or 1.0),
                           max_new_tokens=max_new_tokens, greedy=temperature == 0, top_k=top_k)
    return jnp.concatenate([prompt, new], axis=1)


def generate_without_cache(model: GPT2 | Llama, prompt_tokens: Any, max_new_tokens: int, *, temperature: float = 0.0,
                           top_k: int | None = None, rng: Any = None) -> jax.Array:
    """:func:`generate` without a cache: the whole sequence's forward pass at every step (the reference).

    The sequence lives in a ``(B, P + max_new_tokens)`` buffer; position ``t``'s logits read only
    tokens up to ``t`` (the model is causal), so the unfilled tail does not matter.

    Example:
        >>> from composerjax.models.gpt2 import GPT2Config
        >>> model = GPT2(GPT2Config.preset("gpt2-tiny"), rngs=nnx.Rngs(0))
        >>> prompt = jnp.array([[1, 2, 3]])
        >>> bool((generate_without_cache(model, prompt, 4) == generate(model, prompt, 4)).all())
        True
    """
    prompt, temperature, key = _check(model, prompt_tokens, max_new_tokens, temperature, top_k, rng)
    graphdef, state = nnx.split(model)
    new = _generate_uncached(graphdef, state, prompt, key, jnp.float32(temperature or 1.0),
                             max_new_tokens=max_new_tokens, greedy=temperature == 0, top_k=top_k)
    return jnp.concatenate([prompt, new], axis=1)


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k"))
def _generate_cached(graphdef: nnx.GraphDef, state: nnx.State, prompt: jax.Array, key: jax.Array,
                     temperature: jax.Array, *, max_new_tokens: int, greedy: bool, top_k: int | None) -> jax.Array:
    model = nnx.merge(graphdef, state)
    batch, length = prompt.shape
    cache = model.init_cache(batch, length + max_new_tokens)
    logits, cache = model.decode(prompt, 0, cache, deterministic=True)
    first = sample_logits(logits[:, -1], jax.random.fold_in(key, 0), temperature, top_k, greedy=greedy)
    new = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(first)

    def step(i: jax.Array, carry: tuple[jax.Array, Any]) -> tuple[jax.Array, Any]:
        new, cache = carry
        logits, cache = model.decode(jax.lax.dynamic_slice_in_dim(new, i - 1, 1, axis=1), length + i - 1, cache,
                                     deterministic=True)
        token = sample_logits(logits[:, -1], jax.random.fold_in(key, i), temperature, top_k, greedy=greedy)
        return new.at[:, i].set(token), cache

    new, _ = jax.lax.fori_loop(1, max_new_tokens, step, (new, cache))
    return new


@partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "greedy", "top_k"))
def _generate_uncached(graphdef: nnx.GraphDef, state: nnx.State, prompt: jax.Array, key: jax.Array,
                       temperature: jax.Array, *, max_new_tokens: int, greedy: bool, top_k: int | None) -> jax.Array:
    model = nnx.merge(graphdef, state)
    batch, length = prompt.shape
    sequence = jnp.concatenate([prompt, jnp.zeros((batch, max_new_tokens), jnp.int32)], axis=1)

    def step(i: jax.Array, sequence: jax.Array) -> jax.Array:
        logits = model(sequence, deterministic=True)
        last = jax.lax.dynamic_index_in_dim(logits, length + i - 1, axis=1, keepdims=False)
        token = sample_logits(last, jax.random.fold_in(key, i), temperature, top_k, greedy=greedy)
        return jax.lax.dynamic_update_slice_in_dim(sequence, token[:, None], length + i, axis=1)

    return jax.lax.fori_loop(0, max_new_tokens, step, sequence)[:, length:]
