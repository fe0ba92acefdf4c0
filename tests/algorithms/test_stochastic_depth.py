"""StochasticDepth: drop rates, the wrapped block against the original block's math, seeds, warmup, training."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, Callback, ComposerClassifier, Trainer
from composerjax.algorithms.stochastic_depth import (
    StochasticBlock,
    StochasticDepth,
    apply_stochastic_depth,
    block_drop_rates,
)
from composerjax.models import BasicBlock, DecoderBlock, SmallResNet
from composerjax.models.surgery import count_modules


def feature_maps(shape: tuple[int, ...] = (4, 8, 8, 4), seed: int = 0) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape).astype(np.float32))


def wrapped_basic_block(drop_rate: float, method: str = "block", seed: int = 0) -> tuple[StochasticBlock, BasicBlock]:
    """A stochastic strided BasicBlock (with a shortcut conv) and an untouched clone of the original."""
    block = BasicBlock(4, 8, stride=2, rngs=nnx.Rngs(0))
    reference = nnx.clone(block)
    return StochasticBlock(block, drop_rate, method, rngs=nnx.Rngs(dropout=seed)), reference


def test_drop_rates_are_linear_in_depth_or_uniform():
    assert block_drop_rates(4, 0.2) == pytest.approx([0.05, 0.1, 0.15, 0.2])
    assert block_drop_rates(3, 0.3, "uniform") == [0.3, 0.3, 0.3]
    model = SmallResNet(width=4, rngs=nnx.Rngs(0))
    assert apply_stochastic_depth(model, "BasicBlock", drop_rate=0.4) == 2
    assert [block.target_drop_rate for block in model.blocks] == pytest.approx([0.2, 0.4])
    assert apply_stochastic_depth(model, BasicBlock) == 0  # already wrapped
    assert count_modules(model, StochasticBlock) == 2
    composer_named = SmallResNet(width=4, rngs=nnx.Rngs(0))
    assert apply_stochastic_depth(composer_named, "ResNetBottleneck") == 2  # Composer's name for the ResNet block


@pytest.mark.parametrize("method", ["block", "sample"])
def test_train_mode_with_nothing_dropped_is_the_original_block(method):
    wrapped, reference = wrapped_basic_block(0.0, method)
    x = feature_maps()
    np.testing.assert_allclose(wrapped(x), reference(x), rtol=1e-5, atol=1e-5)
    # the branch ran once: batch statistics moved exactly as in the original block
    np.testing.assert_allclose(wrapped.block.norm1.mean[...], reference.norm1.mean[...], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(wrapped.block.norm2.var[...], reference.norm2.var[...], rtol=1e-6)


@pytest.mark.parametrize("method", ["block", "sample"])
def test_train_mode_with_everything_dropped_is_the_identity_path(method):
    wrapped, reference = wrapped_basic_block(1.0, method)
    x = feature_maps()
    out = wrapped(x)
    np.testing.assert_allclose(out, nnx.relu(reference.shortcut(x)), rtol=1e-6, atol=1e-6)
    if method == "block":  # a dropped block is skipped: its batch norms saw nothing
        np.testing.assert_array_equal(wrapped.block.norm1.mean[...], np.zeros(8))


def test_eval_scales_the_branch_by_the_keep_probability_in_block_mode():
    wrapped, reference = wrapped_basic_block(0.3, "block")
    wrapped.eval()
    reference.eval()
    assert wrapped.deterministic and wrapped.block.norm1.use_running_average
    x = feature_maps()
    expected = nnx.relu(reference.shortcut(x) + 0.7 * reference.residual(x))
    np.testing.assert_allclose(wrapped(x), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(wrapped(x), wrapped(x))  # deterministic


def test_eval_scales_the_branch_by_the_keep_probability_in_sample_mode():
    wrapped, reference = wrapped_basic_block(0.3, "sample")
    wrapped.eval()
    reference.eval()
    x = feature_maps()
    expected = nnx.relu(reference.shortcut(x) + 0.7 * reference.residual(x))  # Composer: out * keep_prob
    np.testing.assert_allclose(wrapped(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["block", "sample"])
def test_eval_is_the_original_block_with_train_scaling(method):
    block = BasicBlock(4, 8, stride=2, rngs=nnx.Rngs(0))
    reference = nnx.clone(block)
    wrapped = StochasticBlock(block, 0.3, method, rngs=nnx.Rngs(dropout=0), scaling="train")
    wrapped.eval()
    reference.eval()
    x = feature_maps()
    np.testing.assert_allclose(wrapped(x), reference(x), rtol=1e-5, atol=1e-6)


def test_sample_mode_drops_samples_and_keeps_the_others_unscaled():
    wrapped, reference = wrapped_basic_block(0.5, "sample")
    x = feature_maps((8, 8, 8, 4))
    out = np.asarray(wrapped(x))
    identity, residual = reference.shortcut(x), reference.residual(x)  # reference: batch stats of all 8
    dropped = np.asarray(nnx.relu(identity))
    kept = np.asarray(nnx.relu(identity + residual))  # Composer: no rescaling in training
    is_dropped = [np.allclose(out[i], dropped[i], atol=1e-5) for i in range(8)]
    is_kept = [np.allclose(out[i], kept[i], rtol=1e-5, atol=1e-5) for i in range(8)]
    assert all(a != b for a, b in zip(is_dropped, is_kept))
    assert any(is_dropped) and any(is_kept)


class TripleBranch(nnx.Module):
    """``x + residual(x)`` with ``residual(x) = 3 x``: the smallest block whose output is a closed form."""

    def residual(self, x: jnp.ndarray) -> jnp.ndarray:
        return 3.0 * x


def pinned_sample_mask(seed: int, p: float, batch: int) -> np.ndarray:
    """The per-sample keep mask the first training call of a StochasticBlock seeded ``seed`` draws."""
    key = nnx.Rngs(dropout=seed).dropout()
    return np.asarray(jax.random.bernoulli(key, 1 - p, (batch, 1))).astype(np.float32)


@pytest.mark.parametrize("scaling, train_scale, eval_scale", [("eval", 1.0, 0.75), ("train", 1 / 0.75, 1.0)])
def test_sample_drop_path_closed_form_in_train_and_eval(scaling, train_scale, eval_scale):
    p, seed = 0.25, 3
    x = jnp.arange(1.0, 17.0).reshape(8, 2)
    mask = pinned_sample_mask(seed, p, 8)
    assert 0 < mask.sum() < 8  # the pinned draw keeps some samples and drops others
    wrapped = StochasticBlock(TripleBranch(), p, "sample", rngs=nnx.Rngs(dropout=seed), scaling=scaling)
    np.testing.assert_allclose(wrapped(x), x + 3.0 * x * mask * train_scale, rtol=1e-6)
    wrapped.eval()
    np.testing.assert_allclose(wrapped(x), x + 3.0 * x * eval_scale, rtol=1e-6)


@pytest.mark.parametrize("scaling, train_scale, eval_scale", [("eval", 1.0, 0.6), ("train", 1 / 0.6, 1.0)])
def test_block_drop_path_closed_form_in_train_and_eval(scaling, train_scale, eval_scale):
    p = 0.4
    x = jnp.arange(-3.0, 3.0).reshape(3, 2)
    draws = {seed: bool(jax.random.bernoulli(nnx.Rngs(dropout=seed).dropout(), 1 - p)) for seed in range(12)}
    kept_seed = next(seed for seed, keep in draws.items() if keep)
    dropped_seed = next(seed for seed, keep in draws.items() if not keep)
    kept = StochasticBlock(TripleBranch(), p, "block", rngs=nnx.Rngs(dropout=kept_seed), scaling=scaling)
    np.testing.assert_allclose(kept(x), x + 3.0 * x * train_scale, rtol=1e-6)
    dropped = StochasticBlock(TripleBranch(), p, "block", rngs=nnx.Rngs(dropout=dropped_seed), scaling=scaling)
    np.testing.assert_array_equal(dropped(x), x)
    for wrapped in (kept, dropped):
        wrapped.eval()
        np.testing.assert_allclose(wrapped(x), x + 3.0 * x * eval_scale, rtol=1e-6)


@pytest.mark.parametrize("scaling", ["eval", "train"])
def test_a_dropped_block_without_shortcut_returns_its_input(scaling):
    block = BasicBlock(4, 4, rngs=nnx.Rngs(0))
    assert block.shortcut is None
    wrapped = StochasticBlock(block, 1.0, "block", rngs=nnx.Rngs(dropout=0), scaling=scaling)
    x = feature_maps()  # has negative entries: relu(x) would differ
    assert float(jnp.min(x)) < 0
    np.testing.assert_array_equal(wrapped(x), x)  # Composer: `out = identity`, no relu


def test_decoder_block_adds_the_scaled_branch_to_its_input():
    block = DecoderBlock(16, 2, rngs=nnx.Rngs(0))
    x = feature_maps((2, 5, 16))
    residual = block.residual(x)
    wrapped = StochasticBlock(block, 1.0, rngs=nnx.Rngs(dropout=0))
    np.testing.assert_array_equal(wrapped(x), x)
    wrapped.drop_rate[...] = 0.25
    wrapped.eval()
    np.testing.assert_allclose(wrapped(x), x + 0.75 * residual, rtol=1e-5, atol=1e-6)


@nnx.jit
def call(module: nnx.Module, x: jnp.ndarray) -> jnp.ndarray:
    return module(x)


def block_mode_pattern(seed: int, calls: int = 12) -> list[bool]:
    """Which of ``calls`` training calls kept the branch of a p=0.5 block."""
    wrapped, reference = wrapped_basic_block(0.5, "block", seed=seed)
    x = feature_maps()
    identity = np.asarray(nnx.relu(reference.shortcut(x)))
    return [not np.allclose(call(wrapped, x), identity) for _ in range(calls)]


def test_drop_pattern_is_fixed_by_the_seed():
    pattern = block_mode_pattern(seed=0)
    assert pattern == block_mode_pattern(seed=0)
    assert any(pattern) and not all(pattern)
    assert pattern != block_mode_pattern(seed=1)


class RecordDropRates(Callback):
    def __init__(self) -> None:
        self.rates: list[list[float]] = []

    def batch_end(self, state, logger):
        blocks = state.train_state.rest["module"]["blocks"]
        self.rates.append([float(blocks[i]["drop_rate"]) for i in (0, 1)])


def test_stochastic_depth_in_a_trainer_warms_up_with_one_compile_and_evaluates_deterministically():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    recorder = RecordDropRates()
    trainer = Trainer(ComposerClassifier(SmallResNet(num_classes=2, width=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16, shuffle=False), "4ba", optax.sgd(0.1),
                      algorithms=[StochasticDepth("BasicBlock", drop_rate=0.5, drop_warmup=0.5)],
                      callbacks=[recorder], progress_bar=False)
    assert count_modules(trainer.state.model, StochasticBlock) == 2
    trainer.fit()
    assert trainer.compile_count == 1
    # rates at step s: target * min(s / (0.5 * 4 steps), 1), targets [0.25, 0.5]
    np.testing.assert_allclose(recorder.rates, [[0, 0], [0.125, 0.25], [0.25, 0.5], [0.25, 0.5]], rtol=1e-6)
    assert np.isfinite(float(trainer.state.loss))
    loader = ArrayLoader((x, y), 16, shuffle=False)
    first, second = trainer.eval(loader), trainer.eval(loader)
    assert first["CrossEntropy"] == second["CrossEntropy"] and np.isfinite(first["CrossEntropy"])


@pytest.mark.parametrize("kwargs, message", [
    ({"target_layer_name": "Bottleneck"}, "target_layer_name='Bottleneck'"),
    ({"target_layer_name": nnx.Linear}, "target_layer_name=<class"),
    ({"stochastic_method": "row"}, "stochastic_method='row'"),
    ({"drop_rate": 1.5}, "drop_rate=1.5"),
    ({"drop_distribution": "exp"}, "drop_distribution='exp'"),
    ({"drop_warmup": 1.0}, "drop_warmup=1.0"),
    ({"drop_warmup": "2ep"}, "drop_warmup='2ep'"),
    ({"drop_warmup": "soon"}, "drop_warmup='soon'"),
    ({"scaling": "inverted"}, "scaling='inverted'"),
])
def test_bad_arguments_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StochasticDepth(**kwargs)
