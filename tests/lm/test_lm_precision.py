"""Mixed precision on GPT-2, read from the compiled train step itself (its StableHLO).

``amp_bf16`` keeps the parameters and the AdamW state in float32 and feeds the matmuls bfloat16
operands; ``fp32`` computes them in float32; ``bf16`` keeps everything in bfloat16.

What the lowered step shows for ``amp_bf16`` (and ``bf16``): every forward and backward matmul has
two bfloat16 operands, except two per layer, in the backward pass of attention. ``jax.nn.dot_product_attention``
computes the attention scores with ``preferred_element_type=float32`` (softmax in float32, on purpose),
so the cotangent of the scores is float32, and the two dots that carry it back to the queries and
the keys take one float32 operand (the scores' gradient) and one bfloat16 operand (keys or queries).
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.models.factories import gpt2

BATCH, SEQ_LEN, N_HEAD, N_LAYER, VOCAB = 4, 16, 2, 2, 300
DOT = re.compile(r"stablehlo\.dot(?:_general)?\b.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def tensor(text: str) -> tuple[tuple[int, ...], str]:
    """``'tensor<4x16x300xbf16>'`` -> ``((4, 16, 300), 'bf16')``."""
    *dims, dtype = text.removeprefix("tensor<").removesuffix(">").split("x")
    return tuple(int(dim) for dim in dims), dtype


def dots(trainer: Trainer, batch) -> list[tuple[tuple, tuple, tuple]]:
    """``(lhs, rhs, result)`` of every dot in the lowered train step, each ``(shape, dtype)``."""
    text = trainer.builder.train_step(()).lower(trainer.state.train_state, batch).as_text()
    assert "dot" not in DOT.sub("", text).replace("dot_product", "")  # every dot op was parsed
    return [tuple(tensor(part) for part in match.groups()) for match in DOT.finditer(text)]


def trained(precision: str) -> tuple[Trainer, tuple[np.ndarray, np.ndarray]]:
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2 * BATCH, SEQ_LEN + 1)).astype(np.int32)
    model = gpt2("gpt2-tiny", vocab_size=VOCAB, n_positions=SEQ_LEN, n_embd=32, n_layer=N_LAYER, n_head=N_HEAD)
    trainer = Trainer(model, ArrayLoader((tokens[:, :-1], tokens[:, 1:]), batch_size=BATCH), "1ba",
                      optax.adamw(1e-3), precision=precision, progress_bar=False, run_summary=False)
    trainer.fit()
    return trainer, (tokens[:BATCH, :-1], tokens[:BATCH, 1:])


def floating_dtypes(tree) -> Counter:
    return Counter(str(leaf.dtype) for leaf in jax.tree.leaves(tree) if jnp.issubdtype(leaf.dtype, jnp.floating))


@pytest.fixture(scope="module")
def fp32_dots():
    trainer, batch = trained("fp32")
    assert set(floating_dtypes(trainer.state.train_state.params)) == {"float32"}
    return dots(trainer, batch)


def attention_score_sized(shape: tuple[int, ...]) -> bool:
    return int(np.prod(shape)) == BATCH * N_HEAD * SEQ_LEN * SEQ_LEN


def test_fp32_computes_every_dot_in_float32(fp32_dots):
    assert len(fp32_dots) >= 10 * N_LAYER
    assert {(lhs[1], rhs[1], out[1]) for lhs, rhs, out in fp32_dots} == {("f32", "f32", "f32")}


@pytest.mark.parametrize("precision, weights", [("amp_bf16", "float32"), ("bf16", "bfloat16")])
def test_bf16_precisions_feed_bf16_to_every_matmul_and_keep_the_weights_dtype(fp32_dots, precision, weights):
    trainer, batch = trained(precision)
    state = trainer.state.train_state
    params, opt_floats = floating_dtypes(state.params), floating_dtypes(state.opt_state)
    assert set(params) == {weights} and sum(params.values()) == len(jax.tree.leaves(state.params))
    assert set(opt_floats) == {weights} and sum(opt_floats.values()) == 2 * len(jax.tree.leaves(state.params))
    assert trainer.state.model.module.config.dtype is None  # the step's cast decides, not the model

    found = dots(trainer, batch)
    assert len(found) == len(fp32_dots)  # the same program, in another dtype
    mixed = [(lhs, rhs, out) for lhs, rhs, out in found if (lhs[1], rhs[1]) != ("bf16", "bf16")]
    # Two per layer: attention's score gradient (float32, from its float32 softmax) times bf16 keys/queries.
    assert len(mixed) == 2 * N_LAYER
    for lhs, rhs, out in mixed:
        f32 = [operand for operand in (lhs, rhs) if operand[1] == "f32"]
        assert len(f32) == 1 and attention_score_sized(f32[0][0]), (lhs, rhs, out)
        assert {lhs[1], rhs[1]} == {"f32", "bf16"}
    assert len(found) - len(mixed) >= 8 * N_LAYER  # every projection, MLP and LM-head matmul, both passes
    weight_shapes = {tuple(leaf.shape) for leaf in jax.tree.leaves(state.params) if leaf.ndim == 2}
    weight_dots = [dot for dot in found if dot[0][0] in weight_shapes or dot[1][0] in weight_shapes]
    assert len(weight_dots) >= 4 * N_LAYER
    assert all(lhs[1] == rhs[1] == "bf16" for lhs, rhs, _ in weight_dots)
