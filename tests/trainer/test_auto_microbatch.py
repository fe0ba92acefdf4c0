"""device_train_microbatch_size='auto': the largest microbatch whose compiled step fits the memory budget."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.models.mlp import MLP

X = np.random.default_rng(0).normal(size=(1024, 32)).astype(np.float32)
Y = np.random.default_rng(1).integers(0, 4, size=1024).astype(np.int32)


def make(**kwargs) -> Trainer:
    # Wide layers and a large batch: activations dominate the step's memory, so microbatches shrink it.
    model = ComposerClassifier(MLP([32, 512, 512, 4], rngs=nnx.Rngs(0)), 4)
    return Trainer(model, ArrayLoader((X, Y), batch_size=512, seed=0), "2ba", optax.sgd(0.05), progress_bar=False,
                   run_summary=False, **kwargs)


def params(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(leaf) for leaf in jax.tree.leaves(jax.device_get(trainer.state.train_state.params))]


def test_auto_picks_the_largest_microbatch_under_the_budget_and_trains_like_the_whole_batch():
    roomy = make(device_train_microbatch_size="auto", device_memory_budget=10**12)
    roomy.fit()
    whole = roomy.microbatch_candidates[0]
    assert whole["microbatch_size"] == 512 and roomy.microbatch_size is None  # fits: no split

    tight = make(device_train_microbatch_size="auto", device_memory_budget=whole["bytes"] - 1)
    tight.fit()
    tried = tight.microbatch_candidates
    assert [t["microbatch_size"] for t in tried] == [512, 256, 128, 64, 32, 16, 8, 4, 2, 1][:len(tried)]
    assert tried[0]["bytes"] == whole["bytes"] and tried[-1]["bytes"] < whole["bytes"]
    assert all(t["bytes"] >= whole["bytes"] for t in tried[:-1])  # every larger one did not fit
    assert tight.microbatch_size == tried[-1]["microbatch_size"] < 512
    assert tight.state.run_summary["microbatch_candidates"] == tried
    for a, b in zip(params(roomy), params(tight)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_auto_needs_a_budget_on_cpu_and_says_when_nothing_fits():
    with pytest.raises(ValueError, match="device_memory_budget=<bytes>"):
        make(device_train_microbatch_size="auto")
    trainer = make(device_train_microbatch_size="auto", device_memory_budget=1000)
    with pytest.raises(ValueError, match="no microbatch of the 512-sample batch fits device_memory_budget=1000"):
        trainer.fit()
    with pytest.raises(ValueError, match="device_train_microbatch_size='most'"):
        make(device_train_microbatch_size="most")
