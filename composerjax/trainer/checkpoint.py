"""Checkpoints on orbax's CheckpointManager: async saves at an interval, restore, autoresume."""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from composerjax.core.state import State
from composerjax.core.time import Time, TimeUnit

__all__ = ["Checkpointer"]


class Checkpointer:
    """Save ``State.state_dict()`` every ``interval`` into ``folder`` and restore it.

    Device arrays (the train state) are saved by orbax asynchronously; everything on the host
    (timestamp, data-loader position, rng, algorithm and callback state) goes into a JSON item of
    the same checkpoint. orbax writes each step to a temporary folder and renames it when complete,
    so a half-written checkpoint is never listed and the previous one stays loadable.

    Args:
        folder: where checkpoints go (one sub-folder per saved batch index).
        interval: a Time in 'ep' or 'ba' (``'1ep'``, ``'500ba'``).
        keep: how many checkpoints to keep (None keeps all).

    Example::

        trainer = Trainer(..., save_folder="runs/x/checkpoints", save_interval="1ep", autoresume=True)
    """

    def __init__(self, folder: str, interval: Time | str = "1ep", keep: int | None = None) -> None:
        interval = Time.from_input(interval, TimeUnit.EPOCH) if not isinstance(interval, Time) else interval
        if interval.unit not in (TimeUnit.EPOCH, TimeUnit.BATCH) or interval.value < 1:
            raise ValueError(f"save_interval={interval}: expected a positive number of epochs or batches, e.g. "
                             "'1ep' or '500ba'")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"save_num_checkpoints_to_keep={keep!r}: expected a positive integer, or -1 for all")
        self.folder = os.path.abspath(folder)
        self.interval = interval
        self.manager = ocp.CheckpointManager(
            self.folder,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True),
        )

    def due(self, state: State, event_unit: TimeUnit) -> bool:
        """Whether a checkpoint is due now, at the checkpoint event of ``event_unit`` ('ep' or 'ba')."""
        if self.interval.unit != event_unit:
            return False
        counter = state.timestamp.epoch if event_unit == TimeUnit.EPOCH else state.timestamp.batch
        return counter > 0 and counter % int(self.interval.value) == 0

    def save(self, state: State) -> int:
        """Start an async save of ``state`` at its batch index; return that index."""
        state_dict = state.state_dict()
        step = state.timestamp.batch
        host = {key: value for key, value in state_dict.items() if key != "train_state"}
        host["rng"] = np.asarray(host["rng"]).tolist()
        host = json.loads(json.dumps(host, default=_jsonable))
        self.manager.save(step, args=ocp.args.Composite(
            train_state=ocp.args.StandardSave(state_dict["train_state"]), host=ocp.args.JsonSave(host)))
        return step

    def latest(self) -> int | None:
        """The newest complete checkpoint's batch index, or None."""
        return self.manager.latest_step()

    def restore(self, state: State, step: int | None = None) -> int:
        """Load checkpoint ``step`` (the newest by default) into ``state``, on its current shardings."""
        step = self.latest() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.folder}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state.train_state)
        restored = self.manager.restore(step, args=ocp.args.Composite(
            train_state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore()))
        host = dict(restored["host"])
        host["rng"] = np.asarray(host["rng"], np.uint32)
        state.load_state_dict({**host, "train_state": restored["train_state"]})
        return step

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (np.ndarray, jax.Array)):
        return np.asarray(value).tolist()
    raise TypeError(f"checkpoint: {type(value).__name__} in a state_dict is not JSON-serialisable")
