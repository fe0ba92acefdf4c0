"""The one attention function: the kernel rule per backend, dtype, head size and mask; XLA's results; fallbacks."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from composerjax import ArrayLoader, Trainer
from composerjax.models import attention as attention_module
from composerjax.models.attention import (
    Backend,
    KernelChoice,
    attention,
    choose_kernel,
    explicit_attention,
    take_attention_choices,
)
from composerjax.models.factories import gpt2
from composerjax.models.gpt2 import alibi_position_bias
from composerjax.models.remat import checkpoint_after_gradient
from composerjax.step.summary import format_compiled

H100 = {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
A100 = {"platform": "gpu", "device_kind": "NVIDIA A100-SXM4-80GB", "compute_capability": "8.0"}


def choose(backend: dict, dtype="bfloat16", head_dim=64, length=1024, **flags) -> KernelChoice:
    return choose_kernel(dtype=dtype, head_dim=head_dim, q_length=length, kv_length=length, **backend, **flags)


@pytest.mark.parametrize(("backend", "inputs", "kernel", "reason"), [
    ({"platform": "cpu"}, {}, "xla", "cpu: no fused attention kernel"),
    (H100, {}, "cudnn", "NVIDIA sm90, bfloat16, head size 64"),
    (A100, {"dtype": "float16", "head_dim": 128}, "cudnn", "NVIDIA sm80, float16, head size 128"),
    (H100, {"head_dim": 256}, "cudnn", "NVIDIA sm90, bfloat16, head size 256"),
    (A100, {"head_dim": 256}, "xla", "head size 256: cuDNN's fused attention on sm80 needs a multiple of 8 up to 128"),
    (H100, {"head_dim": 60}, "xla", "head size 60: cuDNN's fused attention on sm90 needs a multiple of 8 up to 256"),
    (H100, {"head_dim": 264}, "xla", "head size 264: cuDNN's fused attention on sm90 needs a multiple of 8 up to 256"),
    (H100, {"dtype": "float32"}, "xla", "float32 inputs: cuDNN's fused attention takes bfloat16 or float16 "
                                        "(precision='amp_bf16' computes in bfloat16)"),
    ({"platform": "gpu", "compute_capability": "7.5"}, {}, "xla",
     "NVIDIA sm75: cuDNN's fused attention needs Ampere (sm80) or newer"),
    ({"platform": "gpu", "device_kind": "AMD Instinct MI300X"}, {}, "xla",
     "not an NVIDIA CUDA GPU: cuDNN's fused attention needs one"),
    (H100, {"has_dropout": True}, "xla", "attention dropout is active: no fused kernel takes a JAX dropout key, so "
                                         "the weights are dropped explicitly"),
    (H100, {"has_bias": True}, "cudnn", "NVIDIA sm90, bfloat16, head size 64"),  # ALiBi on the fused kernel
    (H100, {"has_segments": True}, "cudnn", "NVIDIA sm90, bfloat16, head size 64"),
    (H100, {"has_mask": True, "length": 1}, "xla", "a bias or mask with sequence lengths 1 x 1: cuDNN needs them even"),
    (H100, {"requested": "xla"}, "xla", "attention='xla' requested"),
    ({"platform": "cpu"}, {"requested": "cudnn"}, "xla", "attention='cudnn' requested, but cpu has no cuDNN"),
    (H100, {"requested": "cudnn", "dtype": "float32"}, "xla",
     "attention='cudnn' requested, but float32 inputs: cuDNN's fused attention takes bfloat16 or float16 "
     "(precision='amp_bf16' computes in bfloat16)"),
    ({"platform": "tpu", "device_kind": "TPU v5 lite"}, {"dtype": "float32"}, "pallas", "tpu: Pallas flash attention"),
    ({"platform": "tpu"}, {"has_segments": True}, "pallas", "tpu: Pallas flash attention"),
    ({"platform": "tpu"}, {"has_bias": True}, "xla", "tpu: a bias, which the Pallas flash kernel is not given"),
    ({"platform": "tpu"}, {"length": 100}, "xla",
     "tpu: sequence lengths 100 x 100 are not multiples of the Pallas kernel's 128-token blocks"),
])
def test_kernel_choice_per_backend_dtype_head_size_and_mask(backend, inputs, kernel, reason):
    assert choose(backend, **inputs) == KernelChoice(kernel, reason)


def test_an_unknown_implementation_is_refused_with_the_accepted_values():
    with pytest.raises(ValueError, match=r"implementation='flash': expected one of 'auto', 'xla', 'cudnn'"):
        choose(H100, requested="flash")
    q = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match=r"dropout_rate=0.1\): dropout needs dropout_rng"):
        attention(q, q, q, dropout_rate=0.1)


def reference(q, k, v, *, causal=False, bias=None, mask=None, kv_lengths=None, q_lengths=None):
    """Attention in float64 numpy, written out: softmax(q k^T / sqrt(H) + bias) v over the allowed keys."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    scores = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
    if bias is not None:
        scores = scores + np.asarray(bias, np.float64)
    allowed = np.ones(scores.shape, bool)
    t, s = scores.shape[2:]
    if causal:
        allowed &= np.tril(np.ones((t, s), bool))
    if mask is not None:
        allowed &= np.asarray(mask)
    if kv_lengths is not None:
        allowed &= np.arange(s)[None, None, None, :] < np.asarray(kv_lengths)[:, None, None, None]
    scores = np.where(allowed, scores, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    out = np.einsum("bnts,bsnh->btnh", weights / weights.sum(-1, keepdims=True), v)
    if q_lengths is not None:
        out = np.where((np.arange(t)[None, :] < np.asarray(q_lengths)[:, None])[:, :, None, None], out, 0.0)
    return out


def qkv(batch=2, length=8, heads=2, head_dim=16, seed=0):
    return jax.random.normal(jax.random.key(seed), (3, batch, length, heads, head_dim))


def test_the_dispatcher_equals_the_reference_for_causal_padded_segmented_and_alibi_inputs():
    q, k, v = qkv()
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2, 3]])
    lengths = jnp.array([8, 5], jnp.int32)
    alibi = alibi_position_bias(2, jnp.arange(8), jnp.arange(8))
    same_segment = np.asarray(segments[:, None, :, None] == segments[:, None, None, :])
    cases = [
        ({"causal": True}, {"causal": True}),
        ({"causal": True, "kv_lengths": lengths, "q_lengths": lengths},
         {"causal": True, "kv_lengths": lengths, "q_lengths": lengths}),
        ({"causal": True, "segment_ids": segments}, {"causal": True, "mask": same_segment}),
        ({"causal": True, "bias": alibi}, {"causal": True, "bias": alibi}),
        ({"causal": True, "bias": alibi, "segment_ids": segments},
         {"causal": True, "bias": alibi, "mask": same_segment}),
    ]
    for given, expected in cases:
        np.testing.assert_allclose(jax.jit(lambda q, k, v, given=given: attention(q, k, v, **given))(q, k, v),
                                   reference(q, k, v, **expected), atol=2e-6, err_msg=str(sorted(given)))
        np.testing.assert_allclose(explicit_attention(q, k, v, **{key: value for key, value in given.items()
                                                                 if key != "segment_ids"},
                                                      mask=expected.get("mask")),
                                   reference(q, k, v, **expected), atol=2e-6, err_msg=str(sorted(given)))
    # A KV cache's decode step: one query at position 5 over a 8-entry cache, the filled part masked in.
    filled = (jnp.arange(8) <= 5)[None, None, None, :]
    np.testing.assert_allclose(attention(q[:, 5:6], k, v, mask=filled), reference(q[:, 5:6], k, v, mask=filled),
                               atol=2e-6)


def test_attention_dropout_drops_weights_with_the_given_key():
    q, k, v = qkv()
    out = attention(q, k, v, causal=True, dropout_rate=0.5, dropout_rng=jax.random.key(3))
    # The weights, written out: softmax of the causal scores, each kept with probability 1/2 and doubled.
    scores = jnp.einsum("btnh,bsnh->bnts", q, k) / 4.0
    weights = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((8, 8), bool)), scores, -jnp.inf), axis=-1)
    kept = jax.random.bernoulli(jax.random.key(3), 0.5, weights.shape)
    np.testing.assert_allclose(out, jnp.einsum("bnts,bsnh->btnh", jnp.where(kept, 2 * weights, 0), v), atol=1e-5)
    assert not np.allclose(out, attention(q, k, v, causal=True, dropout_rate=0.5, dropout_rng=jax.random.key(4)))


@pytest.fixture
def fresh_record(monkeypatch):
    """A clean record of choices and of warnings already given."""
    monkeypatch.setattr(attention_module, "_WARNED", set())
    take_attention_choices()
    yield
    take_attention_choices()


def pretend_h100(monkeypatch):
    monkeypatch.setattr(attention_module, "current_backend", lambda: Backend(**H100))


def test_on_an_nvidia_gpu_the_fused_kernel_gets_is_causal_not_a_mask(monkeypatch, fresh_record):
    pretend_h100(monkeypatch)
    calls = []

    def fused(q, k, v, bias, mask, **options):
        calls.append({"bias": bias, "mask": mask, **options})
        return jax.nn.dot_product_attention(q, k, v, bias, mask, is_causal=options["causal"])

    monkeypatch.setattr(attention_module, "_cudnn_attention", fused)
    q, k, v = qkv(head_dim=64).astype(jnp.bfloat16)
    out = attention(q, k, v, causal=True)
    assert len(calls) == 1 and calls[0]["causal"] is True and calls[0]["mask"] is None and calls[0]["bias"] is None
    np.testing.assert_allclose(out.astype(np.float32), reference(q, k, v, causal=True), atol=2e-2)
    assert take_attention_choices() == (KernelChoice("cudnn", "NVIDIA sm90, bfloat16, head size 64"),)


@pytest.mark.parametrize("refusal", [NotImplementedError("head dim"), ValueError("bad layout"), None])
def test_a_refusing_fused_kernel_falls_back_to_xla_and_warns_once(monkeypatch, fresh_record, refusal):
    pretend_h100(monkeypatch)
    if refusal is not None:
        def refuse(*args, **kwargs):
            raise refusal

        monkeypatch.setattr(attention_module, "_cudnn_attention", refuse)
    # With refusal None the real cuDNN call runs: on a machine without cuDNN it raises RuntimeError.
    q, k, v = qkv(head_dim=64).astype(jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match="cuDNN refused the inputs") as caught:
        out = attention(q, k, v, causal=True)
    assert len(caught) == 1
    np.testing.assert_allclose(out.astype(np.float32), reference(q, k, v, causal=True), atol=2e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second refusal is not warned again
        attention(q, k, v, causal=True)
    (choice,) = take_attention_choices()
    error = refusal or RuntimeError("cuDNN is not detected.")
    assert choice == KernelChoice("xla", f"cuDNN refused the inputs ({type(error).__name__}: {error}); fell back "
                                         "to XLA")


def test_a_forced_kernel_that_cannot_run_warns_with_the_reason(fresh_record):
    q, k, v = qkv()
    with pytest.warns(RuntimeWarning, match="attention='cudnn' requested, but cpu has no cuDNN; using xla"):
        out = attention(q, k, v, causal=True, implementation="cudnn")
    np.testing.assert_allclose(out, reference(q, k, v, causal=True), atol=2e-6)


def test_the_compile_line_says_which_kernel_ran_and_why(fresh_record):
    tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9)).astype(np.int32)
    model = gpt2("gpt2-tiny", vocab_size=64, n_positions=8, n_embd=16, n_layer=1)
    trainer = Trainer(model, ArrayLoader((tokens[:, :-1], tokens[:, 1:]), batch_size=4), "1ba", optax.sgd(0.1),
                      progress_bar=False, run_summary=False)
    trainer.fit()
    (record,) = trainer.state.compiled_steps
    assert record.attention == "xla (cpu: no fused attention kernel)"
    assert ", attention xla (cpu: no fused attention kernel) (no algorithms)" in format_compiled(record)


def test_the_compile_line_says_why_the_fused_kernel_fell_back(monkeypatch, fresh_record):
    pretend_h100(monkeypatch)

    def refuse(*args, **kwargs):
        raise NotImplementedError("sequence length 8 unsupported")

    monkeypatch.setattr(attention_module, "_cudnn_attention", refuse)
    tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9)).astype(np.int32)
    model = gpt2("gpt2-tiny", vocab_size=64, n_positions=8, n_embd=128, n_layer=1, n_head=2)  # head size 64
    trainer = Trainer(model, ArrayLoader((tokens[:, :-1], tokens[:, 1:]), batch_size=4), "1ba", optax.sgd(0.1),
                      precision="amp_bf16", progress_bar=False, run_summary=False)  # bfloat16: cuDNN's to take
    with pytest.warns(RuntimeWarning, match="cuDNN refused the inputs"):
        trainer.fit()
    (record,) = trainer.state.compiled_steps
    reason = "cuDNN refused the inputs (NotImplementedError: sequence length 8 unsupported); fell back to XLA"
    assert record.attention == f"xla ({reason})"
    assert f", attention xla ({reason}) (no algorithms)" in format_compiled(record)


def test_long_queries_go_in_blocks_with_the_same_outputs_and_gradients(monkeypatch):
    monkeypatch.setattr(attention_module, "_QUERY_BLOCK", 3)  # 8 queries: 3 blocks of 3, the last padded
    q, k, v = qkv()
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2, 3]])
    lengths = jnp.array([8, 5], jnp.int32)
    alibi = alibi_position_bias(2, jnp.arange(8), jnp.arange(8))
    same_segment = np.asarray(segments[:, None, :, None] == segments[:, None, None, :])
    for given, expected in [
        ({"causal": True, "bias": alibi, "segment_ids": segments},
         {"causal": True, "bias": alibi, "mask": same_segment}),
        ({"causal": True, "kv_lengths": lengths, "q_lengths": lengths},
         {"causal": True, "kv_lengths": lengths, "q_lengths": lengths}),
    ]:
        np.testing.assert_allclose(attention(q, k, v, **given), reference(q, k, v, **expected), atol=2e-6)

    def blocked(q, k, v):
        return jnp.sum(jnp.sin(attention(q, k, v, causal=True, bias=alibi)))

    def plain(q, k, v):
        return jnp.sum(jnp.sin(jax.nn.dot_product_attention(q, k, v, bias=alibi, is_causal=True)))

    gradients = jax.grad(blocked, argnums=(0, 1, 2))(q, k, v), jax.grad(plain, argnums=(0, 1, 2))(q, k, v)
    for got, expected in zip(*gradients):
        np.testing.assert_allclose(got, expected, atol=2e-6)


def test_blocked_attention_gradients_equal_the_unblocked_ones_for_every_input(monkeypatch):
    q, k, v = qkv()
    segments = jnp.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 2, 2, 3]])
    lengths = jnp.array([8, 5], jnp.int32)
    alibi = alibi_position_bias(2, jnp.arange(8), jnp.arange(8))
    given = {"causal": True, "segment_ids": segments, "kv_lengths": lengths, "q_lengths": lengths}

    def loss(q, k, v, bias):
        return jnp.sum(jnp.sin(attention(q, k, v, bias=bias, **given)))

    whole = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, alibi)
    monkeypatch.setattr(attention_module, "_QUERY_BLOCK", 3)  # 8 queries: 3 blocks of 3, the last padded
    blocked = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, alibi)
    for name, got, expected in zip(("query", "key", "value", "bias"), blocked, whole):
        assert float(jnp.abs(expected).max()) > 0, name
        np.testing.assert_allclose(got, expected, atol=2e-6, err_msg=name)


def test_remat_layers_of_blocked_attention_keep_only_their_input_until_their_gradient():
    # Each layer's backward loop starts its gradient buffers (dq, dk, dv) only once its gradient exists:
    # were they constants, XLA would allocate every layer's in the forward pass (4 inputs' worth a layer).
    x = jax.random.normal(jax.random.key(0), (2, 512, 2, 16))  # 2 blocks of 256 queries

    def temp(layers: int) -> int:
        layer = checkpoint_after_gradient(lambda x: x + attention(x, x, x, causal=True))

        def loss(x):
            for _ in range(layers):
                x = layer(x)
            return jnp.sum(x ** 2)

        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes

    assert temp(8) - temp(2) < 6 * 1.5 * x.nbytes


def test_xla_attention_keeps_only_its_inputs_for_the_backward_pass():
    x = jax.random.normal(jax.random.key(0), (2, 256, 4, 16))

    def temp(attend, layers):
        def loss(x):
            for _ in range(layers):
                x = x + attend(x)
            return jnp.sum(x ** 2)

        return jax.jit(jax.grad(loss)).lower(x).compile().memory_analysis().temp_size_in_bytes

    scores = 2 * 4 * 256 * 256 * 4  # one layer's float32 (B, N, T, S) scores: 2 MiB
    plain = lambda x: jax.nn.dot_product_attention(x, x, x, is_causal=True)  # noqa: E731
    ours = lambda x: attention(x, x, x, causal=True)  # noqa: E731
    # Six more layers: XLA's own function keeps each one's weights for the backward pass; ours keeps
    # its inputs (128 KiB a layer) and recomputes the weights one layer at a time.
    assert temp(plain, 8) - temp(plain, 2) > 6 * scores
    assert temp(ours, 8) - temp(ours, 2) < scores
