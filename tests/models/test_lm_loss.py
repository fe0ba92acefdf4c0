"""The chunked LM loss: equal to the plain cross-entropy and its gradients, without the whole batch's logits."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.models.causal_lm import ComposerCausalLM, LMOutputs
from composerjax.models.factories import gpt2
from composerjax.models.gpt import language_metrics
from composerjax.models.gpt2 import GPT2, GPT2Config
from composerjax.models.lm_loss import chunk_length, cross_entropy_loss, token_cross_entropy, token_statistics

B, T, D, VOCAB, ROWS = 3, 13, 16, 37, 64  # a vocabulary of 37 tokens in a head padded to 64 rows


@pytest.fixture(scope="module")
def problem():
    keys = jax.random.split(jax.random.key(0), 4)
    hidden = jax.random.normal(keys[0], (B, T, D))
    weight = jax.random.normal(keys[1], (ROWS, D)).at[VOCAB:].set(50.0)  # padding rows that would win if counted
    targets = jax.random.randint(keys[2], (B, T), 0, VOCAB).at[0, 3].set(-100).at[2, 12].set(-100)
    return hidden, weight, targets


def plain_loss(hidden, weight, targets):
    """The loss as ComposerClassifier computes it: whole float32 logits of the real vocabulary, optax."""
    logits = (hidden @ weight[:VOCAB].T).astype(jnp.float32)
    valid = targets != -100
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.where(valid, targets, 0))
    return jnp.sum(jnp.where(valid, losses, 0.0)) / jnp.sum(valid)


@pytest.mark.parametrize("chunk_size", [None, 1, 4, 5, 13, 100])
def test_chunked_cross_entropy_equals_the_plain_one_value_and_gradients(problem, chunk_size):
    hidden, weight, targets = problem
    # Scaled by 2.5: the gradients computed in the forward pass take the incoming gradient's scale.
    chunked = jax.jit(jax.value_and_grad(
        lambda h, w: 2.5 * cross_entropy_loss(h, w, targets, vocab_size=VOCAB, chunk_size=chunk_size),
        argnums=(0, 1)))
    value, (hidden_grad, weight_grad) = chunked(hidden, weight)
    expected, (expected_hidden, expected_weight) = jax.value_and_grad(
        lambda h, w: 2.5 * plain_loss(h, w, targets), argnums=(0, 1))(hidden, weight)
    np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(hidden_grad, expected_hidden, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(weight_grad, expected_weight, rtol=1e-6, atol=1e-6)
    assert float(jnp.abs(weight_grad[VOCAB:]).max()) == 0.0  # padding rows: masked out, no gradient


@pytest.mark.parametrize("chunk_size", [None, 4, 13])
def test_per_token_cross_entropy_has_the_plain_gradients_for_any_incoming_gradient(problem, chunk_size):
    hidden, weight, targets = problem
    scales = jax.random.uniform(jax.random.key(5), targets.shape)  # a different weight per token
    valid = targets != -100

    def chunked(h, w):
        losses = token_cross_entropy(h, w, jnp.where(valid, targets, -1), vocab_size=VOCAB, chunk_size=chunk_size)
        return jnp.sum(losses * scales)

    def plain(h, w):
        losses = optax.softmax_cross_entropy_with_integer_labels(h @ w[:VOCAB].T, jnp.where(valid, targets, 0))
        return jnp.sum(jnp.where(valid, losses, 0.0) * scales)

    got, expected = jax.jit(jax.grad(chunked, argnums=(0, 1)))(hidden, weight), jax.grad(plain, argnums=(0, 1))(
        hidden, weight)
    for got_grad, expected_grad in zip(got, expected):
        np.testing.assert_allclose(got_grad, expected_grad, rtol=1e-6, atol=1e-6)


def test_per_token_losses_and_predictions_skip_ignored_targets_and_padding_rows(problem):
    hidden, weight, targets = problem
    logits = hidden @ weight[:VOCAB].T
    losses = token_cross_entropy(hidden, weight, jnp.where(targets == -100, -1, targets), vocab_size=VOCAB,
                                 chunk_size=4)
    expected = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.maximum(targets, 0))
    np.testing.assert_allclose(losses, jnp.where(targets == -100, 0.0, expected), rtol=1e-6, atol=1e-6)
    stat_losses, predictions = token_statistics(hidden, weight, targets, vocab_size=VOCAB, chunk_size=5)
    np.testing.assert_allclose(stat_losses, losses, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(predictions, jnp.argmax(logits, -1))  # the 50.0 padding rows never win
    with pytest.raises(ValueError, match="chunk_size=0: expected a positive number"):
        token_cross_entropy(hidden, weight, targets, chunk_size=0)


def test_the_default_chunks_keep_one_chunk_of_logits_under_256_mib():
    assert chunk_length(8, 1024, 50304) == 147  # GPT-2 small at 8 x 1024: 7 chunks of 231 MiB
    assert 8 * 147 * 50304 * 4 <= 256 * 2**20
    assert chunk_length(16, 128, 2048) == 128  # small enough for one chunk: no loop


def float_arrays(hlo: str) -> set[tuple[int, ...]]:
    return {tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"f32\[([\d,]*)\]", hlo)}


def test_the_compiled_gradient_holds_no_whole_batch_logits():
    b, t, d, v = 4, 64, 32, 512
    hidden, weight = jax.random.normal(jax.random.key(0), (2, b, t, d)), jax.random.normal(jax.random.key(1), (v, d))
    targets = jax.random.randint(jax.random.key(2), (b, t), 0, v)
    whole = b * t * v

    def compiled(loss):
        return jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden[0], weight).compile()

    plain = compiled(lambda h, w: optax.softmax_cross_entropy_with_integer_labels(h @ w.T, targets).mean())
    chunked = compiled(lambda h, w: cross_entropy_loss(h, w, targets, chunk_size=8))
    assert any(np.prod(shape) >= whole for shape in float_arrays(plain.as_text()))
    assert all(np.prod(shape) <= whole // 8 for shape in float_arrays(chunked.as_text()))  # one chunk at most
    assert chunked.memory_analysis().temp_size_in_bytes < plain.memory_analysis().temp_size_in_bytes / 3


@pytest.fixture(scope="module")
def module():
    return GPT2(GPT2Config.preset("gpt2-tiny", vocab_size=300, n_positions=16, n_embd=32, n_layer=1),
                rngs=nnx.Rngs(0))


def lm_batch(seed=0, ignored=()):
    tokens = np.random.default_rng(seed).integers(0, 300, size=(4, 17)).astype(np.int32)
    targets = tokens[:, 1:].copy()
    for row, column in ignored:
        targets[row, column] = -100
    return tokens[:, :-1], targets


def test_the_causal_lm_loss_equals_the_classifiers_on_the_whole_logits(module):
    batch = lm_batch()
    lm, classifier = ComposerCausalLM(module, chunk_size=3), ComposerClassifier(module, 300)
    assert module.tokens.embedding.shape == (320, 32)  # 300 tokens padded to 320 rows
    loss_and_grads = nnx.jit(nnx.value_and_grad(lambda model, batch: model.loss(model.forward(batch), batch)))
    lm_loss, lm_grads = loss_and_grads(lm, batch)
    loss, grads = loss_and_grads(classifier, batch)
    np.testing.assert_allclose(lm_loss, loss, rtol=1e-6)
    for (path, got), (_, expected) in zip(nnx.to_flat_state(lm_grads), nnx.to_flat_state(grads), strict=True):
        np.testing.assert_allclose(got[...], expected[...], rtol=1e-5, atol=1e-7, err_msg=str(path))


def test_the_eval_metrics_from_chunked_pieces_equal_the_logits_ones(module):
    batch = lm_batch(1, ignored=[(0, 0), (2, 5), (3, 15)])
    lm = ComposerCausalLM(module, chunk_size=5)
    outputs = lm.eval_forward(batch)
    assert isinstance(outputs, LMOutputs) and outputs.token_losses.shape == (4, 16)
    logits = module(jnp.asarray(batch[0]))
    for name, metric in language_metrics().items():
        got, expected = lm.update_metric(batch, outputs, metric), metric.update(logits, batch[1])
        assert int(got.count) == int(expected.count) == 61
        np.testing.assert_allclose(got.total, expected.total, rtol=1e-6, err_msg=name)
        # Train metrics see forward's outputs (hidden states only): the same state.
        np.testing.assert_allclose(lm.update_metric(batch, lm.forward(batch), metric).total, expected.total,
                                   rtol=1e-6, err_msg=name)


def test_trainer_eval_gives_the_numbers_the_classifier_gives():
    tokens = np.random.default_rng(2).integers(0, 300, size=(24, 17)).astype(np.int32)
    loader = ArrayLoader((tokens[:, :-1], tokens[:, 1:]), batch_size=8, shuffle=False)
    results = []
    for wrap in (lambda m: m, lambda m: ComposerClassifier(m.module, 300, val_metrics=language_metrics())):
        model = wrap(gpt2("gpt2-tiny", vocab_size=300, n_positions=16, n_embd=32, n_layer=1))
        trainer = Trainer(model, loader, "1ba", optax.sgd(0.0), eval_dataloader=loader, progress_bar=False,
                          run_summary=False)
        results.append(trainer.eval())
        assert [step.kind for step in trainer.state.compiled_steps] == ["eval"]
    assert sorted(results[0]) == ["LanguageCrossEntropy", "LanguagePerplexity", "MaskedAccuracy"]
    for name in results[1]:
        assert results[0][name] == pytest.approx(results[1][name], rel=1e-6), name


def test_targets_out_of_the_vocabulary_are_refused_but_ignore_index_passes(module):
    lm = ComposerCausalLM(module)
    inputs, targets = lm_batch(ignored=[(1, 2)])
    lm.check_batch((inputs, targets))
    targets[3, 4] = 300
    with pytest.raises(ValueError, match=r"batch\[1\] \(targets\) holds 300 at index \(3, 4\): expected token ids "
                                         r"from 0 to 299 \(vocab_size=300\) or ignore_index=-100"):
        lm.check_batch((inputs, targets))


DOT = re.compile(r"stablehlo\.dot(?:_general)?\b.*:\s*\((tensor<[^>]*>),\s*(tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def test_under_amp_bf16_the_lm_head_multiplies_bfloat16_and_accumulates_in_float32():
    tokens = np.random.default_rng(0).integers(0, 300, size=(4, 17)).astype(np.int32)
    batch = (tokens[:, :-1], tokens[:, 1:])
    model = gpt2("gpt2-tiny", vocab_size=300, n_positions=16, n_embd=32, n_layer=1)
    trainer = Trainer(model, ArrayLoader(batch, batch_size=4), "1ba", optax.sgd(0.1), precision="amp_bf16",
                      progress_bar=False, run_summary=False)
    trainer.fit()
    text = trainer.builder.train_step(()).lower(trainer.state.train_state, batch).as_text()
    # The head's dots are the ones with the 320 padded vocabulary rows in an operand or the result.
    head = [match.groups() for match in DOT.finditer(text) if "x320x" in "x".join(match.groups()).replace("<", "x")]
    # The logits, then the gradients of the hidden states and of the head: three, as without chunks
    # (the gradients are computed in the forward pass; nothing is recomputed).
    assert len(head) == 3
    for lhs, rhs, out in head:
        assert lhs.endswith("xbf16>") and rhs.endswith("xbf16>") and out.endswith("xf32>"), (lhs, rhs, out)


def test_an_algorithm_that_needs_logits_is_told_to_use_composer_classifier():
    """LMOutputs holds hidden states: LabelSmoothing on the chunked LM fails naming what to use instead."""
    import numpy as np
    import optax

    from composerjax import ArrayLoader, Trainer
    from composerjax.algorithms import LabelSmoothing
    from composerjax.models.factories import gpt2

    x = np.random.default_rng(0).integers(0, 100, size=(8, 17)).astype(np.int32)
    trainer = Trainer(gpt2("gpt2-tiny", vocab_size=128), ArrayLoader((x[:, :-1], x[:, 1:]), batch_size=4), "1ba",
                      optax.adam(1e-3), algorithms=[LabelSmoothing(0.1)], progress_bar=False, run_summary=False)
    with pytest.raises(AttributeError, match=r"LabelSmoothing failed at BEFORE_LOSS: state.outputs is LMOutputs "
                                             r"\(hidden states\), not logits.*ComposerClassifier\(module, vocab_size"):
        trainer.fit()
