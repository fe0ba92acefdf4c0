"""benchmarks/lm_torch.py: the PyTorch GPT-2 is composerjax's GPT-2 (size, logits), and its training step trains."""

from __future__ import annotations

import os
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCHMARKS)

from lm_steps import Job  # noqa: E402
from lm_torch import TorchGPT2, TorchStep, lm_loss, lr_factor, parameter_count, to_torch  # noqa: E402

from composerjax.models.gpt2 import GPT2, GPT2Config  # noqa: E402
from composerjax.models.gpt2 import parameter_count as composerjax_parameter_count  # noqa: E402

TINY = GPT2Config.preset("gpt2-tiny")
LM_TINY = GPT2Config.preset("gpt2-tiny", vocab_size=2048, n_positions=128, n_embd=128, n_layer=2, n_head=4)


@pytest.mark.parametrize("config", [TINY, LM_TINY, GPT2Config.preset("gpt2-tiny", vocab_size=500),
                                    GPT2Config.preset("gpt2-small", dropout=0.0, attention_dropout=0.0)],
                         ids=["gpt2-tiny", "lm.py gpt2-tiny", "padded 500 -> 512", "gpt2-small"])
def test_the_torch_model_has_composerjax_parameter_count(config):
    with torch.device("meta"):  # gpt2-small's 124M parameters without allocating them
        model = TorchGPT2(config)
    assert parameter_count(model) == composerjax_parameter_count(config)
    assert model.tokens.weight.shape[0] == config.padded_vocab_size


def test_gpt2_small_is_the_padded_124m_model():
    with torch.device("meta"):
        model = TorchGPT2(GPT2Config.preset("gpt2-small", dropout=0.0, attention_dropout=0.0))
    assert parameter_count(model) == 124_475_904  # 124,439,808 + 47 padding rows of 768


def test_with_composerjax_weights_it_gives_composerjax_logits():
    config = GPT2Config.preset("gpt2-tiny", vocab_size=500)  # padded to 512: the slice is checked too
    graphdef, state, rest = nnx.split(GPT2(config, rngs=nnx.Rngs(3)), nnx.Param, ...)
    # Weights far from GPT-2's small initialisation, so that every difference in the math shows.
    rng = np.random.default_rng(1)
    params = {}
    for path, variable in nnx.to_flat_state(state):
        value = variable[...]
        params[tuple(str(key) for key in path)] = new = rng.normal(0.0, 0.3, value.shape).astype(np.float32)
        variable.set_value(jnp.asarray(new))
    jax_model = nnx.merge(graphdef, state, rest)
    torch_model = TorchGPT2(config)
    inside = {"qkv": ("attention", "qkv"), "proj": ("attention", "proj"), "up": ("mlp", "up"),
              "down": ("mlp", "down"), "norm1": ("norm1",), "norm2": ("norm2",), "norm": ("norm",)}
    leaf = {("Linear", "weight"): "kernel", ("LayerNorm", "weight"): "scale", ("Embedding", "weight"): "embedding"}
    with torch.no_grad():
        for name, parameter in torch_model.named_parameters():
            *module_path, kind = name.split(".")
            module = torch_model.get_submodule(".".join(module_path))
            last = leaf.get((type(module).__name__, kind), kind)
            prefix = tuple(module_path[:2]) if module_path[0] == "blocks" else ()
            key = (*prefix, *inside.get(module_path[-1], (module_path[-1],)), last)
            value = params.pop(key)
            parameter.copy_(torch.from_numpy(np.array(value.T if last == "kernel" else value)))
    assert params == {}  # every composerjax parameter went into one torch parameter
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 24))
    expected = np.asarray(jax_model(jnp.asarray(tokens), deterministic=True))
    got = torch_model(torch.from_numpy(tokens)).detach().numpy()
    assert got.shape == expected.shape == (2, 24, 500)
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=1e-5)


def test_the_schedule_is_optaxs_warmup_cosine():
    job, total = Job(TINY, 64, 2), 50
    schedule = optax.warmup_cosine_decay_schedule(0.0, job.lr, job.warmup_steps(total), total,
                                                  end_value=job.lr * job.alpha_f)
    factor = lr_factor(job, total)
    np.testing.assert_allclose([job.lr * factor(step) for step in range(total + 1)],
                               [float(schedule(step)) for step in range(total + 1)], rtol=1e-6, atol=1e-12)


def evaluate(step: TorchStep, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    with torch.no_grad():
        return float(step.loss(*batch))


@pytest.mark.parametrize("precision", ["fp32", "amp_bf16"])
def test_one_training_step_lowers_the_loss(precision):
    job = Job(TINY, 64, 4)
    rng = np.random.default_rng(0)
    (batch,) = to_torch([(rng.integers(0, 512, (4, 64)), rng.integers(0, 512, (4, 64)))], torch.device("cpu"))
    step = TorchStep(job, precision, total_steps=20, mode="eager")
    start = {name: value.detach().clone() for name, value in step.model.state_dict().items()}
    step.step(batch)  # the warmup's first rate is 0, as optax's and Composer's: nothing moves
    assert all(torch.equal(start[name], value) for name, value in step.model.state_dict().items())
    before = evaluate(step, batch)
    step.step(batch)
    assert evaluate(step, batch) < before - 1e-3


def test_a_failing_torch_compile_falls_back_to_eager_and_says_so():
    job = Job(TINY, 64, 2)
    rng = np.random.default_rng(0)
    (batch,) = to_torch([(rng.integers(0, 512, (2, 64)),) * 2], torch.device("cpu"))
    step = TorchStep(job, "fp32", total_steps=10, mode="compile")

    def inductor_fails(tokens):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    step.forward = inductor_fails
    loss = step.step(batch)
    assert np.isfinite(float(loss))
    assert step.fallback == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    assert step.label() == "torch eager (fallback)" and step.forward is step.model


def test_a_model_it_does_not_write_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"TorchGPT2: \{'position': 'rotary'\} not written here"):
        TorchGPT2(GPT2Config.preset("gpt2-tiny", position="rotary"))
    with pytest.raises(ValueError, match=r"TorchStep\(precision='fp16'\): expected 'fp32', 'amp_bf16' or 'bf16'"):
        TorchStep(Job(TINY, 64, 2), "fp16", total_steps=10)


def test_lm_loss_is_the_mean_cross_entropy():
    logits = torch.tensor([[[2.0, 0.0], [0.0, 0.0]]])
    targets = torch.tensor([[0, 1]])
    expected = (np.log(1 + np.exp(-2.0)) + np.log(2.0)) / 2
    assert float(lm_loss(logits, targets)) == pytest.approx(expected, rel=1e-6)
