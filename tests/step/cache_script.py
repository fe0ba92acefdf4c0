"""Train a small MLP for a few batches in a fresh process; print the compilation cache's record as JSON.

    python cache_script.py [--off]   (Trainer(compilation_cache=False))
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import optax
from flax import nnx

from composerjax import ArrayLoader, ComposerClassifier, Trainer
from composerjax.models import MLP
from composerjax.step.compile_cache import CACHE_STATS


def entries() -> int:
    folder = os.environ["COMPOSERJAX_CACHE_DIR"]
    return sum(name.endswith("-cache") for name in os.listdir(folder)) if os.path.isdir(folder) else 0


x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
y = (x[:, 0] > 0).astype(np.int32)
model = ComposerClassifier(MLP((8, 32, 2), rngs=nnx.Rngs(0)), 2)  # initialising it compiles
before_trainer = {"entries": entries(), "hits": CACHE_STATS.hits}
trainer = Trainer(model, ArrayLoader((x, y), batch_size=16),
                  "4ba", optax.adam(1e-3), eval_dataloader=ArrayLoader((x, y), batch_size=32, shuffle=False),
                  progress_bar=False, compilation_cache="--off" not in sys.argv)
trainer.fit()
print(json.dumps({"cache": trainer.state.run_summary.get("compilation_cache"),
                  "records": [record.from_cache for record in trainer.state.compiled_steps],
                  "before_trainer": before_trainer, "entries": entries()}))
