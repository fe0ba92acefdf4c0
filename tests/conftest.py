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


#: Overrides that make the language-model example recipes CPU-sized in tests (a part of the corpus; GPT-2
#: small keeps its width but one layer and short sequences: at its own batch its step needs ~100 GB on CPU).
LM_RECIPE_OVERRIDES: dict[str, list[str]] = {
    "gpt2_stdlib.yaml": ["data.max_files=40"],
    "gpt2_small_stdlib.yaml": ["data.max_files=30", "data.seq_len=64", "data.batch_size=2", "data.vocab_size=512",
                               "data.worker_count=1", "model.vocab_size=512", "model.n_positions=64",
                               "model.n_layer=1"],
}

#: Example recipes that start from a pretrained folder, and the command (run in the recipe's working
#: folder) that makes their offline stand-in, as the recipe's header says.
PRETRAINED_EXAMPLES: dict[str, list[str]] = {
    "finetune_llama.yaml": ["examples/make_tiny_pretrained.py", "runs/tiny-llama", "--train-examples", "64",
                            "--eval-examples", "16", "--vocab-size", "400"],
}


def prepare_example(recipe_name: str, folder) -> None:
    """Make what ``recipe_name`` reads before it starts (a pretrained stand-in) in ``folder``; nothing for most."""
    import subprocess
    import sys
    from pathlib import Path

    command = PRETRAINED_EXAMPLES.get(recipe_name)
    if command is None:
        return
    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / command[0]), *command[1:]], cwd=folder, check=True,
                   capture_output=True, timeout=300)
