"""Shared fixtures: tiny data and models, so every trainer test compiles in well under a second."""

import os

import numpy as np
import pytest
from flax import nnx

from composerjax import ComposerClassifier

# Every engine in the tests (and in the subprocesses they start) also asks each algorithm about the
# events outside its declared ``events`` and fails if one matches there: the declarations stay true.
os.environ.setdefault("COMPOSERJAX_CHECK_EVENTS", "1")


@pytest.fixture(scope="session")
def classification_arrays():
    """``(x, y)``: 64 samples of 4 float32 features, int32 labels ``x0 + 0.5 * x1 > 0``."""
    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)
    return x, y


@pytest.fixture(scope="session")
def make_tiny_classifier():
    """``make_tiny_classifier(seed=0)``: a fresh ``ComposerClassifier(nnx.Linear(4, 2))``."""

    def make(seed: int = 0) -> ComposerClassifier:
        return ComposerClassifier(nnx.Linear(4, 2, rngs=nnx.Rngs(seed)), num_classes=2)

    return make
