"""GhostBatchNorm: against nnx.BatchNorm on the whole batch and on each chunk, running stats, training."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.algorithms.ghost_batchnorm import (
    GhostBatchNorm,
    GhostBatchNormLayer,
    apply_ghost_batchnorm,
    ghost_batch_norm,
)
from composerjax.models import SmallCNN, SmallResNet
from composerjax.models.surgery import count_modules


def trained_batch_norm(channels: int = 3) -> nnx.BatchNorm:
    """A batch norm whose scale, bias and running statistics are not at their initial values."""
    norm = nnx.BatchNorm(channels, momentum=0.9, rngs=nnx.Rngs(0))
    norm.scale[...] = jnp.linspace(0.5, 2.0, channels)
    norm.bias[...] = jnp.linspace(-1.0, 1.0, channels)
    norm.mean[...] = jnp.linspace(0.1, 0.3, channels)
    norm.var[...] = jnp.linspace(1.5, 2.5, channels)
    return norm


def activations(shape: tuple[int, ...], seed: int = 0) -> jnp.ndarray:
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.normal(size=shape) * 3 + rng.normal(size=shape[-1])).astype(np.float32))


def test_pure_function_normalizes_each_chunk_with_its_own_statistics():
    x = np.random.default_rng(0).normal(size=(6, 2, 3)).astype(np.float32)
    y, mean, var = ghost_batch_norm(jnp.asarray(x), 3, epsilon=0.0)
    for chunk in (slice(0, 3), slice(3, 6)):
        part = x[chunk].astype(np.float64)
        expected = (part - part.mean(axis=(0, 1))) / part.std(axis=(0, 1))
        np.testing.assert_allclose(y[chunk], expected, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(mean, (x[:3].mean(axis=(0, 1)) + x[3:].mean(axis=(0, 1))) / 2, rtol=1e-5)
    np.testing.assert_allclose(var, (x[:3].var(axis=(0, 1)) + x[3:].var(axis=(0, 1))) / 2, rtol=1e-5)


def test_one_ghost_batch_is_exactly_batch_norm():
    x = activations((8, 4, 4, 3))
    norm = trained_batch_norm()
    reference = nnx.clone(norm)
    ghost = GhostBatchNormLayer(norm, ghost_batch_size=8)
    np.testing.assert_array_equal(ghost(x), reference(x))
    np.testing.assert_array_equal(norm.mean[...], reference.mean[...])
    np.testing.assert_array_equal(norm.var[...], reference.var[...])
    # a batch smaller than the ghost batch is one ghost batch too
    np.testing.assert_array_equal(GhostBatchNormLayer(trained_batch_norm(), 32)(x), trained_batch_norm()(x))


@pytest.mark.parametrize("size, ghost_batch_size, chunks", [(8, 4, [4, 4]), (7, 4, [4, 3])])
def test_ghost_batches_are_batch_norm_on_each_chunk(size, ghost_batch_size, chunks):
    x = activations((size, 4, 4, 3))
    ghost = GhostBatchNormLayer(trained_batch_norm(), ghost_batch_size)
    out = ghost(x)
    references, outputs, start = [], [], 0
    for length in chunks:
        reference = trained_batch_norm()
        outputs.append(reference(x[start:start + length]))
        references.append(reference)
        start += length
    np.testing.assert_allclose(out, jnp.concatenate(outputs), rtol=1e-5, atol=1e-5)
    # running stats move towards the mean of the chunks' statistics: the mean of the chunk-wise updates
    np.testing.assert_allclose(ghost.norm.mean[...], np.mean([r.mean[...] for r in references], axis=0), rtol=1e-5)
    np.testing.assert_allclose(ghost.norm.var[...], np.mean([r.var[...] for r in references], axis=0), rtol=1e-5)


def test_eval_is_batch_norm_eval():
    x = activations((8, 4, 4, 3))
    ghost, reference = GhostBatchNormLayer(trained_batch_norm(), 2), trained_batch_norm()
    ghost.eval()
    reference.eval()
    assert ghost.use_running_average and ghost.norm.use_running_average
    np.testing.assert_array_equal(ghost(x), reference(x))
    np.testing.assert_array_equal(ghost.norm.mean[...], reference.mean[...])  # nothing updated
    ghost.train()
    assert not ghost.use_running_average


def test_surgery_replaces_every_batch_norm_and_keeps_its_variables():
    model = SmallResNet(width=4, rngs=nnx.Rngs(0))
    stem_norm = model.stem_norm
    assert apply_ghost_batchnorm(model, ghost_batch_size=4) == 5
    assert count_modules(model, GhostBatchNormLayer) == 5
    assert model.stem_norm.norm is stem_norm
    assert apply_ghost_batchnorm(model) == 0  # already replaced


def test_ghost_batchnorm_in_a_trainer_trains_with_one_compile():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 8, 8)).astype(np.float32)
    y = (x.mean(axis=(1, 2)) > 0).astype(np.int32)
    trainer = Trainer(ComposerClassifier(SmallCNN(num_classes=2, channels=4, rngs=nnx.Rngs(0)), 2),
                      ArrayLoader((x, y), 16, shuffle=False), "2ba", optax.sgd(0.1),
                      algorithms=[GhostBatchNorm(ghost_batch_size=8)], progress_bar=False)
    assert count_modules(trainer.state.model, GhostBatchNormLayer) == 2
    trainer.fit()
    assert trainer.compile_count == 1
    assert np.isfinite(float(trainer.state.loss))
    model = trainer.state.model.module
    # two steps of momentum-0.99 updates moved the running mean away from zero
    assert np.all(np.isfinite(model.norm1.norm.mean[...])) and np.any(model.norm1.norm.mean[...] != 0)
    assert np.isfinite(trainer.eval(ArrayLoader((x, y), 16, shuffle=False))["CrossEntropy"])


def test_ghost_batchnorm_warns_when_there_is_no_batch_norm():
    data = ArrayLoader((np.zeros((8, 4), np.float32), np.zeros(8, np.int32)), 8)
    with pytest.warns(UserWarning, match="GhostBatchNorm replaced no modules"):
        Trainer(ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), 2), data, "1ba", optax.sgd(0.1),
                algorithms=[GhostBatchNorm()], progress_bar=False)


@pytest.mark.parametrize("value", [0, -4, 2.0, True])
def test_bad_ghost_batch_size_raises(value):
    with pytest.raises(ValueError, match=f"ghost_batch_size={value!r}"):
        GhostBatchNorm(ghost_batch_size=value)
