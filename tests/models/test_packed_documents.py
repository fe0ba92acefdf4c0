"""Packing without leaks: a packed batch's loss is the token-weighted loss of each document run alone."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from composerjax.data import IGNORE_INDEX, PackedSequences, pack_documents
from composerjax.models.attention import positions_from_segments
from composerjax.models.causal_lm import ComposerCausalLM
from composerjax.models.gpt2 import GPT2, GPT2Config

EOS = 0
SEQ_LEN = 24


def documents(seed=0):
    # Lengths chosen so rows hold several documents and some documents span two rows.
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 500, size=length).tolist() for length in (5, 9, 3, 17, 1, 7, 12, 4, 20, 6)]


def packed_batch(docs):
    windows, document_ids = pack_documents(docs, SEQ_LEN, EOS, segment_ids=True)
    source = PackedSequences(windows, segment_ids=document_ids)
    rows = [source[index] for index in range(len(source))]
    return tuple(np.stack([row[part] for row in rows]) for part in range(3))


def model(position, **overrides):
    config = GPT2Config.preset("gpt2-tiny", position=position, **overrides)
    module = GPT2(config, rngs=nnx.Rngs(0))
    module.eval()
    return ComposerCausalLM(module)


def runs(segment_ids):
    """``(row, start, stop)`` of every run of equal segment ids."""
    found = []
    for row, ids in enumerate(np.asarray(segment_ids)):
        start = 0
        for index in range(1, len(ids) + 1):
            if index == len(ids) or ids[index] != ids[start]:
                found.append((row, start, index))
                start = index
    return found


def alone_losses(lm, inputs, targets, segment_ids):
    """Sum of cross-entropies and target count, each document piece run by itself (batch of one, no segment ids)."""
    total, count = 0.0, 0
    for row, start, stop in runs(segment_ids):
        logits = np.asarray(lm.module(jnp.asarray(inputs[row:row + 1, start:stop])), np.float64)[0]
        wanted = targets[row, start:stop]
        keep = wanted != IGNORE_INDEX
        log_probs = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
            - logits.max(-1, keepdims=True)
        total += -log_probs[np.flatnonzero(keep), wanted[keep]].sum()
        count += int(keep.sum())
    return total, count


def test_positions_restart_at_every_segment():
    ids = jnp.array([[4, 4, 4, 9, 9, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1, 1, 1, 1]])
    assert positions_from_segments(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], list(range(9))]


@pytest.mark.parametrize("position, overrides", [
    ("learned", {}), ("rotary", {}), ("alibi", {}), ("rotary", {"scan_layers": True, "remat": "dots"}),
])
def test_the_loss_of_a_packed_batch_is_the_token_weighted_loss_of_each_document_alone(position, overrides):
    inputs, targets, segment_ids = packed_batch(documents())
    assert inputs.shape[0] >= 3 and len(runs(segment_ids)) > inputs.shape[0]  # several documents per row
    lm = model(position, **overrides)
    batch = (jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(segment_ids))
    packed_loss = float(lm.loss(lm.forward(batch), batch))
    total, count = alone_losses(lm, inputs, targets, segment_ids)
    assert count == int((targets != IGNORE_INDEX).sum())
    # float32 throughout, reductions of other lengths: equal to 1e-6 relative (a few float32 ulps of the mean)
    assert packed_loss == pytest.approx(total / count, rel=1e-6, abs=0)


@pytest.mark.parametrize("position", ["learned", "rotary"])
def test_without_segment_ids_the_packed_loss_differs(position):
    # The control: the same batch as (inputs, targets) attends across documents and counts positions on.
    inputs, targets, segment_ids = packed_batch(documents())
    lm = model(position)
    plain = (jnp.asarray(inputs), jnp.asarray(targets))
    total, count = alone_losses(lm, inputs, targets, segment_ids)
    assert abs(float(lm.loss(lm.forward(plain), plain)) - total / count) > 1e-3


@pytest.mark.parametrize("position", ["learned", "rotary", "alibi"])
def test_no_token_attends_across_a_document_boundary(position):
    docs = documents()
    inputs, _, segment_ids = packed_batch(docs)
    changed = [list(doc) for doc in docs]
    changed[3] = [(token % 498) + 1 for token in changed[3]]  # every token of document 3 replaced
    changed_inputs, _, changed_segments = packed_batch(changed)
    np.testing.assert_array_equal(segment_ids, changed_segments)
    lm = model(position)
    first = np.asarray(lm.module(jnp.asarray(inputs), segment_ids=jnp.asarray(segment_ids)))
    second = np.asarray(lm.module(jnp.asarray(changed_inputs), segment_ids=jnp.asarray(segment_ids)))
    _, document_ids = pack_documents(docs, SEQ_LEN, EOS, segment_ids=True)
    other = document_ids[:, :-1] != 3
    assert (~other).sum() >= 17 and other.sum() > 0
    np.testing.assert_array_equal(first[other], second[other])
    assert np.abs(first[~other] - second[~other]).max() > 1e-3
    plain_first = np.asarray(lm.module(jnp.asarray(inputs)))
    plain_second = np.asarray(lm.module(jnp.asarray(changed_inputs)))
    later = other & (document_ids[:, :-1] > 3)
    assert np.abs(plain_first[later] - plain_second[later]).max() > 1e-3  # the control: without them it leaks


def test_a_packed_batch_trains_through_the_compiled_gradient():
    # The third batch element reaches the model inside jax.grad too (not only in eager forward calls).
    inputs, targets, segment_ids = packed_batch(documents())
    lm = model("rotary")
    graphdef, params, rest = nnx.split(lm.module, nnx.Param, ...)
    batch = (jnp.asarray(inputs), jnp.asarray(targets), jnp.asarray(segment_ids))

    @jax.jit
    def loss(params):
        traced = ComposerCausalLM(nnx.merge(graphdef, params, rest))
        return traced.loss(traced.forward(batch), batch)

    total, count = alone_losses(model("rotary"), inputs, targets, segment_ids)
    assert float(loss(params)) == pytest.approx(total / count, rel=1e-6, abs=0)
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(jax.grad(loss)(params)))


def test_the_trainer_fits_and_evaluates_packed_batches_with_microbatches():
    import optax

    from composerjax import Trainer
    from composerjax.data import stdlib_lm
    from composerjax.models.factories import gpt2

    data = stdlib_lm(seq_len=32, batch_size=4, vocab_size=300, max_files=6, segment_ids=True)
    lm = gpt2("gpt2-tiny", vocab_size=300, n_positions=32, n_embd=32, n_layer=1, position="rotary")
    trainer = Trainer(lm, data.train, max_duration="3ba", optimizers=optax.adamw(3e-3), eval_dataloader=data.eval,
                      progress_bar=False, run_summary=False, device_train_microbatch_size=2)
    trainer.fit()
    metrics = trainer.eval()
    lm.module.eval()
    total = count = 0.0
    for batch in data.eval:
        batch = tuple(jnp.asarray(part) for part in batch)
        kept = int((batch[1] != IGNORE_INDEX).sum())
        total += float(lm.loss(lm.forward(batch), batch)) * kept
        count += kept
    assert float(metrics["LanguageCrossEntropy"]) == pytest.approx(total / count, rel=1e-5)
