"""Callbacks the LM process tests put in their recipes (as ``lm_callbacks:Name``, with this folder on PYTHONPATH).

* :class:`PauseForKill`: at the end of batch ``at_batch``, wait until the checkpoint folder
  ``checkpoint`` is complete on disk, write ``marker`` and sleep until the test SIGKILLs the process.
  When ``marker`` already exists (the resumed run, or a reference run given a marker up front) it does
  nothing, so every run uses the same recipe.
* :class:`DumpTrainState`: at ``FIT_END``, write every leaf of the train state to ``path`` (``.npz``)
  and the batch ``fit()`` started from to ``path + '.json'``.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from composerjax import Callback


class PauseForKill(Callback):
    """Stop (without exiting) at batch ``at_batch`` once ``checkpoint`` exists, and say so in ``marker``.

    Args:
        at_batch: the batch whose ``BATCH_END`` pauses.
        checkpoint: a checkpoint folder that must be complete first (orbax renames it into place whole).
        marker: the file written (atomically) once paused; its presence also disables the pause.
    """

    def __init__(self, at_batch: int, checkpoint: str, marker: str) -> None:
        self.at_batch, self.checkpoint, self.marker = at_batch, checkpoint, marker
        self.armed = not os.path.exists(marker)

    def batch_end(self, state, logger) -> None:
        if not self.armed or int(state.timestamp.batch) != self.at_batch:
            return
        while not os.path.isdir(self.checkpoint):
            time.sleep(0.01)
        temporary = f"{self.marker}.tmp"
        with open(temporary, "w") as handle:
            json.dump({"pid": os.getpid(), "batch": int(state.timestamp.batch)}, handle)
        os.replace(temporary, self.marker)
        while True:  # the test SIGKILLs this process now
            time.sleep(0.05)


class DumpTrainState(Callback):
    """Write the final train state's leaves to ``path`` and the batch ``fit()`` started at to ``path + '.json'``.

    Args:
        path: the ``.npz`` file to write.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.started_at: int | None = None

    def fit_start(self, state, logger) -> None:
        self.started_at = int(state.timestamp.batch)

    def fit_end(self, state, logger) -> None:
        leaves = jax.tree.leaves(jax.device_get(state.train_state))
        np.savez(self.path, *[np.asarray(leaf) for leaf in leaves])
        with open(f"{self.path}.json", "w") as handle:
            json.dump({"started_at": self.started_at, "batch": int(state.timestamp.batch)}, handle)
