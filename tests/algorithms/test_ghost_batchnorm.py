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
    chunk_sizes,
    ghost_batch_norm,
    ghost_batch_sizes,
    update_running_stat,
)
from composerjax.models import SmallCNN
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


def test_chunks_are_cut_as_torch_chunk_cuts_them():
    # Composer: num_chunks = ceil(N / ghost_batch_size), then torch.chunk (ceil(N / num_chunks) rows each).
    assert ghost_batch_sizes(10, 4) == [4, 4, 2]
    assert ghost_batch_sizes(7, 4) == [4, 3]
    assert ghost_batch_sizes(40, 32) == [20, 20]
    assert ghost_batch_sizes(8, 8) == [8]
    assert chunk_sizes(10, 3) == [4, 4, 2]
    assert chunk_sizes(6, 4) == [2, 2, 2]  # torch.chunk may give fewer chunks than asked
    with pytest.raises(ValueError, match="fewer than ghost_batch_size=8"):
        ghost_batch_sizes(6, 8)


def numpy_ghost_norm(x: np.ndarray, sizes: list[int], epsilon: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each chunk normalized with its biased statistics over all axes but the last (float64)."""
    outputs, means, variances, start = [], [], [], 0
    for size in sizes:
        part = x[start:start + size].astype(np.float64)
        axes = tuple(range(part.ndim - 1))
        means.append(part.mean(axes))
        variances.append(part.var(axes))
        outputs.append((part - means[-1]) / np.sqrt(variances[-1] + epsilon))
        start += size
    return np.concatenate(outputs), np.stack(means), np.stack(variances)


def test_pure_function_normalizes_each_uneven_chunk_with_its_own_statistics():
    x = np.random.default_rng(0).normal(size=(10, 2, 3)).astype(np.float32)
    y, means, variances = ghost_batch_norm(jnp.asarray(x), 4, epsilon=0.0)
    expected_y, expected_means, expected_vars = numpy_ghost_norm(x, [4, 4, 2], 0.0)
    assert means.shape == variances.shape == (3, 3)
    np.testing.assert_allclose(y, expected_y, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(means, expected_means, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(variances, expected_vars, rtol=1e-5, atol=1e-6)


def test_one_ghost_batch_is_exactly_batch_norm():
    x = activations((8, 4, 4, 3))
    norm = trained_batch_norm()
    reference = nnx.clone(norm)
    ghost = GhostBatchNormLayer(norm, ghost_batch_size=8)
    np.testing.assert_array_equal(ghost(x), reference(x))
    np.testing.assert_array_equal(norm.mean[...], reference.mean[...])
    np.testing.assert_array_equal(norm.var[...], reference.var[...])
    # a training batch smaller than the ghost batch is refused, as Composer refuses it
    with pytest.raises(ValueError, match="8 samples, fewer than ghost_batch_size=32"):
        GhostBatchNormLayer(trained_batch_norm(), 32)(x)


@pytest.mark.parametrize("size, ghost_batch_size, chunks", [(8, 4, [4, 4]), (10, 4, [4, 4, 2]), (7, 4, [4, 3])])
def test_ghost_batches_are_sequential_batch_norm_calls(size, ghost_batch_size, chunks):
    x = activations((size, 4, 4, 3))
    ghost = GhostBatchNormLayer(trained_batch_norm(), ghost_batch_size)
    out = ghost(x)
    # Composer: one batch norm call per chunk, torch momentum (1 - 0.9) divided by the number of chunks.
    reference = trained_batch_norm()
    reference.momentum = 1.0 - (1.0 - 0.9) / len(chunks)
    outputs, start = [], 0
    for length in chunks:
        outputs.append(reference(x[start:start + length]))
        start += length
    np.testing.assert_allclose(out, jnp.concatenate(outputs), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ghost.norm.mean[...], reference.mean[...], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ghost.norm.var[...], reference.var[...], rtol=1e-5, atol=1e-6)
    # and the same running statistics from the sequential update written out in numpy
    _, means, variances = numpy_ghost_norm(np.asarray(x), chunks, 1e-5)
    rate = (1.0 - 0.9) / len(chunks)
    running_mean, running_var = np.linspace(0.1, 0.3, 3), np.linspace(1.5, 2.5, 3)
    for mean, var in zip(means, variances):
        running_mean = (1 - rate) * running_mean + rate * mean
        running_var = (1 - rate) * running_var + rate * var
    np.testing.assert_allclose(ghost.norm.mean[...], running_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ghost.norm.var[...], running_var, rtol=1e-5, atol=1e-6)


def test_update_running_stat_is_the_sequential_update():
    stats = np.array([[1.0, -2.0], [3.0, 5.0], [-4.0, 0.5]], np.float32)
    running = np.array([0.5, 2.0])
    for value in stats:  # momentum 0.8 over 3 chunks: rate 0.2 / 3 per chunk
        running = (1 - 0.2 / 3) * running + 0.2 / 3 * value
    np.testing.assert_allclose(update_running_stat(jnp.array([0.5, 2.0]), jnp.asarray(stats), 0.8, 3), running,
                               rtol=1e-6)


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
    rngs = nnx.Rngs(0)
    first = nnx.BatchNorm(3, rngs=rngs)
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=rngs), first,
                           nnx.Sequential(nnx.BatchNorm(3, rngs=rngs), nnx.relu, nnx.BatchNorm(3, rngs=rngs)))
    assert apply_ghost_batchnorm(model, ghost_batch_size=4) == 3
    assert count_modules(model, GhostBatchNormLayer) == 3
    assert model.layers[1].norm is first
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
